package arena

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Memory is what a typed view needs of a buffer.
type Memory interface {
	Base() uintptr        // first address; never changes
	Len() int             // bytes in use: committed and valid to view (a Buffer's from its Start)
	HostAccessible() bool // whether the CPU may dereference [Base, Base+Len)
}

// Buffer is a growable region of one backing's memory on a base address that never
// changes. Its zero value is not usable; call NewBuffer.
type Buffer[R any, B backing.Backing[R]] struct {
	_ nocopy.NoCopy

	b        B
	leak     invariants.Tracker // reports it collected unclosed in the invariants build
	r        R
	auth     *accounting.Authority // charged per granule under ByBuffer; nil under ByBacking
	base     uintptr
	gran     int
	capacity int
	length   int
	// The committed granules are one run [start, end): below start the buffer gave
	// them back (DecommitBelow) or left them behind (LeaveBehind), past end it never
	// committed them.
	start, end int
	shared     []span // the parts of [start, end) that map another buffer's granules, in order
	host       bool
	closed     bool
	// ahead is the run of granules committed past end by CommitAhead and not yet
	// adopted (see ahead.go): 0 for none, aheadBusy while a call commits or
	// decommits it. It is the one field that other goroutines than the owner touch.
	ahead atomic.Int64
	// behind is the run of granules below start that LeaveBehind left committed and
	// DecommitBehind has not given back (see behind.go), packed as ahead is.
	behind atomic.Int64
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
	buf := &Buffer[R, B]{
		b:        b,
		r:        r,
		auth:     auth,
		base:     b.Base(r),
		gran:     g,
		capacity: size,
		host:     backing.IsHostAccessible(b),
	}
	invariants.Track(&buf.leak, buf, "arena.Buffer")
	return buf, nil
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
	if invariants.Enabled {
		buf.checkBooks()
	}
}

// Base returns the first address of the buffer. It never changes.
func (buf *Buffer[R, B]) Base() uintptr { return buf.base }

// Len returns the bytes in use.
func (buf *Buffer[R, B]) Len() int { return buf.length }

// Committed returns the bytes backed by memory: from Start to Len rounded up to the
// granule.
func (buf *Buffer[R, B]) Committed() int { return buf.end - buf.start }

// Start returns the offset of the first committed byte: 0 unless DecommitBelow gave
// back the granules before it. The bytes of [0, Start) are Reserved.
func (buf *Buffer[R, B]) Start() int { return buf.start }

// Shared returns the bytes of Committed that map another buffer's physical granules
// (see ShareFrom and ShareRange).
func (buf *Buffer[R, B]) Shared() int {
	n := 0
	for _, sp := range buf.shared {
		n += sp.end - sp.off
	}
	return n
}

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
// buffer shrinks below it or closes. NB: its bytes below Start are Reserved, not
// committed: touching them faults. It panics with PanicDeviceBytes on a buffer whose
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
// past n, whose contents are forfeit. A length below Start is refused with
// ErrInvalidSize (what DecommitBelow gave back does not come back), except 0, which
// empties the buffer and moves Start back to 0. A refused or failed resize returns the error and
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
	if n != 0 && n < buf.start {
		return fmt.Errorf("%w: length %d below the %d bytes given back", ErrInvalidSize, n, buf.start)
	}
	need, _ := backing.AlignUp(n, buf.gran) // cannot overflow: n <= capacity
	if need > buf.end {
		if err := buf.aheadClear(need); err != nil {
			return err
		}
		if err := buf.behindClear(buf.end, need); err != nil {
			return err
		}
	}
	switch {
	case need > buf.end:
		if err := buf.commit(ctx, wait, buf.end, need-buf.end); err != nil {
			return err
		}
	case need < buf.end:
		from := max(need, buf.start) // need is below start only when n is 0
		if err := buf.decommit(from, buf.end); err != nil {
			return err
		}
		buf.start, buf.end = min(buf.start, need), need
		buf.clipShared()
	case n == 0:
		buf.start = 0 // an empty buffer grows from 0 again
	}
	buf.length = n
	return nil
}

