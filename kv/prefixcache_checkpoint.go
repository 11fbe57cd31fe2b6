package kv

import (
	"errors"
	"fmt"
	"slices"

	"github.com/vmarena/vmarena/backing"
)

// Recurrent-state checkpoints: the prefix cache on a model whose Recurrent groups lie
// beside full-attention (or MLA, or window) groups, as Qwen3-Next, Nemotron-H, Jamba
// and Granite-4.0-H have. A recurrent state after n tokens is a function of all n, so
// a hit of m tokens needs the state after exactly m, which the cache can not compute:
// the server records it (Sequence.Checkpoint) where it has it, at the points it
// chooses (block boundaries of the prefill, the end of a system prompt, of a turn),
// as vLLM keeps block-aligned states and SGLang's Mamba radix cache keeps states at
// tree nodes.
//
// A checkpoint is a copy of every recurrent group's states after its n tokens, in
// ranges of its own (one per recurrent range of a sequence), committed from the
// cache's backing through its ledger like a sequence's. It is never mapped: a hit
// copies it into the new sequence, whose step writes its states in place. Its states:
//
//  1. Pending: held by live sequences only (the one that recorded it and has not
//     inserted its tokens yet, those that started on it by a hit of an entry that
//     has left the index since), no entry: PendingCheckpointBytes, not CachedBytes,
//     never evicted.
//  2. Cached: held by one entry or more (and maybe live sequences): CachedBytes and
//     CheckpointBytes, counted once however many hold it.
//  3. Freed: held by nothing; its ranges are closed.
//
// Transitions: Checkpoint makes one Pending, held by its sequence; Insert of n tokens
// hands the inserting sequence's checkpoints at or below n to the new entry (the
// sequence lets go of them: Pending → Cached), and the entry it displaces hands over
// its own; a hit makes the new sequence hold the entry's checkpoints at or below the
// hit until it inserts or closes (as it maps the entry's units: eviction leaves them);
// a holder lets go as the sequence closes or truncates below it, or the entry leaves
// the index or is cut below it; the last holder's going frees it. Both counts change
// in ckRef only (prefixcache_index.go, with the granules' counts), which panics with
// panicRefCount below zero; the hit rule is servedBy's (prefixcache_groups.go), the
// eviction steps are beside the others (prefixcache_evict.go). A server that prefills a
// long prompt inserts its tokens at each checkpoint, so that eviction may take the
// older ones while the prefill goes on.
//
// The hit rule: a lookup of a prompt takes the longest m for which an entry whose
// tokens start with the prompt's first m holds a checkpoint at m and whose window
// groups hold what the step at m reads (the window rule, at m): the full groups' first
// m tokens are mapped as on any hybrid, the states copied from the checkpoint, and
// the server computes the rest. With no such checkpoint the hit is 0.
//
// Eviction is page-aware as on other hybrids (prefixcache_evict.go), with one step
// between the window units and the entries' last units: the least recently used
// entry's checkpoints below its latest that it alone holds and no live sequence does
// go first (no other prompt started on them: a conversation's next turn starts on the
// latest). An entry cut to fewer tokens is cut to its latest checkpoint at or below
// the cut (the units past it serve no hit), its checkpoints past that with them; an
// entry that leaves the index gives its checkpoints up. So a checkpoint never
// outlives, in an entry, the full-attention units a hit on it needs.
//
// Events announce an entry's full groups' blocks as on other hybrids, every block of
// its tokens: a recurrent group has no blocks and announces none (so a router that
// counts blocks counts the tokens past the latest checkpoint too, which a hit
// recomputes). With tiers, a tier block whose end an entry holds a checkpoint at goes
// down with the states, and a load from a tier starts on the states of the last block
// it loads that carries them (prefixcache_tier_groups.go).

// checkpoint is a copy of a sequence's recurrent states after its first n tokens.
// The prefix cache's lock guards its counts.
type checkpoint struct {
	n     int
	bufs  []buffer // parallel to a sequence's ranges: a recurrent group's hold its states, the others nil
	bytes int64    // committed in bufs
	// entries and live are the entries and the live sequences that hold it.
	entries int32
	live    int32
	// writes is the eviction's write-downs into the tiers that read it (a holder's
	// tierPart's cks; a write-through's holds it as a live sequence does): once no
	// entry or live sequence holds it, it counts nowhere and its bytes count as given
	// back, as a holder's granules do, but its ranges close only when the last of them
	// ended (ckUnwrite).
	writes int32
	// down: a write-down held it (holdStates, pickTrim), so that the tiers have its
	// states with the block ending at it, unless that store failed (a drop, counted):
	// eviction does not write them again.
	down bool
}

