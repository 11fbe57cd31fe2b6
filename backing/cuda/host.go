package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
)

// Pinned host memory and copies on a stream: what a tier of host memory below the
// device needs. The DMA engine copies between device memory and host memory at full
// speed only when the host pages are page-locked (pinned) and the copy runs on a
// stream; a copy from pageable memory is staged through a driver buffer and, towards
// the host, does not return before it is done.
//
// Host memory here is memory the Go collector does not manage (a host backing's
// reservation), so that neither the collector nor the heap's reuse can move or free
// what the device still reads or writes.

// MaxPinChunk is the most bytes PinHost gives one cuMemHostRegister call: one
// registration of 512 GiB fails where 64 GiB pieces succeed (vLLM issue #51080).
const MaxPinChunk = 64 << 30

// Stream flags and host-register flags (cuda.h).
const (
	streamNonBlocking = 0x1 // CU_STREAM_NON_BLOCKING: no implicit sync with stream 0
	hostRegisterFlags = 0x0 // no CU_MEMHOSTREGISTER_* flag: page-locked for this context
)

// Errors of pinned host memory and streams.
var (
	// ErrNotPinned: UnpinHost was given memory that PinHost did not pin as one slice.
	ErrNotPinned = errors.New("cuda: host memory was not pinned by PinHost")
	// ErrPinned: PinHost was given memory that overlaps memory already pinned.
	ErrPinned = errors.New("cuda: host memory is already pinned")
	// ErrStreamClosed: a copy or synchronize on a Stream after its Close.
	ErrStreamClosed = errors.New("cuda: stream is closed")
)

// bound runs fn with the goroutine locked to its thread and the primary context
// current on it.
func (b *Backing) bound(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return err
	}
	return fn()
}

// hostPin is one slice PinHost pinned: its registrations, in order.
type hostPin struct {
	size   int
	chunks []int // the bytes of each registration, each at most the chunk limit
}

// pins is the Backing's record of pinned host memory, by first address.
type pins struct {
	mu sync.Mutex
	m  map[uintptr]hostPin
}

// PinHost page-locks p for the device's DMA engine (cuMemHostRegister_v2), in
// registrations of at most MaxPinChunk bytes, so that copies on a Stream from and to
// it run at the engine's speed. p must be host memory the Go collector does not
// manage (a host backing's committed reservation) and MUST be unpinned with UnpinHost
// before it is decommitted or the Backing is closed. Pinning costs time in proportion
// to the bytes (the kernel faults and locks every page); call it off the token path.
//
// It fails with ErrPinned when p overlaps a slice already pinned here, with
// ErrMissingSymbol when the driver lacks the entry point, and with the driver's
// *Result otherwise; on error nothing stays pinned.
func (b *Backing) PinHost(p []byte) error { return b.pinHost(p, MaxPinChunk) }

func (b *Backing) pinHost(p []byte, chunk int) error {
	b.live()
	if len(p) == 0 {
		return fmt.Errorf("cuda: PinHost of an empty slice")
	}
	if err := b.drv.checkHost(); err != nil {
		return err
	}
	base := sliceAddr(p)
	b.pins.mu.Lock()
	defer b.pins.mu.Unlock()
	for at, pin := range b.pins.m {
		if base < at+uintptr(pin.size) && at < base+uintptr(len(p)) {
			return fmt.Errorf("%w: [%#x, %#x) overlaps [%#x, %#x)", ErrPinned, base, base+uintptr(len(p)), at, at+uintptr(pin.size))
		}
	}
	var done []int
	if err := b.bound(func() error {
		for off := 0; off < len(p); {
			n := min(chunk, len(p)-off)
			if err := b.drv.call("cuMemHostRegister_v2", b.drv.MemHostRegister(bytesPtr(p[off:off+n]), uintptr(n), hostRegisterFlags)); err != nil {
				return errors.Join(fmt.Errorf("cuda: pinning %d bytes at offset %d of %d: %w", n, off, len(p), err), b.unregister(p, done))
			}
			done = append(done, n)
			off += n
		}
		return nil
	}); err != nil {
		return err
	}
	if b.pins.m == nil {
		b.pins.m = make(map[uintptr]hostPin)
	}
	b.pins.m[base] = hostPin{size: len(p), chunks: done}
	return nil
}

// UnpinHost undoes PinHost(p): p must be exactly a slice PinHost pinned (else
// ErrNotPinned). The memory stays committed and its contents stay; only the lock
// goes. Copies on a Stream that touch p must have been synchronized first. On a
// driver error the record is dropped all the same (what could be unregistered was),
// and the error names the registrations the driver refused.
func (b *Backing) UnpinHost(p []byte) error {
	b.live()
	if len(p) == 0 {
		return fmt.Errorf("%w: empty slice", ErrNotPinned)
	}
	base := sliceAddr(p)
	b.pins.mu.Lock()
	defer b.pins.mu.Unlock()
	pin, ok := b.pins.m[base]
	if !ok || pin.size != len(p) {
		return fmt.Errorf("%w: [%#x, %#x)", ErrNotPinned, base, base+uintptr(len(p)))
	}
	delete(b.pins.m, base)
	return b.bound(func() error { return b.unregister(p, pin.chunks) })
}

