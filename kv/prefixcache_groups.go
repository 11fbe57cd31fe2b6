package kv

import (
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/radix"
)

// The prefix cache on a model of several layer groups (Cache.multi: window groups
// beside full or MLA ones, as gpt-oss, Gemma-3 and Llama-4 have; recurrent groups,
// which add checkpoints: prefixcache_checkpoint.go). Each group lies on ranges of its
// own with sharing units of its own, so an entry, and every live holder, refers to
// each group's units by references of that group (unitSeg, granuleRef.grp): a window
// group's from the first unit it holds.
//
// The hit rule is the window rule (see the package doc; group.serves): a hit of m
// tokens needs the full groups' first m tokens and each window group's tokens that
// the step at m reads, all held by one entry. A lookup takes the longest m for which
// an entry whose tokens start with the prompt's first m holds them: on each entry
// that shares k tokens with the prompt, the longest m <= k at which its window groups
// hold what the step reads (servedBy: k itself, else the last chunk boundary below
// it, where the step reads none of a chunked group's tokens).
//
// Entries here are never lazy: Insert maps the inserted sequence's whole units into
// ranges of the entry's own at once and copies each group's partly filled last unit,
// as ForkAt does (so that a window that moves on in the sequence afterwards gives
// back only the sequence's mappings, never the entry's), and a window group's entry
// keeps every unit the sequence still held, and those of the entry it takes the place
// of under them.
//
// Eviction is page-aware across groups: it first gives back the least recently used
// entry's older window units (below the unit of its own last window, which only
// hits shorter than the entry read), from the first on, as long as each gives memory
// back (for MaxBytes: counts in CachedBytes); the entry stays for the hits whose
// windows it still holds. Only where no entry has any such unit does it take the
// least recently used entry's last units, as on one group (the leaf goes whole when
// none of its own tokens would be left). It never takes what a pin holds.
//
// Events: Insert queues, after the insert, the first token each window group of the
// entry holds (pcEvents.from), and trimWindows the new one as it gives older units
// back, so that a window group's events follow what its entries hold (see
// events_groups.go).
//
// Tiers: one value per tier block carries every group's units of it (see
// prefixcache_tier_groups.go).
//
// Not yet: lazy inserts, a miss taking an evicted entry's ranges over.

// holdsWindow reports whether e holds, in each window group, the tokens a step at m
// reads (the window rule: group.serves). pc.mu is held.
func (pc *PrefixCache) holdsWindow(e *pcEntry, m int) bool {
	return pc.servedBy(e, m) == m
}

// servedBy returns the most tokens m' <= m that a hit on e may take under the window
// rule: every window group of e's holds what a step at m' reads (group.lastServed,
// group after group until all agree), and, on a model with recurrent groups, e holds
// a checkpoint at m' (checkpointServed). pc.mu is held.
func (pc *PrefixCache) servedBy(e *pcEntry, m int) int {
	if e.seq == nil {
		return 0
	}
	if pc.c.recurrent() {
		return pc.checkpointServed(e, m)
	}
	return pc.windowServed(e, m)
}

// windowServed is servedBy under the window rule alone. pc.mu is held.
func (pc *PrefixCache) windowServed(e *pcEntry, m int) int {
	for {
		was := m
		for gi := range pc.c.groups {
			if g := &pc.c.groups[gi]; g.windowed() {
				m = g.lastServed(e.seq.gs[gi].held, m)
			}
		}
		if m == was {
			return m
		}
	}
}

// hitLocked returns the longest prefix of tokens that a lookup may start on under the
// hit rule, and the leaf whose entry holds it (the most recently used of those that
// do), or 0 and nil. pc.mu is held.
func (pc *PrefixCache) hitLocked(root *radix.Node[*pcEntry], tokens []int32) (int, *radix.Node[*pcEntry]) {
	m, x := pc.tree.PeekFrom(root, tokens)
	for m > 0 {
		// Every leaf below x shares at least m tokens with the prompt (the deeper
		// ones, tried before, share more); the longest hit on one of them that is
		// longer than x's parent's depth is the longest there is, those below the
		// parent's other children sharing no more than that depth.
		floor := 0
		if p := x.Parent(); p != nil {
			floor = p.Depth()
		}
		var best *radix.Node[*pcEntry]
		bestM := floor
		x.EachLeafBelow(func(l *radix.Node[*pcEntry]) bool {
			if got := pc.servedBy(l.Value(), m); got > bestM || got == bestM && got > floor && l.Used() > best.Used() {
				best, bestM = l, got
			}
			return true
		})
		if best != nil {
			return bestM, best
		}
		x = x.Parent()
		m = floor
	}
	return 0, nil
}

