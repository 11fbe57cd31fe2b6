package host

import "fmt"

// checkCountsLocked is run as each call on the pool takes its lock, in the
// invariants build (see internal/invariants), so it finds what a call before broke.
// It panics when the pool's counts disagree in ways that need no walk of its
// reservations or slots (CheckShared, in the tests, does the walk): a count below
// zero or past the slots, resident idle slots past the idle ones, bytes owned or
// mapped that are not whole granules, or more live reservations than known ones.
// s.mu is held.
func (s *Shared) checkCountsLocked() {
	if s.nIdle < 0 || s.nIdle > len(s.slots) || s.nResident < 0 || s.nResident > s.nIdle ||
		s.nPriv < 0 || s.nPrivIdle < 0 || s.live < 0 || s.live > len(s.resv) ||
		s.owned < 0 || s.mapped < 0 || s.owned%int64(s.g) != 0 || s.mapped%int64(s.g) != 0 {
		panic(fmt.Sprintf("host: invariant: a pool of %d slots has %d idle (%d resident), %d private (%d idle), %d of %d reservations live, owns %d bytes and maps %d (%d-byte granule)",
			len(s.slots), s.nIdle, s.nResident, s.nPriv, s.nPrivIdle, s.live, len(s.resv), s.owned, s.mapped, s.g))
	}
}