// PinnedHost returns how many bytes of host memory PinHost holds pinned now.
func (b *Backing) PinnedHost() int64 {
	b.pins.mu.Lock()
	defer b.pins.mu.Unlock()
	var n int64
	for _, pin := range b.pins.m {
		n += int64(pin.size)
	}
	return n
}

// unregister unregisters the registrations chunks made from the start of p, going on
// past a failure. The thread must be bound to the context.
func (b *Backing) unregister(p []byte, chunks []int) error {
	var errs []error
	off := 0
	for _, n := range chunks {
		if err := b.drv.call("cuMemHostUnregister", b.drv.MemHostUnregister(bytesPtr(p[off:off+n]))); err != nil {
			errs = append(errs, fmt.Errorf("cuda: unpinning %d bytes at offset %d: %w", n, off, err))
		}
		off += n
	}
	return errors.Join(errs...)
}

// Stream is a CUDA stream of its own (cuStreamCreate, non-blocking): copies queued on
// it run in order, overlap with work on other streams, and are waited for by its
// Synchronize. A Stream is safe for concurrent use; Synchronize waits for every copy
// queued before it, from any goroutine.
//
// The host buffer of an async copy MUST stay valid and untouched until Synchronize
// returns: the device reads or writes it after the call. The Stream keeps a reference
// to each buffer until then. Pinned buffers (PinHost) copy at the DMA engine's speed;
// a pageable one is staged by the driver, and a copy into it is done when the call
// returns.
type Stream struct {
	b *Backing

	mu      sync.Mutex
	s       uintptr  // CUstream; 0 after Close
	pending [][]byte // host buffers of copies not yet synchronized
}

// NewStream creates a stream on the Backing's device. It MUST be closed with Close
// before the Backing is. It fails with ErrMissingSymbol when the driver lacks the
// stream entry points.
func (b *Backing) NewStream() (*Stream, error) {
	b.live()
	if err := b.drv.checkHost(); err != nil {
		return nil, err
	}
	var s uintptr
	if err := b.bound(func() error {
		return b.drv.call("cuStreamCreate", b.drv.StreamCreate(&s, streamNonBlocking))
	}); err != nil {
		return nil, err
	}
	return &Stream{b: b, s: s}, nil
}

// CopyOutAsync queues a copy of [off, off+len(dst)) of r to dst (cuMemcpyDtoHAsync_v2).
// The range must be committed and stay so until Synchronize; dst is written by then.
func (s *Stream) CopyOutAsync(dst []byte, r *Reservation, off int) error {
	const op = "copy out async"
	return s.queue(op, r, off, dst, false, func(st uintptr) error {
		return s.b.drv.call("cuMemcpyDtoHAsync_v2", s.b.drv.MemcpyDtoHAsync(bytesPtr(dst), r.base+uint64(off), uintptr(len(dst)), st))
	})
}

// CopyInAsync queues a copy of src to [off, off+len(src)) of r (cuMemcpyHtoDAsync_v2).
// The range must be committed, writable, and stay so until Synchronize; src must not
// change before then.
func (s *Stream) CopyInAsync(r *Reservation, off int, src []byte) error {
	const op = "copy in async"
	return s.queue(op, r, off, src, true, func(st uintptr) error {
		return s.b.drv.call("cuMemcpyHtoDAsync_v2", s.b.drv.MemcpyHtoDAsync(r.base+uint64(off), bytesPtr(src), uintptr(len(src)), st))
	})
}

// queue validates the device range, then calls copyFn with the stream while holding
// the stream's lock, and keeps buf until Synchronize.
func (s *Stream) queue(op string, r *Reservation, off int, buf []byte, write bool, copyFn func(st uintptr) error) error {
	b := s.b
	if err := b.access(op, r, off, len(buf), write); err != nil {
		return err
	}
	defer b.leave(r)
	if len(buf) == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.s == 0 {
		return ErrStreamClosed
	}
	if err := copyFn(s.s); err != nil {
		return opError(op, off, len(buf), err)
	}
	s.pending = append(s.pending, buf)
	return nil
}

// Synchronize waits until every copy queued on the stream is done
// (cuStreamSynchronize). Its error is that of a copy that failed on the device.
func (s *Stream) Synchronize() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.s == 0 {
		return ErrStreamClosed
	}
	return s.sync()
}

// sync waits for the stream and lets the buffers go. s.mu must be held.
func (s *Stream) sync() error {
	b := s.b
	b.live()
	err := b.bound(func() error { return b.drv.call("cuStreamSynchronize", b.drv.StreamSynchronize(s.s)) })
	clear(s.pending)
	s.pending = s.pending[:0]
	return err
}

// Close waits for the stream's copies and destroys it (cuStreamDestroy_v2). A second
// Close changes nothing and returns ErrStreamClosed (docs/server.md, "A second Close").
func (s *Stream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.s == 0 {
		return ErrStreamClosed
	}
	serr := s.sync()
	derr := s.b.bound(func() error { return s.b.drv.call("cuStreamDestroy_v2", s.b.drv.StreamDestroy(s.s)) })
	s.s = 0
	return errors.Join(serr, derr)
}
