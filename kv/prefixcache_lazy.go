package kv

import "slices"

// Lazy entries: an entry that Insert made refers to the inserted sequence's (its
// origin's) granules until the origin closes (handOver: the entry takes the ranges
// over) or is about to change the cached tokens (materialize: the entry gets ranges
// of its own first), or leaves the index (detach). The origin's owner calls these
// through the prefix hooks (see hooks.go), under the origin's ranges lock where they
// change what a lookup maps from.
//
// Insert is lazy so that a cache that is never hit costs no system call. When the
// origin closes, the entry takes over its ranges as they are (their page tables too,
// so that a granule eviction later returns to the pool's park is still warm). It gets
// ranges of its own (whole granules mapped, the tail copied) only when the origin is
// about to change what was cached: a Truncate below the inserted tokens, or a
// WriteToken into the partly filled granule past the last whole one. A lookup that
// hits a lazy entry maps from the origin's ranges under that lock, which the origin's
// own resizing calls take too. Protection is lazy as well: like ForkAt on a
// backing.Protector, the hit first makes the origin's own mapping of the granules it
// maps read-only (one call per range: pcLive.protectFrom), so that from then on a
// stray store through the origin's Bytes or View faults. NB: until that first hit,
// those granules stay writable in the origin (WriteToken refuses them; a store through
// Bytes or a View would change what the cache holds), and so do, until the origin
// closes, its tokens past the last whole granule below the inserted length, which
// Bytes and Views MUST NOT rewrite (Insert says so to the caller).

// lazyTail reports whether e, lazy, holds s's partly filled last granule. pc.mu is
// held.
func (pc *PrefixCache) lazyTail(e *pcEntry) bool {
	return pc.c.unitsFor(e.n) > pc.c.fullUnits(e.n)
}

// lazyTailAt returns the reference by which a lazy entry of s holds s's granule j as
// its partly filled tail, or nil. pc.mu is held.
func (pc *PrefixCache) lazyTailAt(s *Sequence, j int) *granuleRef {
	for _, e := range s.pcl.lazy {
		if e.origin == s && !e.closed && e.tail != nil && len(e.grefs) == j+1 {
			return e.tail
		}
	}
	return nil
}

// untail makes the lazy entries of s whose tail is g hold it as a whole granule of s
// (s's pcLive now counts s's mapping of it). pc.mu is held.
func (pc *PrefixCache) untail(s *Sequence, g *granuleRef) {
	for _, e := range s.pcl.lazy {
		if e.origin == s && e.tail == g {
			e.tail = nil
		}
	}
}

// replaced is told by Truncate that s's granule j was given up (its tokens copied into
// a granule of s's own, where s now holds more than j granules' worth of bytes): the
// lazy entries of s that hold granule j (as their last) refer to s's new granule
// from now on, by one new reference, or, where s kept no granule j, leave the index.
// s's owner calls it with s's ranges lock held (prefixHooks.truncating).
func (l *pcLive) replaced(s *Sequence, j int) {
	pc := l.pc
	pc.mu.Lock()
	var drop []*pcEntry
	var g *granuleRef
	gone := make(map[*granuleRef]bool)
	for _, e := range l.lazy {
		if e.origin != s || e.closed || len(e.grefs) <= j {
			continue
		}
		old := e.grefs[j]
		if e.tail == old && !gone[old] {
			old.unmap() // s no longer maps it; counted once however many entries held it
			gone[old] = true
		}
		if s.err != nil || pc.c.unitsFor(s.n) <= j || e.n > s.n {
			e.tail = nil
			drop = append(drop, pc.detach(e)...)
			continue
		}
		pc.release(old)
		if g == nil {
			g = &granuleRef{live: 1}
		}
		e.grefs[j], e.tail = g, g
		pc.hold(g)
	}
	pc.mu.Unlock()
	for _, d := range drop {
		d.close()
	}
}

