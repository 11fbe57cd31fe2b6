package kv

// The holds a write-down into the tiers keeps on the checkpoints whose states it
// copies (a cache with recurrent groups: see prefixcache_tier_groups.go), so that
// their ranges stay until it ended: an eviction's holder's as checkpoint.writes, a
// write-through's as a live sequence's.

// holdStates makes p, a part of e about to be written down, hold e's checkpoints at
// the ends of its blocks (tierPart.cks), so that their states are there to copy once
// no lock is held. pc.mu is held.
func (t *pcTiers) holdStates(e *pcEntry, p *tierPart) {
	if t.grp == nil || t.grp.states == 0 {
		return
	}
	for _, ck := range e.ckpts {
		if ck.n%t.bt == 0 && ck.n > p.first*t.bt && ck.n <= p.last*t.bt && ck.bufs != nil {
			if p.live {
				t.pc.ckRef(ck, 0, 1)
				ck.down = true
			} else {
				holdWrite(ck)
			}
			p.cks = append(p.cks, ck)
		}
	}
}

// holdStatesLive is holdStates for a write-through's part, which holds the
// checkpoints as a live sequence does: an eviction that takes one from its entries
// meanwhile (the entry that displaced the one being stored) counts none of its bytes
// as given back until the store ends, since nothing waits for that store (a holder's
// write-down, by contrast, ends before the eviction that made it returns). pc.mu is
// held.
func (t *pcTiers) holdStatesLive(e *pcEntry, p *tierPart) {
	p.live = true
	t.holdStates(e, p)
}

// letStates ends w's holds on checkpoints (holdStates), once its stores ended or it
// is dropped unwritten. No lock is held.
func (t *pcTiers) letStates(w *tierWrite) {
	if t.grp == nil || t.grp.states == 0 {
		return
	}
	t.pc.mu.Lock()
	t.letStatesLocked(w)
	t.pc.mu.Unlock()
}

// letStatesLocked is letStates with pc.mu held.
func (t *pcTiers) letStatesLocked(w *tierWrite) {
	for pi := range w.parts {
		p := &w.parts[pi]
		for _, ck := range p.cks {
			if p.live {
				t.pc.ckRef(ck, 0, -1)
			} else {
				t.pc.ckUnwrite(ck)
			}
		}
		p.cks = nil
	}
}

// holdWrite makes an eviction's write-down hold ck (checkpoint.writes) and marks it
// written down. pc.mu is held.
func holdWrite(ck *checkpoint) {
	ref(&ck.writes, 1)
	ck.down = true
}

// ckUnwrite ends a write-down's hold on ck (checkpoint.writes) and closes its ranges
// when it was the last thing to hold it. pc.mu is held.
func (pc *PrefixCache) ckUnwrite(ck *checkpoint) {
	ref(&ck.writes, -1)
	if ck.writes == 0 && ck.entries == 0 && ck.live == 0 && ck.bufs != nil {
		pc.c.release(ck.bufs)
		ck.bufs = nil
	}
}
