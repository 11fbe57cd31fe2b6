package cudatest

import (
	"cmp"
	"fmt"
	"slices"
	"unsafe"

	"github.com/vmarena/vmarena/backing/cuda"
)

// The fake's pinned host memory and streams. It models what a caller can get wrong:
//
//   - cuMemHostRegister refuses a range that overlaps one registered, and one larger
//     than FakeDriverOptions.MaxHostRegister (64 GiB unless set), as the real driver
//     refuses one 512 GiB registration; cuMemHostUnregister needs the exact first
//     address of a registration.
//   - An async copy whose host buffer lies wholly in registered memory is queued and
//     runs at cuStreamSynchronize (or cuStreamDestroy): a caller that reads the
//     destination, or changes the source, before synchronizing sees the difference,
//     and one that decommits the device range first gets CUDA_ERROR_ILLEGAL_ADDRESS.
//     A copy from or to pageable memory runs at once, as the driver stages it, and
//     is counted (PageableCopies).

// Codes of the host-memory calls.
const (
	codeHostAlreadyRegistered cuda.Code = 712 // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
	codeHostNotRegistered     cuda.Code = 713 // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
	fakeStreamBase                      = 0x5700_0000
	defaultMaxHostRegister              = 64 << 30
)

// fakeHost is the FakeDriver's host-memory state; guarded by FakeDriver.mu.
type fakeHost struct {
	regs       []fakeReg // registered host ranges, by address
	streams    map[uintptr][]func() cuda.Code
	nextStream uintptr
	pageable   int   // async copies that touched unregistered host memory
	sizes      []int // the size of every successful registration, in call order
}

type fakeReg struct {
	addr, size uintptr
}

// bindHost fills the host-memory entry points of d.
func (f *FakeDriver) bindHost(d *cuda.Driver) {
	f.host.streams = make(map[uintptr][]func() cuda.Code)
	f.host.nextStream = fakeStreamBase
	d.MemHostRegister = f.memHostRegister
	d.MemHostUnregister = f.memHostUnregister
	d.StreamCreate = f.streamCreate
	d.StreamSynchronize = f.streamSynchronize
	d.StreamDestroy = f.streamDestroy
	d.MemcpyHtoDAsync = f.memcpyHtoDAsync
	d.MemcpyDtoHAsync = f.memcpyDtoHAsync
}

// HostRegistered returns how many host ranges are registered and their bytes.
func (f *FakeDriver) HostRegistered() (n int, bytes int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.host.regs {
		bytes += int64(r.size)
	}
	return len(f.host.regs), bytes
}

// HostRegisterSizes returns the size of every successful cuMemHostRegister call so
// far, in call order.
func (f *FakeDriver) HostRegisterSizes() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.host.sizes)
}

// PageableCopies returns how many async copies touched host memory that was not
// registered (the driver staged them).
func (f *FakeDriver) PageableCopies() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.host.pageable
}

// LiveStreams returns how many streams exist.
func (f *FakeDriver) LiveStreams() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.host.streams)
}

// hostLeaks names registrations and streams still live. f.mu held.
func (f *FakeDriver) hostLeaks() []error {
	var errs []error
	if n := len(f.host.regs); n > 0 {
		errs = append(errs, fmt.Errorf("%d registered host ranges", n))
	}
	if n := len(f.host.streams); n > 0 {
		errs = append(errs, fmt.Errorf("%d live streams", n))
	}
	return errs
}

func (f *FakeDriver) maxHostRegister() uintptr {
	if f.opts.MaxHostRegister > 0 {
		return uintptr(f.opts.MaxHostRegister)
	}
	return defaultMaxHostRegister
}