// materialize gives the lazy entries of s that hold tokens at or past t ranges of their
// own (the whole granules mapped, the tail copied), so that s may change those tokens:
// a failure takes the entry out of the index instead, as a damaged one. s's owner
// calls it with s.pcl.mu held.
func (pc *PrefixCache) materialize(s *Sequence, t int) {
	l := s.pcl
	pc.mu.Lock()
	var todo []*pcEntry
	for _, e := range l.lazy {
		if e.origin == s && !e.closed && e.n > t {
			todo = append(todo, e)
		}
	}
	pc.mu.Unlock()
	for _, e := range todo {
		pc.mu.Lock()
		n := e.n
		gone := e.closed || e.origin != s
		pc.mu.Unlock()
		if gone {
			continue
		}
		es, err := pc.startFrom(s, n, false)
		var drop []*pcEntry
		pc.mu.Lock()
		switch {
		case err == nil && !e.closed && e.origin == s && e.n == n:
			e.seq, e.origin = es, nil
			pc.c.ownEntry(es)
			if pc.lazyTail(e) {
				// The entry's copy of the tail stands for s's granule there.
				k := len(e.grefs) - 1
				pc.release(e.grefs[k])
				if e.grefs[k] == e.tail && e.tail.entries == 0 {
					e.tail.unmap() // which s alone now maps
				}
				e.grefs[k] = &granuleRef{}
				pc.hold(e.grefs[k])
			}
			e.tail = nil
			pc.tiers.writeThrough(pc, e)
		case err == nil:
			pc.mu.Unlock()
			es.Close() // evicted or shortened meanwhile: it changes nothing
			pc.mu.Lock()
			if !e.closed && e.origin == s {
				drop = append(drop, pc.detach(e)...)
			}
		default:
			if !e.closed && e.origin == s {
				drop = append(drop, pc.detach(e)...)
			}
		}
		pc.mu.Unlock()
		for _, d := range drop {
			d.close()
		}
	}
	pc.mu.Lock()
	l.lazy = slices.DeleteFunc(l.lazy, func(e *pcEntry) bool { return e.closed || e.origin != s })
	pc.mu.Unlock()
}

