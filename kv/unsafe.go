package kv

import (
	"unsafe"

	"github.com/vmarena/vmarena/arena"
)

// This file holds kv's only pointer conversion: a run of a tensor's bytes as its
// elements (Run).

// elems returns b as elements of T: len(b) / size of T of them.
func elems[T arena.Elem](b []byte) []T {
	if len(b) == 0 {
		return nil
	}
	var z T
	// Safety: b is committed host memory of a sequence's range, its start is aligned
	// to T's size (ranges start on a granule, tokens and blocks are whole multiples of
	// the element size), and T holds no Go pointer (arena.Elem is numeric only).
	return unsafe.Slice((*T)(unsafe.Pointer(&b[0])), len(b)/int(unsafe.Sizeof(z)))
}
