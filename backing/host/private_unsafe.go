package host

import (
	"sync/atomic"
	"unsafe"
)

// All pointer arithmetic of the private backing lives here.

// privatePtr returns addr as a pointer.
func privatePtr(addr uintptr) unsafe.Pointer {
	// Safety: addr is inside a reservation mapped by the OS outside the Go heap; the GC
	// never scans or moves it. Reading it through *unsafe.Pointer, not converting the
	// uintptr, says this is deliberate (and keeps vet's unsafeptr check quiet).
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

// privateBytes returns the n bytes at base+off as a slice.
func privateBytes(base uintptr, off, n int) []byte {
	// Safety: [base+off, base+off+n) lies in a committed range of a reservation
	// (checked by the caller), which stays mapped while the slice is used under the
	// caller's promise not to decommit a range it is reading or writing.
	return unsafe.Slice((*byte)(unsafe.Add(privatePtr(base), off)), n)
}

// privateTouch faults in every page of [addr, addr+n) for writing, keeping the
// contents: an atomic add of zero is a write the kernel must back with a page, and
// can not lose a store another goroutine makes to the same word meanwhile.
func privateTouch(addr uintptr, n, page int) {
	p := privatePtr(addr)
	for off := 0; off < n; off += page {
		// Safety: off < n, [addr, addr+n) is committed read-write, and addr is
		// page-aligned, so each word is aligned for the atomic operation.
		atomic.AddUint32((*uint32)(unsafe.Add(p, off)), 0)
	}
}