// handOver, as s closes, makes an entry made from s hold s's own ranges rather than
// refer to them (lazy) or map them, and returns the ranges Close must release in place
// of s's (none when a lazy entry took them over). It reports false when no entry
// takes them over: s's ranges are then released as usual. The lazy entries that do
// not take them over (only one can) leave the index, as do all of them when s is
// damaged.
//
// NB: an entry that mapped s's granules made those mappings by Share and never
// touched them, so they hold no page tables, while s's are populated by its writes.
// Unmapping s's would zap every page table entry and leave the cache with mappings
// whose first use faults page by page; keeping s's costs nothing and, when eviction
// later returns a granule to the pool, it goes to the park with its page tables, so
// the next commit of it does not fault either.
func (l *pcLive) handOver(s *Sequence) ([]buffer, bool) {
	pc := l.pc
	if l.origin {
		l.mu.Lock()
		defer l.mu.Unlock()
	}
	pc.mu.Lock()
	var drop []*pcEntry
	if h := pc.tiers.originHolder(s); h != nil {
		// The blocks of s's evicted lazy entries: written down now that their
		// memory comes back, from a holder that maps them, off s's Close.
		drop = append(drop, h)
	}
	defer func() {
		drop, later := pc.tiers.later(drop)
		pc.mu.Unlock()
		pc.tiers.closeAll(drop, later)
	}()
	var take *pcEntry
	if !pc.closed && s.err == nil {
		for _, e := range l.lazy {
			if !e.closed && e.origin == s && e.n <= s.n && (take == nil || e.n > take.n) {
				take = e
			}
		}
	}
	for _, e := range l.lazy {
		if e != take && !e.closed && e.origin == s {
			drop = append(drop, pc.detach(e)...)
		}
	}
	l.lazy = nil
	if take != nil {
		c := pc.c
		if err := s.resizeAll(c.extent(take.n)); err != nil {
			drop = append(drop, pc.detach(take)...)
			return nil, false
		}
		es := &Sequence{c: c, id: s.id, bufs: s.bufs, n: take.n, frozen: s.frozen, guarded: s.guarded || l.protected > 0}
		es.frozen = min(es.frozen, c.shareable(take.n))
		es.refreshStats()
		s.bufs = nil
		take.seq, take.origin = es, nil
		if take.tail != nil {
			take.tail.unmap() // s's tail granule is the entry's alone now
			take.tail = nil
		}
		pc.tiers.writeThrough(pc, take)
		c.mu.Lock()
		c.entries++
		c.mu.Unlock()
		l.entry = nil
		return nil, true
	}
	e := l.entry
	if pc.closed || e == nil || e.closed || e.seq == nil || e.busy > 0 || s.err != nil || e.seq.err != nil {
		return nil, false
	}
	n, c := e.seq.n, pc.c
	full := c.shareable(n)
	if n > s.n || s.frozen < full {
		return nil, false // s was truncated into what the entry maps
	}
	if c.extent(n) > full && s.frozen > full {
		// The block (granule) where the entry's tail would be copied is shared from
		// s's ranges (a fork, a frozen prefix): read-only in s, and those holders'.
		return nil, false
	}
	if err := s.resizeAll(c.extent(n)); err != nil {
		return nil, false
	}
	old := e.seq.bufs
	if c.extent(n) > full {
		// s may have rewritten its tokens past its shared granules since the entry
		// got its own copy of them: that copy is what was inserted.
		for i := range s.bufs {
			if err := c.copyTail(s.bufs[i], old[i], n); err != nil {
				return nil, false
			}
		}
	}
	e.seq.bufs, s.bufs = s.bufs, nil
	e.seq.frozen, e.seq.guarded = full, s.guarded || l.protected > 0
	e.seq.refreshStats()
	if k := full / c.unit; k < len(e.grefs) {
		// The entry's copy of the partly filled last granule gives way to s's.
		pc.release(e.grefs[k])
		e.grefs[k] = &granuleRef{}
		pc.hold(e.grefs[k])
	}
	l.entry = nil
	return old, true
}

// startFrom starts a sequence on src's first n tokens (an entry's, or an inserted
// sequence's), evicting cached prefixes before the budget refuses the copied tail
// (shareBudget, evicting). An inserted sequence's shared bytes become frozen (WriteToken
// refuses them).
func (pc *PrefixCache) startFrom(src *Sequence, n int, entry bool) (*Sequence, error) {
	return pc.startFromBelow(src, n, entry, nil, nil)
}

// startFromBelow is startFrom with the whole window units under src's that below's
// ranges hold (see shareGroupsFrom), for an entry made from an inserted sequence. On
// a model with recurrent groups a lookup's sequence (entry) gets the states of ck, a
// checkpoint at n, and an entry none (it holds checkpoints apart).
func (pc *PrefixCache) startFromBelow(src *Sequence, n int, entry bool, below *Sequence, ck *checkpoint) (*Sequence, error) {
	need, st := pc.c.shareNeed(n), stateSrc{}
	if pc.c.recurrent() {
		st = stateSrc{ck: ck, none: ck == nil}
		if ck == nil {
			need -= pc.c.stateNeed(n)
		}
	}
	if err := pc.c.needBudget(need); err != nil {
		return nil, err
	}
	return evicting(pc.c, func() (*Sequence, error) {
		// An entry made from an inserted sequence (not entry) keeps every unit of
		// it a window group still holds; a lookup's sequence, from its window on.
		q, err := pc.c.sequenceOn(src, n, !entry, below, st)
		if err == nil && !entry {
			for gi := range pc.c.groups {
				f := src.frozenOf(gi)
				*f = max(*f, *q.frozenOf(gi))
			}
		}
		return q, err
	})
}
