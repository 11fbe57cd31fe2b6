package cudatest

import (
	"unsafe"

	"github.com/vmarena/vmarena/backing/cuda"
)

// All pointer conversions of the package live here.

// hostSlice returns the n bytes at p, where the driver's caller handed a host buffer
// (the fake reads and writes host buffers through this).
func hostSlice(p unsafe.Pointer, n uintptr) []byte {
	if n == 0 {
		return nil
	}
	// Safety: p and n come from a MemcpyHtoD/DtoH call whose contract is that p
	// addresses at least n bytes of host memory for the duration of the call.
	return unsafe.Slice((*byte)(p), n)
}

// descSlice returns the count access descriptors at desc (cuMemSetAccess's array).
func descSlice(desc *cuda.MemAccessDesc, count uintptr) []cuda.MemAccessDesc {
	// Safety: by cuMemSetAccess's contract desc points at count descriptors.
	return unsafe.Slice(desc, count)
}

// fdSlot returns the C int at p (cuMemExportToShareableHandle's out-parameter for a
// descriptor).
func fdSlot(p unsafe.Pointer) *int32 {
	// Safety: by cuMemExportToShareableHandle's contract for POSIX descriptors, p
	// addresses a C int the caller owns for the duration of the call.
	return (*int32)(p)
}
