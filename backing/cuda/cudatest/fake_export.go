package cudatest

import (
	"unsafe"

	"github.com/vmarena/vmarena/backing/cuda"
)

// The fake's export and import of allocations between processes. An allocation
// created with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR keeps
// its contents in a memfd of its own (Linux only), mapped shared into this process:
//
//   - cuMemExportToShareableHandle writes a new descriptor of that memfd (a dup); it
//     refuses a handle created without the type, a released one, another type and
//     non-zero flags;
//   - cuMemImportFromShareableHandle, in any process, takes such a descriptor (it
//     checks the memfd's name and size, so a pipe, a plain file or a closed
//     descriptor is CUDA_ERROR_INVALID_VALUE) and makes a new handle over the same
//     memory, mapped shared: a write through either process's mappings reads back
//     through the other's. An import is not counted in UsedMemory: its memory is the
//     exporter's.
//
// The memfd goes with the last of the handles and mappings in every process, as the
// driver's allocation does.

// bindExport fills the export entry points of d.
func (f *FakeDriver) bindExport(d *cuda.Driver) {
	d.MemExportToShareableHandle = f.memExport
	d.MemImportFromShareableHandle = f.memImport
}

// canExport reports whether the fake's device exports allocations.
func (f *FakeDriver) canExport() bool { return fakeShmSupported && !f.opts.NoExport }

func (f *FakeDriver) memExport(out unsafe.Pointer, id uint64, typ int32, flags uint64) cuda.Code {
	c := f.enter("cuMemExportToShareableHandle")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	h := f.handles[id]
	switch {
	case out == nil || flags != 0:
		return cuda.CodeInvalidValue
	case typ != cuda.HandleTypePosixFD:
		return cuda.CodeNotSupported
	case h == nil || h.released:
		return cuda.CodeInvalidValue
	case h.shm == nil:
		return cuda.CodeInvalidValue // not created exportable
	}
	fd, err := h.shm.dup()
	if err != nil {
		return cuda.CodeOutOfMemory // out of descriptors
	}
	*fdSlot(out) = int32(fd)
	return cuda.Success
}

func (f *FakeDriver) memImport(out *uint64, osHandle uintptr, typ int32) cuda.Code {
	c := f.enter("cuMemImportFromShareableHandle")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	switch {
	case out == nil:
		return cuda.CodeInvalidValue
	case typ != cuda.HandleTypePosixFD:
		return cuda.CodeNotSupported
	case osHandle > 1<<31-1:
		return cuda.CodeInvalidValue // not a descriptor
	}
	dev, size, ok := identifyFakeShm(int(osHandle))
	if !ok || !f.validDevice(dev) || size == 0 || size%f.gran() != 0 {
		return cuda.CodeInvalidValue
	}
	shm, err := openFakeShm(int(osHandle), size)
	if err != nil {
		return cuda.CodeOutOfMemory
	}
	h := &fakeHandle{id: f.nextHandle, dev: dev, size: size, data: shm.data, shm: shm, imported: true}
	f.nextHandle++
	f.handles[h.id] = h
	*out = h.id
	return cuda.Success
}
