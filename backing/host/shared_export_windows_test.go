package host

import (
	"fmt"

	"golang.org/x/sys/windows"
)

// WineVersion returns the version of Wine the process runs under (ntdll's
// wine_get_version), or "" on Windows itself.
func WineVersion() string {
	p := windows.NewLazySystemDLL("ntdll.dll").NewProc("wine_get_version")
	if p.Find() != nil {
		return ""
	}
	r, _, _ := p.Call()
	if r == 0 {
		return "?"
	}
	return windows.BytePtrToString((*byte)(privatePtr(r)))
}

// SharedFileCheck checks the section pool against the bookkeeping: a Free slot has
// no section (which would hold commit charge no ledger sees), a Live slot and an
// idle one the pool calls resident have one, and the pool has a place for every
// slot. It must be called while no operation is in flight.
func SharedFileCheck(s *Shared) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	sharedPools.mu.Lock()
	w := sharedPools.m[s.fd]
	sharedPools.mu.Unlock()
	if w == nil {
		return fmt.Errorf("no pool has descriptor %d", s.fd)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.sections) != len(s.slots) {
		return fmt.Errorf("the pool has places for %d sections, the bookkeeping %d slots", len(w.sections), len(s.slots))
	}
	for i, h := range w.sections {
		sl := s.slots[i]
		switch {
		case s.free.has(i) && h != 0:
			return fmt.Errorf("slot %d is free but has a section", i)
		case sl.refs > 0 && h == 0:
			return fmt.Errorf("slot %d is mapped %d times but has no section", i, sl.refs)
		case s.idle.has(i) && sl.resident && h == 0:
			return fmt.Errorf("idle slot %d is called resident but has no section", i)
		}
	}
	return nil
}
