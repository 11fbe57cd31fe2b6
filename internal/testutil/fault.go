package testutil

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"sync/atomic"
	"unsafe"
)

// Fault runs f with memory faults turned into Go panics (debug.SetPanicOnFault) and
// returns the fault f took (a runtime.Error whose Addr method names the address), or
// nil. A panic that is not a runtime.Error goes on up.
func Fault(f func()) (fault error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if v := recover(); v != nil {
			err, ok := v.(runtime.Error)
			if !ok {
				panic(v)
			}
			fault = err
		}
	}()
	f()
	return nil
}

// Touch reads (write false) or writes (write true, the byte 1) the byte at addr and
// returns the fault it took, or nil: whether addr is mapped, and writable.
func Touch(addr uintptr, write bool) error {
	return Fault(func() {
		// Safety: addr is an address the caller mapped outside the Go heap, or one
		// that faults; a fault is what is being asked about. NB: its bits are read as a
		// pointer because a pointer made with unsafe.Add(nil, addr) faults as a nil
		// dereference, which SetPanicOnFault does not recover.
		p := (*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr)))
		if write {
			*p = 1
		} else {
			sink.Store(uint32(*p))
		}
	})
}

// sink keeps Touch's read from being optimized away.
var sink atomic.Uint32

// PanicOf returns what f panics with, formatted by fmt.Sprint, or "" when it returns:
// for a test that expects a named panic (the invariants build's checks, misuse).
func PanicOf(f func()) (v string) {
	defer func() {
		if r := recover(); r != nil {
			v = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}