// DecommitBelow moves the whole granules of [Start, off) from Committed to Reserved:
// their contents are forfeit (shared ones are unmapped here only) and, under
// ByBuffer, their charge goes back to the authority. Start becomes off rounded down
// to the granule; the base, Len and the granules from there on stay. Touching the
// bytes below Start is then the caller's bug (on the host it faults). off must be in
// [0, Len]; an off at or below Start changes nothing. Growing on with Resize works
// as before. On error nothing changed.
func (buf *Buffer[R, B]) DecommitBelow(off int) error {
	buf.live()
	if off < 0 || off > buf.length {
		return fmt.Errorf("%w: decommit below %d of a buffer of length %d", ErrInvalidSize, off, buf.length)
	}
	to := off - off%buf.gran
	if to <= buf.start {
		return nil
	}
	if err := buf.decommit(buf.start, to); err != nil {
		return err
	}
	buf.start = to
	buf.clipShared()
	return nil
}

// StartAt moves the Start of a buffer that commits nothing (Len 0) to off, a
// multiple of the granule in [0, Capacity]: growth (Resize, or ShareRange at off)
// then commits from off on, and the bytes below stay Reserved, as if DecommitBelow had
// given them back. A holder of a window of tokens starts there rather than commit
// bytes it would give back at once. It fails with ErrNotEmpty on a buffer with
// bytes in use and ErrInvalidSize for an off that is not granule-aligned or past the
// capacity; on error nothing changed.
func (buf *Buffer[R, B]) StartAt(off int) error {
	buf.live()
	switch {
	case buf.length != 0 || buf.end != buf.start:
		return fmt.Errorf("%w: start at %d of a buffer with [%d, %d) committed", ErrNotEmpty, off, buf.start, buf.end)
	case off < 0 || off > buf.capacity || off%buf.gran != 0:
		return fmt.Errorf("%w: start at %d (%d-byte granule, capacity %d)", ErrInvalidSize, off, buf.gran, buf.capacity)
	}
	buf.start, buf.end = off, off
	return nil
}

// decommit moves the committed granules [from, to) to Reserved and, under ByBuffer,
// gives their charge back; the caller then moves start or end.
func (buf *Buffer[R, B]) decommit(from, to int) error {
	if from >= to {
		return nil
	}
	if err := buf.b.Decommit(buf.r, from, to-from); err != nil {
		return err
	}
	if buf.auth != nil {
		buf.auth.Unmap(int64(to - from))
		buf.auth.Release(int64(to - from))
	}
	return nil
}

// span is a range [off, end) of a buffer's bytes.
type span struct{ off, end int }

// clipShared drops the parts of the shared spans outside [start, end).
func (buf *Buffer[R, B]) clipShared() {
	kept := buf.shared[:0]
	for _, sp := range buf.shared {
		sp.off, sp.end = max(sp.off, buf.start), min(sp.end, buf.end)
		if sp.off < sp.end {
			kept = append(kept, sp)
		}
	}
	buf.shared = kept
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
		buf.end = off + size
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
	buf.end = off + size
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
		if werr := auth.AcquireFor(ctx, refused.Requested, func(int64) error {
			err = buf.b.Commit(buf.r, off, size)
			return nil
		}); werr != nil {
			return werr
		}
	}
	return err
}

// ShareFrom maps the physical granules behind the first size bytes of src into this
// empty buffer, with access prot, and sets Len to size: it is ShareRange(src, 0, 0,
// size, prot).
func (buf *Buffer[R, B]) ShareFrom(src *Buffer[R, B], size int, prot backing.Protection) error {
	return buf.ShareRange(src, 0, 0, size, prot)
}