// hitLive returns what a sequence that starts on e's first m tokens maps of e's
// units (each group's whole units below m, a window group's from its dropOff(m)
// on), counted as mapped by it. pc.mu is held.
func (pc *PrefixCache) hitLive(e *pcEntry, m int) *pcLive {
	l := newLive(pc)
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		lo, hi := g.dropOff(m)/g.unit, g.fullUnits(m)
		if lo >= hi {
			continue
		}
		l.segs[gi] = unitSeg{from: lo, refs: append([]*granuleRef(nil), e.segs[gi].slice(lo, hi)...)}
		for _, r := range l.segs[gi].refs {
			r.mapped()
		}
	}
	return l
}

// needGroups returns the bytes a prompt of n tokens whose first m are a hit commits:
// Need's on a cache of several groups, before the pool's idle granules.
func (c *Cache) needGroups(n, m int) int64 {
	var need int64
	for gi := range c.groups {
		g := &c.groups[gi]
		size, _ := backing.AlignUp(g.extent(n), c.gran)
		need += int64(g.nbuf) * int64(size-g.shareable(m))
	}
	return need
}

// insertGroups is Insert on a cache of several groups, once s and tokens are checked
// and s's runs ahead given back: the entry gets ranges of its own at once (see
// above), and s's whole units below len(tokens) become shared. It returns the entries
// to close once pc.mu is released, with pc.mu held on return unless err is not nil.
func (pc *PrefixCache) insertGroups(ns Namespace, s *Sequence, tokens []int32) ([]*pcEntry, error) {
	n := len(tokens)
	if err := s.windowCheck("insert", n); err != nil {
		return nil, err
	}
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return nil, ErrClosed
	}
	if s.pcl != nil {
		if err := s.pcl.bind(ns); err != nil {
			pc.mu.Unlock()
			return nil, err
		}
	}
	m, node := pc.tree.PeekFrom(pc.space(ns, false), tokens)
	if m == n {
		// Every token is in the index already: left as it is, marked used; an entry
		// that holds them keeps s's checkpoints among them.
		pc.tree.Touch(node)
		if s.pcl != nil && n > 0 {
			pc.handCheckpoints(pc.tree.Cover(node).Value(), s.pcl, n)
		}
		return nil, nil
	}
	// Close waits for it: it maps from an entry (below) that Close would close.
	pc.working.Add(1)
	defer pc.working.Done()
	// The entry the new one takes the place of (its tokens are the first of these),
	// if any: its window units under s's go on in the new entry, mapped from its
	// ranges, which its being busy keeps open meanwhile.
	var below *pcEntry
	var bs *Sequence
	if node.Leaf() && node.Depth() == m {
		below, bs = node.Value(), node.Value().seq
		below.busy++
	}
	pc.mu.Unlock()
	frozen := make([]int, len(pc.c.groups)) // before the entry shares more of s
	for gi := range frozen {
		frozen[gi] = *s.frozenOf(gi)
	}
	es, err := pc.startFromBelow(s, n, false, bs, nil)
	if err == nil {
		fulls := make([]int, len(pc.c.groups))
		for gi := range fulls {
			fulls[gi] = *es.frozenOf(gi)
		}
		if err = s.protectGroups(fulls); err != nil {
			es.Close()
		}
	}
	var drop []*pcEntry
	pc.mu.Lock()
	if below != nil {
		below.busy--
		if below.state() == entryOut {
			drop = append(drop, below) // it left the index while es mapped from it
		}
	}
	if err == nil && pc.closed {
		err = ErrClosed
		pc.mu.Unlock()
		es.Close()
		pc.mu.Lock()
	}
	if err != nil {
		pc.mu.Unlock()
		for _, d := range drop {
			d.close()
		}
		return nil, err
	}
	if below != nil && below.segs == nil {
		// below left the index while es mapped from it: an entry that displaced it may
		// hold the same units by below's references, which are gone, and fresh ones
		// would count those units twice (freed by evicting either, while the other
		// maps them). Leave the tokens to a later insert.
		pc.mu.Unlock()
		es.Close()
		pc.mu.Lock()
		return drop, nil
	}
	if s.pcl == nil {
		s.pcl = newLive(pc)
		s.pcl.ns, s.pcl.bound = ns, true
	}
	l := s.pcl
	// NB: ns's root may have left the index while pc.mu was not held: found again.
	root := pc.space(ns, true)
	m, _ = pc.tree.PeekFrom(root, tokens)
	e := &pcEntry{seq: es, n: n, segs: make([]unitSeg, len(pc.c.groups)), ns: ns}
	leaf, old, displaced := pc.tree.InsertFrom(root, tokens, e)
	if leaf == nil {
		// Another insert of the same tokens came first.
		pc.mu.Unlock()
		es.Close()
		pc.mu.Lock()
		return drop, nil
	}
	e.leaf = leaf
	pc.c.ownEntry(es)
	pc.ev.inserted(pc.tree, e, m, old, displaced)
	pc.entries++
	pc.inserted += int64(n - m)
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		if g.state > 0 {
			continue // the entry holds checkpoints (below), no state of its own
		}
		// What s maps of the cache's units is below its frozen bytes; the rest
		// are s's own, which the entry now maps too.
		l.trim(gi, 0, frozen[gi]/g.unit)
		from, full, k := es.bufs[g.first].Start()/g.unit, g.fullUnits(n), g.unitsFor(n)
		// The whole units below s's first are below's, those from it on s's; NB:
		// where s's window starts past n (the step at n reads none of it), the entry
		// has no whole unit of a window group (from is full).
		lo := min(max(from, s.bufs[g.first].Start()/g.unit), full)
		refs := make([]*granuleRef, 0, k-from)
		if from < lo {
			// Mapped from below, by its references (it is still in the index).
			refs = append(refs, below.segs[gi].slice(from, lo)...)
		}
		if lo < full {
			l.cover(gi, lo, full)
			refs = append(refs, l.segs[gi].slice(lo, full)...)
		}
		if k > full {
			// The partly filled last unit: the entry's own copy.
			refs = append(refs, &granuleRef{grp: int32(gi)})
		}
		e.segs[gi] = unitSeg{from: from, refs: refs}
		for _, r := range refs {
			pc.hold(r)
		}
		if g.windowed() {
			pc.ev.from(e, gi, es.gs[gi].held)
		}
	}
	pc.handCheckpoints(e, l, n)
	if displaced {
		// The new entry holds the old one's tokens (and its window units, where
		// they lay under s's, and its checkpoints): the old one goes. That is no
		// eviction: the tokens stay cached.
		pc.ev.displaced(old)
		pc.holdAll(e, old.ckpts, old.n)
		e.hits, e.stored = old.hits, old.stored
		if _, d := pc.unhold(old); d != nil {
			drop = append(drop, d)
		}
	}
	// The entry holds ranges of its own from its insert on (it is never lazy): a
	// write-through stores its blocks now.
	pc.tiers.writeThrough(pc, e)
	return drop, nil
}

// checkpointServed returns the most tokens m' <= m a hit on e may take on a cache with
// recurrent groups: the latest of e's checkpoints at or below m at which its window
// groups hold what the step reads (windowServed), or 0. pc.mu is held.
func (pc *PrefixCache) checkpointServed(e *pcEntry, m int) int {
	_, i := latest(e.ckpts, m)
	for ; i >= 0; i-- {
		if n := e.ckpts[i].n; pc.windowServed(e, n) == n {
			return n
		}
	}
	return 0
}
