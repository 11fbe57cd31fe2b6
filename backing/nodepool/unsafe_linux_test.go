package nodepool_test

import "unsafe"

// unsafeBytes returns the n bytes at addr, committed host memory of a reservation.
func unsafeBytes(addr uintptr, n int) []byte {
	// Safety: addr is Base(r)+off of a committed range, mapped outside the Go heap
	// while the test reads it; read through a *unsafe.Pointer, as backingtest does.
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}
