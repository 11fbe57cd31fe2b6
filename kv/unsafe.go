package kv

import (
	"unsafe"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/invariants"
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

// Layout claims, checked at compile time in every build: each line fails to compile
// when the claim its comment quotes stops being true.

// "mu and ev's counters are the struct's first 50 bytes, and its first slots
// follow" (PrefixCache.ev, on 64-bit platforms): mu at 0, ev's fields through closing
// end at byte 50, and its first inline change starts in the first 64-byte cache line.
var (
	_ [1]struct{} = [int(unsafe.Offsetof(PrefixCache{}.mu)) + 1]struct{}{}
	_ [1]struct{} = [(int(unsafe.Offsetof(PrefixCache{}.ev)+unsafe.Offsetof(PrefixCache{}.ev.closing)+unsafe.Sizeof(PrefixCache{}.ev.closing))-50)*invariants.On64Bit + 1]struct{}{}
	_ [(63 - int(unsafe.Offsetof(PrefixCache{}.ev)+unsafe.Offsetof(PrefixCache{}.ev.first))) * invariants.On64Bit]struct{}
)
