package hosttier

import "unsafe"

// All pointer arithmetic of the package lives here.

// bytesAt returns the n bytes at addr as a slice.
func bytesAt(addr uintptr, n int) []byte {
	if n == 0 {
		return []byte{}
	}
	// Safety: [addr, addr+n) lies in the tier's reservation, committed while the
	// value that owns it is Filling or Held (see tier.go); the Go collector does not
	// manage that memory and never moves it. The uintptr's bits are read as a
	// pointer rather than converted, as package arena does, so that go vet and
	// checkptr accept it.
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// addrOf returns the address of p's first byte (only compared, never dereferenced).
func addrOf(p []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(p))) }
