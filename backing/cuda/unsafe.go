package cuda

import (
	"unsafe"

	"github.com/vmarena/vmarena/internal/invariants"
)

// All pointer conversions of the package live here.

// goString copies the NUL-terminated C string at p (static in the driver; never freed).
func goString(p *byte) string {
	n := 0
	// Safety: p points at a NUL-terminated string the driver keeps for the process's
	// life (cuGetErrorName's table), so every byte up to the NUL is readable.
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	// Safety: the n bytes before the NUL were just read one by one.
	return string(unsafe.Slice(p, n))
}

// bytesPtr returns the address of p's first byte for a synchronous host copy, or nil
// for an empty slice. The driver reads or writes exactly len(p) bytes before it returns
// and keeps no reference, so no pinning is needed.
func bytesPtr(p []byte) unsafe.Pointer {
	// Safety: unsafe.SliceData of a non-empty slice is its first element's address;
	// the caller passes len(p) as the byte count.
	return unsafe.Pointer(unsafe.SliceData(p))
}

// int32Ptr returns p as the void* of an out-parameter: the C int that
// cuMemExportToShareableHandle writes a descriptor to.
func int32Ptr(p *int32) unsafe.Pointer {
	// Safety: p points at a live int32, the size of a C int on every platform the
	// driver runs on; the driver writes it before it returns and keeps no reference.
	return unsafe.Pointer(p)
}

// sliceAddr returns the address of p's first byte, as the key of a pinned range.
func sliceAddr(p []byte) uintptr {
	// Safety: only the address is taken; no pointer is made from it again.
	return uintptr(unsafe.Pointer(unsafe.SliceData(p)))
}

// Layout claims, checked at compile time in every build (types.go's, which
// types_test.go checks field by field): each line fails to compile when the claim its
// comment quotes stops being true. The layouts are the driver's on 64-bit platforms.

// "MemLocation mirrors CUmemLocation: 8 bytes", "MemAllocationProp mirrors
// CUmemAllocationProp: 32 bytes, no padding", "MemAccessDesc mirrors
// CUmemAccessDesc: 12 bytes".
var (
	_ [1]struct{} = [unsafe.Sizeof(MemLocation{}) - 8 + 1]struct{}{}
	_ [1]struct{} = [(int(unsafe.Sizeof(MemAllocationProp{}))-32)*invariants.On64Bit + 1]struct{}{}
	_ [1]struct{} = [unsafe.Sizeof(MemAccessDesc{}) - 12 + 1]struct{}{}
)
