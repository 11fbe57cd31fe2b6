package cuda

import (
	"fmt"
	"math"
	"runtime"

	"github.com/vmarena/vmarena/backing"
)

// Host-side helpers: fill and copy committed device memory from the CPU through the
// driver's synchronous copies. Ranges are byte-granular; every granule they touch must
// be committed, and a write must not touch a granule mapped read-only.

// span validates the byte range [off, off+n) of r for op, which writes when write is
// true. r.mu must be held.
func (b *Backing) span(op string, r *Reservation, off, n int, write bool) error {
	switch {
	case off < 0 || n < 0:
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrInvalidRange, Err: fmt.Errorf("negative offset or size")}
	case off > math.MaxInt-n:
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrInvalidRange, Err: fmt.Errorf("offset plus size overflows")}
	case off+n > r.size:
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrOutOfRange, Err: fmt.Errorf("reservation is %d bytes", r.size)}
	case n == 0:
		return nil
	}
	g := b.gran
	for i := off / g; i <= (off+n-1)/g; i++ {
		s := r.slots.at(i)
		if s.h == nil {
			return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrNotCommitted, Err: fmt.Errorf("granule at %#x", i*g)}
		}
		if write && s.ro {
			return &backing.OpError{Op: op, Offset: off, Size: n, Err: fmt.Errorf("%w: granule at %#x", ErrReadOnly, i*g)}
		}
	}
	return nil
}

// access locks r, validates [off, off+n) and binds the thread; the caller must defer
// b.leave(r). On error nothing is left locked.
func (b *Backing) access(op string, r *Reservation, off, n int, write bool) error {
	if err := b.use(op, r); err != nil {
		return err
	}
	r.mu.Lock()
	if r.dead.Load() {
		r.mu.Unlock()
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := b.span(op, r, off, n, write); err != nil {
		r.mu.Unlock()
		return err
	}
	runtime.LockOSThread()
	if err := b.setCurrent(); err != nil {
		runtime.UnlockOSThread()
		r.mu.Unlock()
		return opError(op, off, n, err)
	}
	return nil
}

// leave undoes a successful access.
func (b *Backing) leave(r *Reservation) {
	runtime.UnlockOSThread()
	r.mu.Unlock()
}

// CopyIn copies src to [off, off+len(src)) of r (cuMemcpyHtoD_v2). It returns when
// the copy is done.
func (b *Backing) CopyIn(r *Reservation, off int, src []byte) error {
	const op = "copy in"
	if err := b.access(op, r, off, len(src), true); err != nil {
		return err
	}
	defer b.leave(r)
	if len(src) == 0 {
		return nil
	}
	if err := b.drv.call("cuMemcpyHtoD_v2", b.drv.MemcpyHtoD(r.base+uint64(off), bytesPtr(src), uintptr(len(src)))); err != nil {
		return opError(op, off, len(src), err)
	}
	return nil
}

// CopyOut copies [off, off+len(dst)) of r to dst (cuMemcpyDtoH_v2). It returns when
// the copy is done, after the work queued before it on the device.
func (b *Backing) CopyOut(dst []byte, r *Reservation, off int) error {
	const op = "copy out"
	if err := b.access(op, r, off, len(dst), false); err != nil {
		return err
	}
	defer b.leave(r)
	if len(dst) == 0 {
		return nil
	}
	if err := b.drv.call("cuMemcpyDtoH_v2", b.drv.MemcpyDtoH(bytesPtr(dst), r.base+uint64(off), uintptr(len(dst)))); err != nil {
		return opError(op, off, len(dst), err)
	}
	return nil
}

// Memset sets the n bytes at off of r to v (cuMemsetD8_v2). The fill may still be
// running on the device when Memset returns; Synchronize waits for it.
func (b *Backing) Memset(r *Reservation, off, n int, v byte) error {
	const op = "memset"
	if err := b.access(op, r, off, n, true); err != nil {
		return err
	}
	defer b.leave(r)
	if n == 0 {
		return nil
	}
	if err := b.drv.call("cuMemsetD8_v2", b.drv.MemsetD8(r.base+uint64(off), v, uintptr(n))); err != nil {
		return opError(op, off, n, err)
	}
	return nil
}

// CopyDtoD copies n bytes at srcOff of src to dstOff of dst, device to device
// (cuMemcpyDtoD_v2). The copy may still be running when CopyDtoD returns; Synchronize
// waits for it. The ranges may be in one reservation but must not overlap.
func (b *Backing) CopyDtoD(dst *Reservation, dstOff int, src *Reservation, srcOff, n int) error {
	const op = "copy device"
	if err := b.use(op, src); err != nil {
		return err
	}
	if err := b.use(op, dst); err != nil {
		return err
	}
	unlock := lockPair(dst, src)
	defer unlock()
	if src.dead.Load() || dst.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := b.span(op, src, srcOff, n, false); err != nil {
		return err
	}
	if err := b.span(op, dst, dstOff, n, true); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if src == dst && srcOff < dstOff+n && dstOff < srcOff+n {
		return &backing.OpError{Op: op, Offset: dstOff, Size: n, Kind: backing.ErrInvalidRange, Err: fmt.Errorf("source at %#x overlaps the destination", srcOff)}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError(op, dstOff, n, err)
	}
	if err := b.drv.call("cuMemcpyDtoD_v2", b.drv.MemcpyDtoD(dst.base+uint64(dstOff), src.base+uint64(srcOff), uintptr(n))); err != nil {
		return opError(op, dstOff, n, err)
	}
	return nil
}

// Synchronize waits until the device has finished all work queued in the primary
// context (cuCtxSynchronize), so that a write through one mapping is visible through
// every other.
func (b *Backing) Synchronize() error {
	b.live()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return err
	}
	return b.drv.call("cuCtxSynchronize", b.drv.CtxSynchronize())
}

// MemInfo returns the device's free and total memory in bytes (cuMemGetInfo_v2), as
// the driver sees it: every process's allocations count.
func (b *Backing) MemInfo() (free, total int64, err error) {
	b.live()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return 0, 0, err
	}
	var f, t uintptr
	if err := b.drv.call("cuMemGetInfo_v2", b.drv.MemGetInfo(&f, &t)); err != nil {
		return 0, 0, err
	}
	return int64(f), int64(t), nil
}
