package kv

import "fmt"

// The checks below run at transitions in the invariants build only (see
// internal/invariants): each call sits behind `if invariants.Enabled`, which the
// normal build compiles out. Each panics with a message that names what went wrong.

// checkCountsLocked panics when the cache's counts of sequences being made and of
// sequences its prefix cache owns go below zero, or its lost bytes do: Close waits
// on the first two, so a count below zero would let it return under a live sequence.
// c.mu is held.
func (c *Cache) checkCountsLocked() {
	if c.inflight < 0 || c.entries < 0 || c.lost < 0 {
		panic(fmt.Sprintf("kv: invariant: %d sequences being made, %d owned by the prefix cache, %d bytes lost", c.inflight, c.entries, c.lost))
	}
}

// checkAlike panics when the ranges of one layer group of a sequence that is not
// damaged differ in what they commit, share or start at: every operation resizes and
// shares them all the same, and refreshStats reads one range for all of its group's.
func (s *Sequence) checkAlike() {
	if s.err != nil || len(s.bufs) == 0 {
		return
	}
	for gi := range s.c.groups {
		g := &s.c.groups[gi]
		b0 := s.bufs[g.first]
		for i, b := range s.bufs[g.first+1 : g.first+g.nbuf] {
			if b.Committed() != b0.Committed() || b.Shared() != b0.Shared() || b.Start() != b0.Start() {
				panic(fmt.Sprintf("kv: invariant: sequence %d, group %d: range %d commits %d from %d (%d shared), its first %d from %d (%d shared)",
					s.id, gi, i+1, b.Committed(), b.Start(), b.Shared(), b0.Committed(), b0.Start(), b0.Shared()))
			}
		}
	}
}

// checkRefs panics when the prefix's references go below zero: its memory would
// have been given back while a holder still maps it. c.mu is held.
func (p *Prefix) checkRefs() {
	if p.refs < 0 {
		panic(fmt.Sprintf("kv: invariant: a prefix of %d tokens has %d references", p.tokens, p.refs))
	}
}

// checkCountsLocked panics when the prefix cache's entries or the bytes they hold go
// below zero, or bytes are counted held with no entry left to hold them. pc.mu is
// held.
func (pc *PrefixCache) checkCountsLocked() {
	if pc.entries < 0 || pc.cachedBytes < 0 || pc.entries == 0 && pc.cachedBytes != 0 {
		panic(fmt.Sprintf("kv: invariant: a prefix cache of %d entries holds %d bytes", pc.entries, pc.cachedBytes))
	}
}

// checkEmptyLocked panics when the prefix cache, with every entry evicted (Close),
// still counts an entry or bytes held: what they held would never come back. pc.mu
// is held.
func (pc *PrefixCache) checkEmptyLocked() {
	if pc.entries != 0 || pc.cachedBytes != 0 {
		panic(fmt.Sprintf("kv: invariant: a prefix cache with every entry evicted counts %d entries holding %d bytes", pc.entries, pc.cachedBytes))
	}
}
