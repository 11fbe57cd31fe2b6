package kvevents

import (
	"unsafe"

	"github.com/vmarena/vmarena/internal/invariants"
)

// kvevents converts no pointers: this file holds only its layout claims, checked at
// compile time in every build. Each line fails to compile when the claim its comment
// quotes stops being true.

// "the queue's events stay 152 bytes" (event, on 64-bit platforms).
var _ [1]struct{} = [(int(unsafe.Sizeof(event{}))-152)*invariants.On64Bit + 1]struct{}{}
