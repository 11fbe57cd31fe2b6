package host

import "fmt"

// The lookups of a placeholder record by address, which only the Windows system
// calls need: the record itself (shared_placeholder.go) works in units.

// contains reports whether addr lies in the reservation.
func (p *placeholders) contains(addr uintptr) bool {
	return addr >= p.base && addr-p.base < uintptr(p.n)*uintptr(p.unit)
}

// unitOf returns the unit at addr, which must be the start of a unit inside p.
func (p *placeholders) unitOf(addr uintptr) int {
	off := addr - p.base
	if !p.contains(addr) || off%uintptr(p.unit) != 0 {
		panic(fmt.Sprintf("host: %#x is not a unit of the placeholder reservation at %#x", addr, p.base))
	}
	return int(off / uintptr(p.unit))
}