func (f *FakeDriver) memHostRegister(p unsafe.Pointer, size uintptr, flags uint32) cuda.Code {
	c := f.enter("cuMemHostRegister_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	addr := uintptr(p)
	switch {
	case p == nil || size == 0 || flags&^0xf != 0:
		return cuda.CodeInvalidValue
	case size > f.maxHostRegister():
		return cuda.CodeOutOfMemory
	}
	for _, r := range f.host.regs {
		if addr < r.addr+r.size && r.addr < addr+size {
			return codeHostAlreadyRegistered
		}
	}
	i, _ := slices.BinarySearchFunc(f.host.regs, addr, byAddr)
	f.host.regs = slices.Insert(f.host.regs, i, fakeReg{addr: addr, size: size})
	f.host.sizes = append(f.host.sizes, int(size))
	return cuda.Success
}

func byAddr(r fakeReg, a uintptr) int { return cmp.Compare(r.addr, a) }

func (f *FakeDriver) memHostUnregister(p unsafe.Pointer) cuda.Code {
	c := f.enter("cuMemHostUnregister")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	addr := uintptr(p)
	i, ok := slices.BinarySearchFunc(f.host.regs, addr, byAddr)
	if !ok {
		return codeHostNotRegistered
	}
	f.host.regs = slices.Delete(f.host.regs, i, i+1)
	return cuda.Success
}

// registered reports whether [addr, addr+n) lies in one registration. f.mu held.
func (f *FakeDriver) registered(addr, n uintptr) bool {
	for _, r := range f.host.regs {
		if r.addr <= addr && addr+n <= r.addr+r.size {
			return true
		}
	}
	return false
}

func (f *FakeDriver) streamCreate(s *uintptr, flags uint32) cuda.Code {
	c := f.enter("cuStreamCreate")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if s == nil || flags&^1 != 0 {
		return cuda.CodeInvalidValue
	}
	f.host.nextStream++
	*s = f.host.nextStream
	f.host.streams[*s] = nil
	return cuda.Success
}

// drain runs the copies queued on stream s in order and returns the first failure.
// f.mu held.
func (f *FakeDriver) drain(s uintptr) cuda.Code {
	q := f.host.streams[s]
	f.host.streams[s] = nil
	res := cuda.Success
	for _, op := range q {
		if c := op(); c != cuda.Success && res == cuda.Success {
			res = c
		}
	}
	return res
}

// onStream enters fn, checks the context and that stream s exists, and runs op.
func (f *FakeDriver) onStream(fn string, s uintptr, op func() cuda.Code) cuda.Code {
	c := f.enter(fn)
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if _, ok := f.host.streams[s]; !ok {
		return cuda.CodeInvalidHandle
	}
	return op()
}

func (f *FakeDriver) streamSynchronize(s uintptr) cuda.Code {
	return f.onStream("cuStreamSynchronize", s, func() cuda.Code { return f.drain(s) })
}

func (f *FakeDriver) streamDestroy(s uintptr) cuda.Code {
	return f.onStream("cuStreamDestroy_v2", s, func() cuda.Code {
		// As the driver does, work still queued completes before the stream goes.
		f.drain(s)
		delete(f.host.streams, s)
		return cuda.Success
	})
}

// async checks an async copy's arguments, then runs op now (pageable host memory) or
// queues it on stream s (registered memory). f.mu held.
func (f *FakeDriver) async(s uintptr, host unsafe.Pointer, n uintptr, dev uint64, need int32, op func() cuda.Code) cuda.Code {
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if _, ok := f.host.streams[s]; !ok {
		return cuda.CodeInvalidHandle
	}
	if n == 0 {
		return cuda.Success
	}
	if host == nil {
		return cuda.CodeInvalidValue
	}
	// The device range is checked now, as the driver validates it at the call.
	if c := f.span(dev, n, need, func(*fakeHandle, uintptr, uintptr) {}); c != cuda.Success {
		return c
	}
	if !f.registered(uintptr(host), n) {
		f.host.pageable++
		return op()
	}
	f.host.streams[s] = append(f.host.streams[s], op)
	return cuda.Success
}

func (f *FakeDriver) memcpyDtoHAsync(dst unsafe.Pointer, src uint64, n uintptr, s uintptr) cuda.Code {
	c := f.enter("cuMemcpyDtoHAsync_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	return f.async(s, dst, n, src, cuda.AccessRead, func() cuda.Code {
		d := hostSlice(dst, n)
		if c := f.span(src, n, cuda.AccessRead, func(h *fakeHandle, off, k uintptr) {
			if b := h.bytes(false); b != nil {
				copy(d[:k], b[off:off+k])
			} else {
				clear(d[:k])
			}
			d = d[k:]
		}); c != cuda.Success {
			return cuda.CodeIllegalAddress
		}
		return cuda.Success
	})
}

func (f *FakeDriver) memcpyHtoDAsync(dst uint64, src unsafe.Pointer, n uintptr, s uintptr) cuda.Code {
	c := f.enter("cuMemcpyHtoDAsync_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	return f.async(s, src, n, dst, cuda.AccessReadWrite, func() cuda.Code {
		h := hostSlice(src, n)
		if c := f.span(dst, n, cuda.AccessReadWrite, func(hd *fakeHandle, off, k uintptr) {
			copy(hd.bytes(true)[off:off+k], h[:k])
			h = h[k:]
		}); c != cuda.Success {
			return cuda.CodeIllegalAddress
		}
		return cuda.Success
	})
}
