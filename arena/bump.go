package arena

import (
	"context"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// DefaultAlign is the alignment of Make and MakeTensor allocations unless
// ArenaOptions.Align says otherwise: a cache line, and enough for any vector load.
const DefaultAlign = 64

// ArenaOptions configure an Arena. The zero value keeps every committed granule across
// Reset and aligns typed allocations to DefaultAlign.
type ArenaOptions struct {
	// Align is the alignment in bytes of Make and MakeTensor allocations (at least the
	// element's alignment, its size for a number, is always used); 0 means
	// DefaultAlign. It must be a power of two.
	Align int
	// DecommitOnReset makes Reset give back the granules past the high-water mark of
	// the step it ends (the most bytes in use since the previous Reset), so memory
	// committed for one unusually large step goes back to the system. Off, Reset keeps
	// every granule committed and the next step reuses them for nothing.
	//
	// NB: steps that alternate between large and small would then commit and
	// decommit every step; leave it off for such a load and call Trim when it suits.
	DecommitOnReset bool
}

// Arena is a bump allocator over a Buffer, for tensors that live one step
// (activations, scratch). An allocation takes the next aligned bytes; the buffer grows
// by whole granules as the bump pointer passes its length, on a base that never
// moves. Nothing is freed one by one: Reset frees everything, Rewind frees back to a
// Mark, and Release frees only the latest allocation.
//
// # Memory management
//
// The Arena owns its Buffer and MUST be released with Close, which closes the buffer.
// Memory handed out is NOT zeroed: it holds whatever an earlier step left there.
// EVERY SLICE, TENSOR AND ADDRESS THE ARENA HANDED OUT IS DEAD AFTER THE RESET OR
// REWIND THAT FREES IT; the next allocation reuses its bytes. No check can see such a
// use, as with any arena.
//
// # Concurrency
//
// An Arena is used by one goroutine at a time. The memory it hands out may be read and
// written from any goroutine, as any memory.
type Arena[R any, B backing.Backing[R]] struct {
	_ nocopy.NoCopy

	buf             *Buffer[R, B]
	gran            int
	align           int
	decommitOnReset bool

	top   int         // bytes in use: the next allocation starts at or after top
	high  int         // the most bytes in use since the last Reset
	marks []markEntry // the live marks, oldest first
	// The latest allocation, which Release can take back: its serial number (0: none,
	// or freed) and its start.
	lastID    uint64
	lastStart int
	nextID    uint64 // serial numbers of allocations and marks
	closed    bool
}

type markEntry struct {
	off int
	id  uint64
}

// Mark is a point in an Arena's allocations that Rewind returns to. Its zero value is
// no mark.
type Mark struct {
	owner any    // the arena that made it
	depth int    // its index in the arena's mark stack
	id    uint64 // its serial number: a mark taken later at the same depth differs
}

// NewArena returns an Arena that allocates from buf, starting at offset 0. The Arena
// takes ownership of buf: nothing else may resize or close it, and closing the Arena
// closes it. Bytes buf already has committed count as warm. It fails with ErrInvalidAlignment
// for a bad opts.Align.
func NewArena[R any, B backing.Backing[R]](buf *Buffer[R, B], opts ArenaOptions) (*Arena[R, B], error) {
	align := opts.Align
	if align == 0 {
		align = DefaultAlign
	}
	if !backing.IsPowerOfTwo(align) {
		return nil, fmt.Errorf("%w: %d", ErrInvalidAlignment, opts.Align)
	}
	return &Arena[R, B]{
		buf:             buf,
		gran:            buf.Granularity(),
		align:           align,
		decommitOnReset: opts.DecommitOnReset,
	}, nil
}

func (a *Arena[R, B]) live() {
	if a.closed {
		panic(PanicArenaClosed)
	}
}

// Buffer returns the buffer the arena allocates from. The arena still owns it.
func (a *Arena[R, B]) Buffer() *Buffer[R, B] { return a.buf }

// Used returns the bytes in use: the offset the next allocation starts at or after.
func (a *Arena[R, B]) Used() int { return a.top }

// HighWater returns the most bytes in use since the last Reset.
func (a *Arena[R, B]) HighWater() int { return a.high }

// Committed returns the bytes of the buffer backed by memory.
func (a *Arena[R, B]) Committed() int { return a.buf.Committed() }

// Capacity returns the most bytes the arena can hand out: its buffer's capacity.
func (a *Arena[R, B]) Capacity() int { return a.buf.Capacity() }

// Alloc returns the offset in the buffer of size fresh bytes whose address is a
// multiple of align, a positive power of two. When they end past the buffer's length
// it grows the buffer to the next granule boundary, which under ByBuffer charges the
// budget first. It fails with ErrInvalidSize, ErrInvalidAlignment, ErrArenaFull (also
// matching ErrCapacity) past the capacity, or the buffer's error (a budget refusal
// matches accounting.ErrBudgetExceeded); a failed Alloc changes nothing.
func (a *Arena[R, B]) Alloc(size, align int) (int, error) {
	return a.alloc(context.Background(), false, size, align)
}

// AllocCtx is Alloc that, when growing the buffer needs budget the governor can not
// give now, waits for it in the governor's FIFO queue of the device until ctx ends
// (Buffer.ResizeCtx): a step's scratch then waits for memory other requests are
// giving back instead of failing. A request larger than the device's whole limit
// fails at once; a cancelled wait changes nothing.
func (a *Arena[R, B]) AllocCtx(ctx context.Context, size, align int) (int, error) {
	if ctx == nil {
		panic("arena: AllocCtx with a nil context")
	}
	return a.alloc(ctx, true, size, align)
}

// alloc is Alloc, and AllocCtx when wait is set: only then does growth wait for the
// budget until ctx ends.
func (a *Arena[R, B]) alloc(ctx context.Context, wait bool, size, align int) (int, error) {
	a.live()
	if size < 0 {
		return 0, fmt.Errorf("%w: allocation of %d bytes", ErrInvalidSize, size)
	}
	if !backing.IsPowerOfTwo(align) {
		return 0, fmt.Errorf("%w: %d", ErrInvalidAlignment, align)
	}
	// Align the address, not only the offset: the base need not be aligned to align.
	pad := int(-(a.buf.Base() + uintptr(a.top)) & uintptr(align-1))
	capacity := a.buf.Capacity()
	if pad > capacity-a.top || size > capacity-a.top-pad {
		return 0, fmt.Errorf("%w: %d bytes aligned to %d at offset %d, capacity %d (%w)",
			ErrArenaFull, size, align, a.top, capacity, ErrCapacity)
	}
	start := a.top + pad
	end := start + size
	if end > a.buf.Len() {
		n, _ := backing.AlignUp(end, a.gran) // cannot overflow: end <= capacity, a granule multiple
		var err error
		if wait {
			err = a.buf.ResizeCtx(ctx, n)
		} else {
			err = a.buf.Resize(n)
		}
		if err != nil {
			return 0, fmt.Errorf("arena: growing the arena to %d bytes: %w", n, err)
		}
	}
	a.top = end
	a.high = max(a.high, end)
	a.nextID++
	a.lastID, a.lastStart = a.nextID, start
	return start, nil
}

// Allocate is Alloc that returns an Allocation, for the Allocator contract.
func (a *Arena[R, B]) Allocate(size, align int) (Allocation, error) {
	off, err := a.Alloc(size, align)
	if err != nil {
		return Allocation{}, err
	}
	return Allocation{Ptr: a.buf.Base() + uintptr(off), Size: size, owner: a, id: a.lastID}, nil
}

// Release takes back al if it is the latest allocation and nothing was allocated,
// marked, rewound or reset since: the bump pointer returns to its start. Any other
// allocation stays in place until a Reset or Rewind frees it. Either way the outcome is
// Complete with 0 bytes unmapped: the memory stays committed for reuse (Reset with
// DecommitOnReset, Trim or Close give memory back). Releasing an allocation twice does
// nothing the second time. It panics with PanicForeignAllocation for an allocation
// another allocator made.
func (a *Arena[R, B]) Release(al Allocation) accounting.ReleaseOutcome {
	a.live()
	if al.owner != any(a) {
		panic(PanicForeignAllocation)
	}
	if al.id == a.lastID && al.id != 0 {
		a.top = a.lastStart
		a.lastID = 0
	}
	return accounting.Released(0)
}

// Device returns the memory the arena allocates: its backing's device.
func (a *Arena[R, B]) Device() accounting.DeviceKey { return a.buf.Backing().Device() }

// VirtualBacking reports true: an Arena sits on a Buffer, a reserved range that grows
// in granules on a base that never moves.
func (a *Arena[R, B]) VirtualBacking() bool { return true }

// CommitsOnDemand reports true (see [OnDemand]): the arena's buffer commits a granule
// only when the bump pointer reaches it, and each commit is charged to the governor
// as it is made (by the buffer's authority under ByBuffer, by the backing's pool
// under ByBacking), so a refused commit is an error, never an over-commitment.
func (a *Arena[R, B]) CommitsOnDemand() bool { return true }

// CanShare reports whether the arena's backing can map physical granules into other
// buffers (backing.Sharer under ByBacking accounting; see Buffer.ShareFrom). The
// arena's own allocations are never shared.
func (a *Arena[R, B]) CanShare() bool {
	b := a.buf.Backing()
	_, ok := any(b).(backing.Sharer[R])
	return ok && b.Accounting().OwnedByBacking()
}

// HostAccessible reports whether the CPU may touch the arena's memory (Make works).
func (a *Arena[R, B]) HostAccessible() bool { return a.buf.HostAccessible() }

// Mark returns the current point of the arena, for Rewind.
func (a *Arena[R, B]) Mark() Mark {
	a.live()
	a.nextID++
	a.marks = append(a.marks, markEntry{off: a.top, id: a.nextID})
	a.lastID = 0 // Release must not take back what is under a mark
	return Mark{owner: a, depth: len(a.marks) - 1, id: a.nextID}
}

// Rewind frees every allocation made since m was taken: the bump pointer returns to m.
// m stays valid and may be rewound to again; marks taken after m become invalid. It
// panics with PanicBadMark for a mark that a Rewind to an older mark or a Reset
// invalidated, or that another arena made.
func (a *Arena[R, B]) Rewind(m Mark) {
	a.live()
	if m.owner != any(a) || m.depth >= len(a.marks) || a.marks[m.depth].id != m.id {
		panic(PanicBadMark)
	}
	a.top = a.marks[m.depth].off
	a.marks = a.marks[:m.depth+1]
	a.lastID = 0
}

// Reset frees every allocation and invalidates every mark; the bump pointer returns to
// 0. The committed granules stay committed, so the next step's allocations reuse them
// at no cost, unless ArenaOptions.DecommitOnReset asks to give back those past the
// step's high-water mark. It fails only then, when the decommit fails; the arena is
// reset either way and keeps the granules it could not give back.
func (a *Arena[R, B]) Reset() error {
	a.live()
	high := a.high
	a.top, a.high, a.lastID = 0, 0, 0
	a.marks = a.marks[:0]
	if a.decommitOnReset {
		return a.trim(high)
	}
	return nil
}

// Trim gives back the committed granules past max(keep, Used()), rounded up to the
// granule; the buffer's length drops to that point. It fails with ErrInvalidSize for a
// negative keep, or with the buffer's error, changing nothing.
func (a *Arena[R, B]) Trim(keep int) error {
	a.live()
	if keep < 0 {
		return fmt.Errorf("%w: trim to %d bytes", ErrInvalidSize, keep)
	}
	return a.trim(max(keep, a.top))
}

func (a *Arena[R, B]) trim(keep int) error {
	n, ok := backing.AlignUp(keep, a.gran)
	if !ok || n >= a.buf.Len() {
		return nil
	}
	if err := a.buf.Resize(n); err != nil {
		return fmt.Errorf("arena: trimming the arena to %d bytes: %w", n, err)
	}
	return nil
}

// Close closes the arena and its buffer and returns the buffer's release outcome.
// When it is Failed nothing changed and Close may be called again; otherwise any later
// use of the arena panics with PanicArenaClosed, but a second Close, which changes
// nothing and returns a Failed outcome whose error matches ErrClosed
// (docs/server.md, "A second Close").
func (a *Arena[R, B]) Close() accounting.ReleaseOutcome {
	if a.closed {
		return accounting.FailedRelease(0, fmt.Errorf("%w: Arena closed twice", ErrClosed))
	}
	out := a.buf.Close()
	if out.Status != accounting.Failed {
		a.closed = true
		a.top, a.high, a.lastID = 0, 0, 0
		a.marks = nil
	}
	return out
}

// Make returns a slice of n elements of type T from the arena, aligned to
// ArenaOptions.Align (and at least T's alignment: its size for a number). The
// elements are NOT zeroed. The arena's memory must be host-accessible
// (ErrNotHostAccessible); otherwise it fails as Alloc does, and with ErrInvalidSize for
// a negative or overflowing n.
func Make[T Elem, R any, B backing.Backing[R]](a *Arena[R, B], n int) ([]T, error) {
	a.live()
	if !a.buf.HostAccessible() {
		return nil, fmt.Errorf("%w: Make on %v", ErrNotHostAccessible, a.Device())
	}
	size := sizeOf[T]()
	bytes, ok := mulOK(n, size)
	if n < 0 || !ok {
		return nil, fmt.Errorf("%w: %d elements of %d bytes", ErrInvalidSize, n, size)
	}
	off, err := a.Alloc(bytes, max(a.align, alignOf[T]()))
	if err != nil {
		return nil, err
	}
	return sliceAt[T](a.buf.Base()+uintptr(off), n), nil
}

// MakeTensor returns a row-major tensor of the given shape from the arena, aligned as
// Make aligns. The elements are NOT zeroed. It works on device memory too (the tensor
// then gives only its address). It fails with ErrInvalidShape for a bad shape, or as
// Alloc does.
func MakeTensor[T Elem, R any, B backing.Backing[R]](a *Arena[R, B], shape ...int) (Tensor[T], error) {
	a.live()
	t, err := layout[T](shape, nil)
	if err != nil {
		return Tensor[T]{}, err
	}
	size := sizeOf[T]()
	off, err := a.Alloc(t.numel*size, max(a.align, alignOf[T]()))
	if err != nil {
		return Tensor[T]{}, err
	}
	// Alloc made [off, off+span) part of the buffer's length and aligned its address,
	// which is everything NewTensor would check.
	t.mem, t.off = a.buf, off
	return t, nil
}
