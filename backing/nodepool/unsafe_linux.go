package nodepool

import "unsafe"

// addr returns base+off.
func addr(base unsafe.Pointer, off int) unsafe.Pointer {
	// Safety: off lies inside the reservation at base, which the caller checked.
	return unsafe.Add(base, off)
}

// bytesAt returns the n bytes at base+off as a slice.
func bytesAt(base unsafe.Pointer, off, n int) []byte {
	// Safety: [base+off, base+off+n) is committed memory of one reservation, mapped
	// outside the Go heap, and stays mapped while the caller holds Client.mu.
	return unsafe.Slice((*byte)(unsafe.Add(base, off)), n)
}