// ShareRange moves [dstOff, dstOff+size) of this buffer from Reserved to Committed by
// mapping the physical granules behind src's bytes [srcOff, srcOff+size), with access
// prot, and sets Len to dstOff+size. The offsets and size must be multiples of the
// granule, src's range must lie within its committed bytes [src.Start(),
// src.Start()+src.Committed()), and the buffer's committed bytes stay one run: the
// buffer must have none (Start becomes dstOff) or end them exactly at dstOff. Both
// buffers must be on the same backing, which must be a backing.Sharer that owns its
// memory (ByBacking). The physical granules stay alive while either buffer maps
// them. Writing through a ReadOnly share faults. ReadWrite of bytes that src may not
// write (shared to it ReadOnly, or protected by Protect) fails with an error matching
// backing.ErrReadOnly. On error nothing changed.
func (buf *Buffer[R, B]) ShareRange(src *Buffer[R, B], srcOff, dstOff, size int, prot backing.Protection) error {
	buf.live()
	src.live()
	s, ok := any(buf.b).(backing.Sharer[R])
	if !ok || !buf.b.Accounting().OwnedByBacking() {
		// NB: under ByBuffer a shared granule would be charged to whichever buffer
		// committed it and freed from the ledger while another still maps it.
		return ErrNoSharing
	}
	switch {
	case buf.end > buf.start && dstOff != buf.end:
		return fmt.Errorf("%w: share at %d, but [%d, %d) is committed: a share must start where the committed bytes end", ErrNotEmpty, dstOff, buf.start, buf.end)
	case srcOff < 0 || dstOff < 0 || size < 0 || srcOff%buf.gran != 0 || dstOff%buf.gran != 0 || size%buf.gran != 0:
		return fmt.Errorf("%w: share of [%d, +%d) at %d is not granule-aligned (%d-byte granule)", ErrInvalidSize, srcOff, size, dstOff, buf.gran)
	case srcOff < src.start || srcOff > src.end-size:
		return fmt.Errorf("%w: share of [%d, +%d) from a buffer with [%d, %d) committed", ErrInvalidSize, srcOff, size, src.start, src.end)
	case dstOff > buf.capacity-size:
		return fmt.Errorf("%w: share of %d bytes at %d, capacity %d", ErrCapacity, size, dstOff, buf.capacity)
	}
	if size == 0 {
		return nil
	}
	if err := buf.behindClear(dstOff, dstOff+size); err != nil {
		return err
	}
	if err := s.Share(buf.r, dstOff, src.r, srcOff, size, prot); err != nil {
		return err
	}
	buf.mapped(dstOff, size)
	return nil
}

// mapped records [dstOff, dstOff+size), just mapped from elsewhere (a Share, a
// Borrow) at the buffer's end, as the buffer's end and as shared.
func (buf *Buffer[R, B]) mapped(dstOff, size int) {
	if buf.end == buf.start {
		buf.start = dstOff
	}
	buf.end, buf.length = dstOff+size, dstOff+size
	if n := len(buf.shared); n > 0 && buf.shared[n-1].end == dstOff {
		buf.shared[n-1].end = buf.end
	} else {
		buf.shared = append(buf.shared, span{dstOff, buf.end})
	}
}

// Protect sets the access of the buffer's committed bytes [off, off+size) to prot in
// place: ReadOnly makes them read-only through this buffer, ReadWrite writable again.
// off and size must be multiples of the granule and the range must lie within the
// committed bytes [Start, Start+Committed). The contents stay, and other buffers
// mapping the same granules (see ShareFrom) keep their own access. A granule this
// buffer maps by a ReadOnly ShareFrom can not be made ReadWrite: that fails with an
// error matching backing.ErrReadOnly. Protection lasts until the bytes are decommitted
// (Resize or DecommitBelow past them); memory committed again is read-write.
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
	case off < buf.start || off > buf.end-size:
		return fmt.Errorf("%w: protect [%d, +%d) outside the committed bytes [%d, %d)", ErrInvalidSize, off, size, buf.start, buf.end)
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
// Residual bytes stay charged because they are still held). A second Close changes
// nothing and returns a Failed outcome whose error matches ErrClosed
// (docs/server.md, "A second Close").
func (buf *Buffer[R, B]) Close() accounting.ReleaseOutcome {
	if buf.closed {
		return accounting.FailedRelease(0, fmt.Errorf("%w: Buffer closed twice", ErrClosed))
	}
	if _, err := buf.DecommitAhead(); err != nil {
		return accounting.FailedRelease(0, err)
	}
	if _, err := buf.DecommitBehind(); err != nil {
		return accounting.FailedRelease(0, err)
	}
	out := buf.b.Unreserve(buf.r)
	if out.Status == accounting.Failed {
		return out
	}
	if buf.auth != nil {
		// Under ByBuffer the buffer's committed bytes are exactly what it charged;
		// what the backing could not give back stays charged.
		freed := int64(buf.Committed())
		if out.Status == accounting.Quarantined {
			freed = max(int64(buf.Committed())-out.Residual, 0)
			buf.auth.Quarantine(out.Residual, out.Err) // the buffer owns what is left
		}
		buf.auth.Unmap(freed)
		buf.auth.Release(freed)
	}
	buf.closed = true
	buf.leak.Close()
	buf.length, buf.start, buf.end, buf.shared = 0, 0, 0, nil
	return out
}
