package accounting

import "fmt"

// checkLedger is run at each transition of the ledgers in the invariants build (see
// internal/invariants). It panics when device d's books disagree with its ledgers':
// a count below zero, credit (bytes waited for by AcquireFor) or idle bytes (PutIdle)
// that the ledger does not own, a peak below the count, or ledgers that own more than
// the device counts as used. Used may be more: bytes granted to a queued Acquire not yet taken. d's
// governor's mu must be held.
func (d *device) checkLedger() {
	var owned int64
	for _, a := range d.auths {
		if a.owned < 0 || a.mapped < 0 || a.credit < 0 || a.credit > a.owned || a.idle < 0 || a.idle > a.owned || a.waiting < 0 || a.ownedPeak < a.owned {
			panic(fmt.Sprintf("accounting: invariant: %q owns %d (peak %d), maps %d, holds %d waited for, %d idle and has %d queued",
				a.name, a.owned, a.ownedPeak, a.mapped, a.credit, a.idle, a.waiting))
		}
		owned += a.owned
	}
	if owned > d.used || d.peak < d.used {
		panic(fmt.Sprintf("accounting: invariant: %v uses %d bytes (peak %d) but its ledgers own %d", d.key, d.used, d.peak, owned))
	}
}
