package filetier

import "unsafe"

// All pointer arithmetic of the package lives here.

// alignedBytes returns n bytes of Go memory whose first byte is at a multiple of
// align (a power of two), as direct I/O requires of its buffers.
func alignedBytes(n, align int) []byte {
	b := make([]byte, n+align)
	// Safety: the address is only read, to find the offset of the first aligned byte;
	// the Go collector never moves heap memory, so the offset stays aligned.
	off := -int(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) & (align - 1)
	return b[off : off+n : off+n]
}
