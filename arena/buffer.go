package arena

import (
	"context"
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Memory is what a typed view needs of a buffer.
type Memory interface {
	Base() uintptr        // first address; never changes
	Len() int             // bytes in use: committed and valid to view
	HostAccessible() bool // whether the CPU may dereference [Base, Base+Len)
}

// Buffer is a growable region of one backing's memory on a base address that never
// changes. Its zero value is not usable; call NewBuffer.
type Buffer[R any, B backing.Backing[R]] struct {
	_ nocopy.NoCopy

	b         B
	r         R
	auth      *accounting.Authority // charged per granule under ByBuffer; nil under ByBacking
	base      uintptr
	gran      int
	capacity  int
	length    int
	committed int
	shared    int // bytes at the start that map another buffer's granules
	host      bool
	closed    bool
}

// NewBuffer reserves capacity bytes (rounded up to the granule) of b's address space
// and returns an empty Buffer over it; it commits nothing. auth is required when b's
// accounting is ByBuffer (the buffer charges its granules there) and must be nil under
// ByBacking (the backing charges). The Buffer MUST be released with Close.
func NewBuffer[R any, B backing.Backing[R]](b B, capacity int, auth *accounting.Authority) (*Buffer[R, B], error) {
	g := b.Granularity()
	size, ok := backing.AlignUp(capacity, g)
	if !ok {
		return nil, fmt.Errorf("%w: capacity %d", ErrInvalidSize, capacity)
	}
	if err := checkAuthority(b, auth); err != nil {
		return nil, err
	}
	r, err := b.Reserve(size)
	if err != nil {
		return nil, err
	}
	return &Buffer[R, B]{
		b:        b,
		r:        r,
		auth:     auth,
		base:     b.Base(r),
		gran:     g,
		capacity: size,
		host:     backing.IsHostAccessible(b),
	}, nil
}

// checkAuthority returns an ErrAuthority error unless auth fits b's accounting: an
// authority on b's device under ByBuffer, none under ByBacking.
func checkAuthority[R any, B backing.Backing[R]](b B, auth *accounting.Authority) error {
	byBacking := b.Accounting().OwnedByBacking()
	switch {
	case !byBacking && auth == nil:
		return fmt.Errorf("%w: a ByBuffer backing needs an authority to charge", ErrAuthority)
	case byBacking && auth != nil:
		return fmt.Errorf("%w: the backing owns its memory (%v); pass a nil authority", ErrAuthority, b.Accounting())
	case auth != nil && auth.Device() != b.Device():
		return fmt.Errorf("%w: authority is on %v, backing on %v", ErrAuthority, auth.Device(), b.Device())
	}
	return nil
}

func (buf *Buffer[R, B]) live() {
	if buf.closed {
		panic(PanicClosed)
	}
}

// Base returns the first address of the buffer. It never changes.
func (buf *Buffer[R, B]) Base() uintptr { return buf.base }

// Len returns the bytes in use.
func (buf *Buffer[R, B]) Len() int { return buf.length }

// Committed returns the bytes backed by memory: Len rounded up to the granule.
func (buf *Buffer[R, B]) Committed() int { return buf.committed }

// Shared returns the bytes at the start of the buffer that map another buffer's
// physical granules (see ShareFrom).
func (buf *Buffer[R, B]) Shared() int { return buf.shared }

// Capacity returns the reserved bytes: the most Len can become.
func (buf *Buffer[R, B]) Capacity() int { return buf.capacity }

// Granularity returns the backing's granule size.
func (buf *Buffer[R, B]) Granularity() int { return buf.gran }

// HostAccessible reports whether the CPU may touch the buffer's memory.
func (buf *Buffer[R, B]) HostAccessible() bool { return buf.host }

// Backing returns the backing the buffer commits from.
func (buf *Buffer[R, B]) Backing() B { return buf.b }

// Reservation returns the buffer's reservation. The buffer still owns it: do not
// commit, decommit or unreserve through it.
func (buf *Buffer[R, B]) Reservation() R { return buf.r }

// Bytes returns the first Len bytes of a host buffer. The slice is valid until the
// buffer shrinks below it or closes. It panics with PanicDeviceBytes on a buffer whose
// memory the CPU must not touch.
func (buf *Buffer[R, B]) Bytes() []byte {
	buf.live()
	if !buf.host {
		panic(PanicDeviceBytes)
	}
	if buf.length == 0 {
		return nil
	}
	return sliceAt[byte](buf.base, buf.length)
}

// Resize sets Len to n. Growing commits the whole granules needed to cover n (under
// ByBuffer, charged to the authority first); shrinking decommits the granules wholly
// past n, whose contents are forfeit. A refused or failed resize returns the error and
// changes nothing: a budget refusal matches accounting.ErrBudgetExceeded.
func (buf *Buffer[R, B]) Resize(n int) error { return buf.resize(context.Background(), false, n) }

// ResizeCtx is Resize that, when growth needs budget the governor can not give now,
// waits for it in the governor's FIFO queue of the device until ctx ends: itself under
// ByBuffer and on a backing that owns its memory but can not wait, through the
// backing on a backing.Waiter. A request larger than the device's whole limit fails
// at once. A cancelled wait changes nothing.
func (buf *Buffer[R, B]) ResizeCtx(ctx context.Context, n int) error {
	if ctx == nil {
		panic("arena: ResizeCtx with a nil context")
	}
	return buf.resize(ctx, true, n)
}

// resize is Resize, and ResizeCtx when wait is set: only then does growth wait for
// the budget until ctx ends.
func (buf *Buffer[R, B]) resize(ctx context.Context, wait bool, n int) error {
	buf.live()
	if n < 0 {
		return fmt.Errorf("%w: length %d", ErrInvalidSize, n)
	}
	if n > buf.capacity {
		return fmt.Errorf("%w: length %d, capacity %d", ErrCapacity, n, buf.capacity)
	}
	need, _ := backing.AlignUp(n, buf.gran) // cannot overflow: n <= capacity
	switch {
	case need > buf.committed:
		if err := buf.commit(ctx, wait, buf.committed, need-buf.committed); err != nil {
			return err
		}
	case need < buf.committed:
		if err := buf.b.Decommit(buf.r, need, buf.committed-need); err != nil {
			return err
		}
		if buf.auth != nil {
			buf.auth.Unmap(int64(buf.committed - need))
			buf.auth.Release(int64(buf.committed - need))
		}
		buf.committed = need
		buf.shared = min(buf.shared, need)
	}
	buf.length = n
	return nil
}

// commit backs [off, off+size) with memory, charging first under ByBuffer; with wait
// set, a budget refusal waits until ctx ends.
func (buf *Buffer[R, B]) commit(ctx context.Context, wait bool, off, size int) error {
	if buf.auth != nil {
		var err error
		if wait {
			err = buf.auth.Acquire(ctx, int64(size))
		} else {
			err = buf.auth.TryAcquire(int64(size))
		}
		if err != nil {
			return err
		}
		if err := buf.b.Commit(buf.r, off, size); err != nil {
			buf.auth.Release(int64(size))
			return err
		}
		buf.auth.Map(int64(size))
		buf.committed = off + size
		return nil
	}
	var err error
	if w, ok := any(buf.b).(backing.Waiter[R]); ok && wait {
		err = w.CommitCtx(ctx, buf.r, off, size)
		if errors.Is(err, backing.ErrUnsupported) {
			err = buf.commitRetry(ctx, wait, off, size)
		}
	} else {
		err = buf.commitRetry(ctx, wait, off, size)
	}
	if err != nil {
		return err
	}
	buf.committed = off + size
	return nil
}

// commitRetry commits [off, off+size) on a backing that owns its memory but can not
// wait itself: with wait set, a budget refusal waits in the governor's FIFO queue of
// the device for the bytes the backing asked for, then commits with them
// (Authority.AcquireFor), until ctx ends.
func (buf *Buffer[R, B]) commitRetry(ctx context.Context, wait bool, off, size int) error {
	err := buf.b.Commit(buf.r, off, size)
	if !wait {
		return err
	}
	auth := buf.b.Accounting().Authority()
	for accounting.CanWait(err) {
		var refused *accounting.BudgetError
		if !errors.As(err, &refused) {
			return err
		}
		if werr := auth.AcquireFor(ctx, refused.Requested, func() error {
			err = buf.b.Commit(buf.r, off, size)
			return nil
		}); werr != nil {
			return werr
		}
	}
	return err
}

// ShareFrom maps the physical granules behind the first size bytes of src into this
// empty buffer, with access prot, and sets Len to size. size must be a multiple of the
// granule and at most src.Committed(). Both buffers must be on the same backing, which
// must be a backing.Sharer that owns its memory (ByBacking). The physical granules stay alive while either buffer maps
// them. Writing through a ReadOnly share faults. ReadWrite of bytes that src may not
// write (shared to it ReadOnly, or protected by Protect) fails with an error matching
// backing.ErrReadOnly.
func (buf *Buffer[R, B]) ShareFrom(src *Buffer[R, B], size int, prot backing.Protection) error {
	buf.live()
	src.live()
	s, ok := any(buf.b).(backing.Sharer[R])
	if !ok || !buf.b.Accounting().OwnedByBacking() {
		// NB: under ByBuffer a shared granule would be charged to whichever buffer
		// committed it and freed from the ledger while another still maps it.
		return ErrNoSharing
	}
	switch {
	case buf.committed != 0:
		return fmt.Errorf("%w: %d bytes committed", ErrNotEmpty, buf.committed)
	case size < 0 || size%buf.gran != 0:
		return fmt.Errorf("%w: share of %d bytes is not a multiple of the %d-byte granule", ErrInvalidSize, size, buf.gran)
	case size > src.committed:
		return fmt.Errorf("%w: share of %d bytes from a buffer with %d committed", ErrInvalidSize, size, src.committed)
	case size > buf.capacity:
		return fmt.Errorf("%w: share of %d bytes, capacity %d", ErrCapacity, size, buf.capacity)
	}
	if size == 0 {
		return nil
	}
	if err := s.Share(buf.r, 0, src.r, 0, size, prot); err != nil {
		return err
	}
	buf.committed, buf.shared, buf.length = size, size, size
	return nil
}

// Protect sets the access of the buffer's committed bytes [off, off+size) to prot in
// place: ReadOnly makes them read-only through this buffer, ReadWrite writable again.
// off and size must be multiples of the granule and the range must lie within
// Committed(). The contents stay, and other buffers mapping the same granules (see
// ShareFrom) keep their own access. A granule this buffer maps by a ReadOnly ShareFrom
// can not be made ReadWrite: that fails with an error matching backing.ErrReadOnly.
// Protection lasts until the bytes are decommitted (Resize below them); memory
// committed again is read-write.
//
// A write to read-only bytes through the backing's copies fails; a store through
// Bytes or a host view faults (SIGSEGV, fatal unless the goroutine runs under
// runtime/debug.SetPanicOnFault). On a backing that is not a backing.Protector it
// returns an error matching ErrNoProtection (and errors.ErrUnsupported). On error
// nothing changed.
func (buf *Buffer[R, B]) Protect(off, size int, prot backing.Protection) error {
	buf.live()
	p, ok := any(buf.b).(backing.Protector[R])
	if !ok {
		return fmt.Errorf("%w: %T", ErrNoProtection, buf.b)
	}
	switch {
	case off < 0 || size < 0 || off%buf.gran != 0 || size%buf.gran != 0:
		return fmt.Errorf("%w: protect [%d, +%d) is not granule-aligned (%d-byte granule)", ErrInvalidSize, off, size, buf.gran)
	case off > buf.committed-size:
		return fmt.Errorf("%w: protect [%d, +%d) past the %d committed bytes", ErrInvalidSize, off, size, buf.committed)
	}
	if err := p.Protect(buf.r, off, size, prot); err != nil {
		if errors.Is(err, backing.ErrUnsupported) {
			return fmt.Errorf("%w: %w", ErrNoProtection, err)
		}
		return err
	}
	return nil
}

// Close decommits everything and gives back the address range. The outcome is honest:
// Complete; Failed when nothing changed (the buffer is still usable and Close may be
// called again); Quarantined when the backing failed midway (the buffer is unusable;
// Residual bytes stay charged because they are still held).
func (buf *Buffer[R, B]) Close() accounting.ReleaseOutcome {
	buf.live()
	out := buf.b.Unreserve(buf.r)
	if out.Status == accounting.Failed {
		return out
	}
	if buf.auth != nil {
		// Under ByBuffer the buffer's committed bytes are exactly what it charged;
		// what the backing could not give back stays charged.
		freed := int64(buf.committed)
		if out.Status == accounting.Quarantined {
			freed = max(int64(buf.committed)-out.Residual, 0)
			buf.auth.Quarantine(out.Residual, out.Err) // the buffer owns what is left
		}
		buf.auth.Unmap(freed)
		buf.auth.Release(freed)
	}
	buf.closed = true
	buf.length, buf.committed, buf.shared = 0, 0, 0
	return out
}
