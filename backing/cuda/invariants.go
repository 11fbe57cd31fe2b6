package cuda

import "fmt"

// checkCountsLocked is run where a reservation is made or given back, in the
// invariants build (see internal/invariants). It panics when the backing's counts
// disagree: a count below zero, fewer handles owned than lie idle or stuck, mapped
// bytes that are not whole granules, or fewer imported handles than are stuck. b.mu
// is held.
func (b *Backing) checkCountsLocked() {
	if b.nres < 0 || b.owned < len(b.idle)+len(b.stuck) || b.mapped < 0 || b.mapped%int64(b.gran) != 0 ||
		b.creating < 0 || b.reclaiming < 0 || b.imports < len(b.stuckIn) {
		panic(fmt.Sprintf("cuda: invariant: %d reservations, %d handles owned (%d idle, %d stuck), %d bytes mapped (%d-byte granule), %d being created, %d reclaims, %d imported (%d stuck)",
			b.nres, b.owned, len(b.idle), len(b.stuck), b.mapped, b.gran, b.creating, b.reclaiming, b.imports, len(b.stuckIn)))
	}
}