// recurrent reports whether c's model has a Recurrent group.
func (c *Cache) recurrent() bool {
	for gi := range c.groups {
		if c.groups[gi].state > 0 {
			return true
		}
	}
	return false
}

// stateNeed returns the bytes of granules a new holder of n tokens commits for its
// recurrent states: none for n = 0.
func (c *Cache) stateNeed(n int) int64 {
	var need int64
	for gi := range c.groups {
		if g := &c.groups[gi]; g.state > 0 {
			size, _ := backing.AlignUp(g.extent(n), c.gran)
			need += int64(g.nbuf) * int64(size)
		}
	}
	return need
}

// prefixCacheable returns an error matching ErrConfig when c's model can not have a
// prefix cache: one with a Recurrent group and no group that keeps tokens (there is
// nothing to map, and a state alone is a checkpoint).
func (c *Cache) prefixCacheable() error {
	if !c.recurrent() {
		return nil
	}
	for gi := range c.groups {
		if c.groups[gi].state == 0 {
			return nil
		}
	}
	return fmt.Errorf("%w: a prefix cache needs a layer group that keeps tokens beside the recurrent ones; model %q has %s", ErrConfig, c.cfg.Model.Name, groupKinds(c.cfg.Model))
}

// Checkpoint records, in the cache's prefix cache, a copy of every recurrent group's
// states of s as they are now, which MUST be the states after exactly its first n
// tokens, so that a later prompt that starts with those tokens can start there (see
// PrefixCache.Lookup): a server calls it where its step has just made them so (a
// prefill chunk that ends on a block boundary, the end of a system prompt or of a
// turn), before it steps further; the cache can not tell. n is at most s's length (a
// server that appended a whole prompt before its chunked prefill checkpoints at each
// chunk's end), and not below the last checkpoint s recorded. The copy takes the
// states' granules (Cache.Size: a recurrent group's BlockBytes) from the budget,
// evicting cached prefixes before it refuses with an *accounting.BudgetError. It is
// cached memory, never s's: PendingCheckpointBytes until an Insert of s's first n
// tokens or more hands it to an entry (PrefixCacheStats.CheckpointBytes), gone when s
// closes or truncates below n first. A second call at the same n keeps the first copy.
// A server that prefills a long prompt inserts its tokens after each checkpoint, so
// that eviction may take the older ones while the prefill goes on.
//
// It fails with ErrConfig on a model without a recurrent group, on a cache without a
// prefix cache, or for a sequence that holds granules of an earlier prefix cache; with
// ErrRange for n below 1, past Len or below s's last checkpoint; and changes nothing
// on any error.
func (s *Sequence) Checkpoint(n int) error {
	if err := s.usable(); err != nil {
		return err
	}
	c := s.c
	if !c.recurrent() {
		return fmt.Errorf("%w: Checkpoint needs a model with a recurrent group; model %q has %s", ErrConfig, c.cfg.Model.Name, groupKinds(c.cfg.Model))
	}
	pc := c.pc.Load()
	if pc == nil {
		return fmt.Errorf("%w: Checkpoint keeps the states in the cache's prefix cache, and the cache has none", ErrConfig)
	}
	if s.pcl != nil && s.pcl.pc != pc {
		return fmt.Errorf("%w: the sequence maps granules of an earlier prefix cache, closed since", ErrConfig)
	}
	if n < 1 || n > s.n {
		return fmt.Errorf("%w: checkpoint at %d tokens of a sequence of %d (must be 1 to its length)", ErrRange, n, s.n)
	}
	if l := s.pcl; l != nil && len(l.ckpts) > 0 {
		switch last := l.ckpts[len(l.ckpts)-1].n; {
		case n == last:
			return nil
		case n < last:
			return fmt.Errorf("%w: checkpoint at %d tokens, below the sequence's last at %d", ErrRange, n, last)
		}
	}
	if err := s.dropAhead(); err != nil {
		return err
	}
	if need := c.stateNeed(n); need > 0 {
		if be := c.budgetOrEvict(need, 0); be != nil {
			return c.refuse(be)
		}
	}
	ck, err := evicting(c, func() (*checkpoint, error) { return c.copyStates(s, n) })
	if err != nil {
		return err
	}
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return errors.Join(ErrClosed, releaseError(c.release(ck.bufs)))
	}
	if s.pcl == nil {
		s.pcl = newLive(pc)
	}
	// NB: n is at or past the sequence's last checkpoint: they stay in order.
	s.pcl.ckpts = append(s.pcl.ckpts, ck)
	pc.ckRef(ck, 0, 1)
	pc.mu.Unlock()
	return nil
}

