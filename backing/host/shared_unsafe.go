package host

import (
	"sync/atomic"
	"unsafe"
)

// All pointer arithmetic of the shared backing lives here.

// sharedAt returns base+off.
func sharedAt(base unsafe.Pointer, off int) unsafe.Pointer {
	// Safety: base is the start of a reservation mapped by mmap outside the Go heap and
	// every caller checked off against the reservation's size, so the result points
	// into the same mapping.
	return unsafe.Add(base, off)
}

// sharedBytes returns the n bytes at p as a slice.
func sharedBytes(p unsafe.Pointer, n int) []byte {
	// Safety: p..p+n lies in a committed range of a reservation (checked by the
	// caller); the memory is outside the Go heap and stays mapped while the slice is
	// used, under the caller's promise not to decommit a range it is copying.
	return unsafe.Slice((*byte)(p), n)
}

// sharedTouch faults in every page of [p, p+n): with an atomic add of zero when write
// is true (an atomic read-modify-write can not lose a concurrent writer's store
// through another mapping of the same granule), with a load otherwise.
func sharedTouch(p unsafe.Pointer, n, page int, write bool) {
	for off := 0; off < n; off += page {
		// Safety: off < n and [p, p+n) is committed; p is page-aligned, so each
		// word is aligned for the atomic operation.
		w := (*uint32)(unsafe.Add(p, off))
		if write {
			atomic.AddUint32(w, 0)
		} else {
			atomic.LoadUint32(w)
		}
	}
}
