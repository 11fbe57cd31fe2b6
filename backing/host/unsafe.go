package host

import (
	"sync/atomic"
	"unsafe"
)

// All pointer arithmetic of the package lives here.

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

// sharedAt returns base+off.
func sharedAt(base unsafe.Pointer, off int) unsafe.Pointer {
	// Safety: base is the start of a range mmap returned (a reservation, or a chunk of
	// the park) outside the Go heap, and every caller checked off against that
	// range's size, so the result points into the same range.
	return unsafe.Add(base, off)
}

// sharedAlign returns the first address at or after p that is a multiple of align (a
// power of two).
func sharedAlign(p unsafe.Pointer, align int) unsafe.Pointer {
	pad := (align - int(uintptr(p)&uintptr(align-1))) & (align - 1)
	// Safety: the caller reserved align bytes more than it needs at p, so p+pad stays
	// inside that range.
	return unsafe.Add(p, pad)
}

// sharedBytes returns the n bytes at p as a slice.
func sharedBytes(p unsafe.Pointer, n int) []byte {
	// Safety: p..p+n lies in a committed range of a reservation or a mapped chunk of
	// the park (checked by the caller); the memory is outside the Go heap and stays
	// mapped while the slice is used, under the caller's promise not to decommit a
	// range it is copying.
	return unsafe.Slice((*byte)(p), n)
}

// touch faults in every page of [p, p+n), keeping the contents: with an atomic add
// of zero when write is true (a write the kernel must back with a page, and an atomic
// read-modify-write can not lose a store another goroutine makes to the same word
// meanwhile, through this mapping or another of the same granule), with a load
// otherwise. Both backings use it where the OS can not populate pages itself.
func touch(p unsafe.Pointer, n, page int, write bool) {
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

// Layout claims, checked at compile time in every build: each line fails to compile
// when the claim its comment quotes stops being true.

// "12 bytes of bookkeeping per reserved granule" (SharedReservation.maps, and the
// package doc's Bookkeeping): a sharedMap is 12 bytes.
var _ [1]struct{} = [unsafe.Sizeof(sharedMap{}) - 12 + 1]struct{}{}