// copyStates returns a new checkpoint at n tokens holding a copy of s's recurrent
// states, or an error with nothing committed.
func (c *Cache) copyStates(s *Sequence, n int) (*checkpoint, error) {
	ck := &checkpoint{n: n, bufs: make([]buffer, len(s.bufs))}
	var made []buffer
	for gi := range c.groups {
		g := &c.groups[gi]
		if g.state == 0 {
			continue
		}
		for i, src := range g.ranges(s.bufs) {
			b, err := c.st.newBuffer(g.capac, c.cfg.Authority)
			if err == nil {
				made = append(made, b)
				if err = b.Resize(g.state); err == nil {
					err = copyRange(b, src, 0, g.state)
				}
			}
			if err != nil {
				return nil, errors.Join(err, releaseError(c.release(made)))
			}
			ck.bufs[g.first+i] = b
			ck.bytes += int64(b.Committed())
		}
	}
	return ck, nil
}

// holdAll makes e hold each of cks at or below n tokens (which e holds, and the
// holder of cks too) that it does not hold one of the same n of already, keeping e's
// ascending. pc.mu is held.
func (pc *PrefixCache) holdAll(e *pcEntry, cks []*checkpoint, n int) {
	for _, ck := range cks {
		if ck.n > n || ck.bufs == nil {
			continue
		}
		i, found := slices.BinarySearchFunc(e.ckpts, ck.n, func(x *checkpoint, n int) int { return x.n - n })
		if found {
			continue
		}
		e.ckpts = slices.Insert(e.ckpts, i, ck)
		pc.ckRef(ck, 1, 0)
	}
}

// handCheckpoints makes e hold l's checkpoints at or below n (holdAll), and l let go
// of them: from an Insert of n tokens on, the entry keeps them, and eviction may take
// them while the sequence lives on. pc.mu is held.
func (pc *PrefixCache) handCheckpoints(e *pcEntry, l *pcLive, n int) {
	pc.holdAll(e, l.ckpts, n)
	_, i := latest(l.ckpts, n)
	for _, ck := range l.ckpts[:i+1] {
		pc.ckRef(ck, 0, -1)
	}
	l.ckpts = slices.Delete(l.ckpts, 0, i+1)
}

// dropFrom lets e's checkpoints past n go (an eviction's cut: counted in Evictions)
// and returns the bytes that came back. pc.mu is held.
func (pc *PrefixCache) dropFrom(e *pcEntry, n int) int64 {
	_, i := latest(e.ckpts, n)
	var freed int64
	for _, ck := range e.ckpts[i+1:] {
		freed += pc.ckRef(ck, -1, 0)
	}
	pc.evictions += int64(len(e.ckpts) - i - 1)
	clear(e.ckpts[i+1:])
	e.ckpts = e.ckpts[:i+1]
	return freed
}

// hitCheckpoints makes l, a lookup's new holder of e's first m tokens, hold e's
// checkpoints at or below m, and returns the one at m (nil for m = 0). pc.mu is held.
func (pc *PrefixCache) hitCheckpoints(l *pcLive, e *pcEntry, m int) *checkpoint {
	ck, i := latest(e.ckpts, m)
	if ck == nil || ck.n != m {
		return nil
	}
	l.ckpts = append(l.ckpts, e.ckpts[:i+1]...)
	for _, x := range l.ckpts {
		pc.ckRef(x, 0, 1)
	}
	return ck
}

// stateSrc says where a new holder's recurrent states come from (shareGroupsFrom):
// the zero value, from the source sequence (a fork); ck, from a checkpoint (a prefix
// cache hit); none, nowhere (a prefix cache entry, which holds checkpoints instead).
type stateSrc struct {
	ck   *checkpoint
	none bool
}

// copyIn makes dst, group g's new ranges for n tokens, hold src's states: ck's, or
// none. It returns false for the zero stateSrc, whose states the caller copies from
// the source sequence.
func (st stateSrc) copyIn(g *group, dst []buffer, n int) (bool, error) {
	switch {
	case st.ck == nil && !st.none:
		return false, nil
	case st.ck == nil || n == 0:
		return true, nil
	}
	for i, b := range g.ranges(st.ck.bufs) {
		if err := dst[i].Resize(g.state); err != nil {
			return true, err
		}
		if err := copyRange(dst[i], b, 0, g.state); err != nil {
			return true, err
		}
	}
	return true, nil
}
