package kv

import (
	"errors"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/radix"
)

// Eviction: which cached granules go back, and how. It takes the last granules of the
// least recently used leaf (the leaf whole, in one release, when the need covers all
// of its own, or with tiers: see prefixcache_tier.go), and only ones that give
// memory back (held by that entry alone, mapped by no live sequence): page-aware,
// since a granule any other holder maps frees nothing. When it runs is the package
// doc's memory rule; the governor's way in is the reclaimer
// (accounting.Authority.SetReclaimer).
//
// On a cache of one layer group, a lookup that misses, for a prompt whose granules
// the budget can not hold, evicts ahead of that growth (spareLocked): when the least
// recently used entry fits in the prompt's granules, holds every one of its granules
// alone (no other entry or live sequence maps them) and has no read-only bytes in its
// ranges (none mapped from elsewhere, none protected by a hit), it leaves the index
// whole and the new sequence takes over its ranges with their granules committed, so
// that the prefill commits nothing and no range is unmapped or reserved. It evicts up
// to that entry's granules beyond the shortfall, all of which the new sequence's
// prompt then fills.

// evictMode says which granules an eviction is after.
type evictMode uint8

const (
	// evictFree takes only granules whose eviction gives physical memory back: held
	// by one entry and mapped by no live sequence (page-aware eviction).
	evictFree evictMode = iota
	// evictCap takes granules that count in CachedBytes (held by one entry), those
	// that also give memory back first.
	evictCap
)

// evictFor evicts cached granules that give back physical memory, leaf-first and
// least recently used first, until need bytes came back or none is left to take; it
// returns the bytes that came back, and logs a summary (see observe.go). For a growth
// (evictForGrowth), an entry that only its write-through holds busy is waited for,
// least recently used first, and then evicted, as a write-back would copy on this path
// too: without it a growth would be refused while stores run (a reclaim for a waiter
// is repaid when they end instead: pcTiers.repay). No lock is held.
func (pc *PrefixCache) evictFor(need int64, why evictReason) int64 {
	if need <= 0 {
		return 0
	}
	pc.mu.Lock()
	mark := pc.evictMark()
	before := pc.evictedBytes
	for {
		drop := pc.evictLocked(need-(pc.evictedBytes-before), evictFree)
		var wait <-chan struct{}
		if why == evictForGrowth && pc.evictedBytes-before < need {
			wait = pc.storingVictim()
		}
		pc.mu.Unlock()
		for _, e := range drop {
			e.close()
		}
		if wait == nil {
			break
		}
		if f := pc.tiers.onStoringWait; f != nil {
			f()
		}
		<-wait
		pc.mu.Lock()
	}
	pc.mu.Lock()
	got := pc.evictedBytes - before
	done := pc.evictMark().minus(mark)
	pc.mu.Unlock()
	pc.logEviction(why, need, done)
	return got
}

// reclaim is the prefix cache's reclaimer (accounting.Authority.SetReclaimer): a
// request on the device started to wait for need bytes.
func (pc *PrefixCache) reclaim(need int64) {
	pc.mu.Lock()
	if hook := pc.reclaimed; hook != nil {
		defer hook()
	}
	if pc.closed {
		pc.mu.Unlock()
		return
	}
	pc.reclaiming.Add(1)
	pc.mu.Unlock()
	defer pc.reclaiming.Done()
	pc.tiers.owe(need - pc.evictFor(need, evictForWaiter))
}

// evictLocked evicts granules in mode until need bytes came back (evictFree) or
// CachedBytes fell by need (evictCap), or nothing is left to take. It returns the
// entries that left the index, for the caller to close once pc.mu is released. pc.mu
// is held.
func (pc *PrefixCache) evictLocked(need int64, mode evictMode) []*pcEntry {
	var drop []*pcEntry
	var got int64
	// took counts one step's eviction: freed bytes given back, gone an entry that
	// left the index, cached the CachedBytes before the step.
	took := func(freed int64, gone *pcEntry, cached int64) {
		if gone != nil {
			drop = append(drop, gone)
		}
		if mode == evictFree {
			got += freed
		} else {
			got += cached - pc.cachedBytes
		}
	}
	for got < need {
		cached := pc.cachedBytes
		if pc.c.multi {
			// Several groups: older window units first, then whole leaves (see
			// prefixcache_groups.go).
			freed, gone, ok := pc.evictGroupStep(mode, need-got)
			if !ok {
				break
			}
			took(freed, gone, cached)
			continue
		}
		leaf := pc.victim(true)
		if leaf == nil && mode == evictCap {
			leaf = pc.victim(false)
		}
		if leaf == nil {
			break
		}
		// Take as many granules from the leaf's tail as the need asks for in one
		// resize, as long as each gives memory back and the leaf keeps a token.
		e, p := leaf.Value(), leaf.Parent()
		k := 1
		// With tiers the leaf goes whole where it can, so that its blocks are
		// written down before its ranges close (see prefixcache_tier.go).
		for ; k < len(e.grefs) && (pc.tiers != nil || got+int64(k)*pc.gbytes < need); k++ {
			g := e.grefs[len(e.grefs)-1-k]
			if g.entries != 1 || g.live > 0 {
				break
			}
			if pc.c.tokensIn(len(e.grefs)-1-k) <= p.Depth() {
				// Taking this granule too leaves the leaf no token of its own: the
				// leaf goes whole, in one release rather than a shrink to one
				// granule and then that granule's own release.
				k = len(e.grefs)
				break
			}
		}
		freed, gone := pc.evictGranules(leaf, k)
		took(freed, gone, cached)
	}
	return drop
}

// victim returns the least recently used leaf whose last granule eviction can take:
// not pinned, not being mapped from, held by that entry alone and, when frees is set,
// mapped by no live sequence (so that evicting it gives the memory back). nil when
// there is none. pc.mu is held.
func (pc *PrefixCache) victim(frees bool) *radix.Node[*pcEntry] {
	return pc.victimOf(frees, nil)
}

// victimOf is victim among the leaves whose entries are in storing (a write-through
// runs), as if their write-through had ended; with storing nil, victim. pc.mu is held.
func (pc *PrefixCache) victimOf(frees bool, storing map[*pcEntry]chan struct{}) *radix.Node[*pcEntry] {
	var best *radix.Node[*pcEntry]
	pc.tree.EachLeaf(func(l *radix.Node[*pcEntry]) bool {
		e := l.Value()
		busy := e.busy
		if storing != nil {
			if storing[e] == nil {
				return true
			}
			busy-- // its write-through's
		}
		if l.Pinned() || busy > 0 || len(e.grefs) == 0 {
			return true
		}
		i := len(e.grefs) - 1
		g := e.grefs[i]
		if g.entries != 1 || frees && g.live > 0 {
			return true
		}
		// A pinned parent that would become the leaf may need granule i itself.
		if p := l.Parent(); p.Parent() != nil && p.Children() == 1 && pc.c.unitsFor(max(pc.c.tokensIn(i), p.Depth())) > i {
			return true
		}
		if best == nil || l.Used() < best.Used() {
			best = l
		}
		return true
	})
	return best
}

// evictGroupStep is one step of evictLocked on a cache of several groups, toward need
// bytes: the least recently used leaf whose entry holds older window units that give
// memory back (evictCap: that count in CachedBytes) gives them back (trimWindows);
// where none does, the least recently used leaf whose last units do gives those back
// (shrinkGroups), as evictGranules does on one group. NB: as on one group, a leaf
// whose last units do not give memory back (a live sequence maps them: a hit on the
// whole entry) is not taken, though units under them might: taking it whole would
// take its tokens out of the index for little memory, and it was what kept the
// Mooncake replay under a budget below its ideal. It returns the bytes that came
// back, the entry to close, if any, and false when nothing was left to take. pc.mu
// is held.
func (pc *PrefixCache) evictGroupStep(mode evictMode, need int64) (int64, *pcEntry, bool) {
	modes := []bool{true, false} // frees, then (evictCap) counts in CachedBytes
	if mode != evictCap {
		modes = modes[:1]
	}
	for _, frees := range modes {
		if leaf := pc.lruOf(func(l *radix.Node[*pcEntry]) bool { return pc.trimGain(l, frees) > 0 }); leaf != nil {
			freed, gone := pc.trimWindows(leaf, frees)
			return freed, gone, true
		}
	}
	for _, frees := range modes {
		// Recurrent groups: checkpoints below an entry's latest that no other holds
		// (see prefixcache_checkpoint.go).
		if leaf := pc.lruOf(func(l *radix.Node[*pcEntry]) bool { return pc.ckTrimGain(l, frees) > 0 }); leaf != nil {
			freed, held := pc.trimCheckpoints(leaf, frees)
			return freed, held, true
		}
	}
	for _, frees := range modes {
		if leaf := pc.lruOf(func(l *radix.Node[*pcEntry]) bool { return pc.tailFree(l, frees) }); leaf != nil {
			freed, gone := pc.shrinkGroups(leaf, need, frees)
			return freed, gone, true
		}
	}
	return 0, nil, false
}

// tailFree reports whether cutting leaf's entry unit boundary by unit boundary
// (cutTo) gives something back before it reaches a unit that may not go: held by the
// entry alone and, with frees, mapped by no live sequence; and not under a pin. NB: a
// cut may give nothing back (the units past it are a group's the entry does not hold:
// a window group's below its first, where the step at the entry's end reads none of
// its tokens); the cuts go on past it. pc.mu is held.
func (pc *PrefixCache) tailFree(leaf *radix.Node[*pcEntry], frees bool) bool {
	e := leaf.Value()
	if e.seq == nil || pinnedAbove(leaf) {
		return false
	}
	for n := e.n; n > 0; {
		nd := pc.cutTo(e, n)
		gain, ok := pc.cutGain(e, nd, n, frees)
		switch {
		case !ok:
			return false
		case gain > 0:
			return true
		}
		n = nd
	}
	return false
}

// cutTo returns the next unit boundary below n tokens of e's groups: the most tokens
// below n at which some group's last unit holds none.
func (pc *PrefixCache) cutTo(e *pcEntry, n int) int {
	nd := 0
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		if g.state > 0 {
			continue // no units: an entry holds checkpoints
		}
		if k := g.unitsFor(n); k > 0 {
			nd = max(nd, g.tokensIn(k-1))
		}
	}
	return nd
}

// cutGain returns the bytes that cutting e from n to nd tokens gives back (frees) or
// takes out of CachedBytes (0 where e holds no unit past nd), and false when one of
// the units past nd is not e's alone to give (another entry holds it or, with frees,
// a live sequence maps it). pc.mu is held.
func (pc *PrefixCache) cutGain(e *pcEntry, nd, n int, frees bool) (int64, bool) {
	var gain int64
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		sg := e.segs[gi]
		for u := max(g.unitsFor(nd), sg.from); u < min(g.unitsFor(n), sg.end()); u++ {
			if r := sg.refs[u-sg.from]; r.entries != 1 || frees && r.live > 0 {
				return 0, false
			}
			gain += pc.ubytes[gi]
		}
	}
	return gain, true
}

// shrinkGroups takes the last units of leaf's entry, on a cache of several groups:
// the entry is cut, unit boundary by unit boundary, until need bytes came back (with
// tiers: as far as it goes) or the next unit may not go (cutGain); with tiers, the
// whole tier blocks cut off are written down from a holder (pickCutGroups). When no
// token of its own would be left, or no hit could start on what is left (its windows
// no longer hold the window before its end),
// the leaf goes whole. It returns the bytes that came back and the entry to close, if
// any. pc.mu is held.
func (pc *PrefixCache) shrinkGroups(leaf *radix.Node[*pcEntry], need int64, frees bool) (int64, *pcEntry) {
	e, p, n := leaf.Value(), leaf.Parent(), leaf.Value().n
	nd, got := n, int64(0)
	// With tiers, as on one group, the leaf goes whole where every unit of its own
	// gives memory back, so that its blocks are written down before its ranges close.
	for (got < need || pc.tiers != nil) && nd > 0 {
		// NB: past cuts that give nothing back too (see tailFree).
		next := pc.cutTo(e, nd)
		gain, ok := pc.cutGain(e, next, nd, frees)
		if !ok {
			break
		}
		nd, got = next, got+gain
	}
	if pc.c.recurrent() && nd < n {
		// No hit starts past the latest checkpoint: cut to it.
		nd = pc.servedBy(e, nd)
	}
	if nd == n || nd <= p.Depth() || !pc.holdsWindow(e, nd) {
		return pc.evictLeaf(leaf)
	}
	es := e.seq
	cut := pc.tiers.pickCutGroups(e, leaf, nd)
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		if g.state > 0 {
			continue
		}
		if err := es.resizeList(g.ranges(es.bufs), max(g.extent(nd), es.bufs[g.first].Start())); err != nil {
			// NB: the entry leaves the index whole, its ranges as they are.
			pc.evictedTokens += int64(leaf.Depth() - p.Depth())
			pc.removeDamaged(e)
			freed, d := pc.evict(e)
			return cutOff(cut, freed, d)
		}
	}
	freed := pc.dropFrom(e, nd)
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		if g.state > 0 {
			continue
		}
		sg := &e.segs[gi]
		k := min(max(g.unitsFor(nd), sg.from), sg.end())
		for _, r := range sg.refs[k-sg.from:] {
			freed += pc.release(r)
		}
		pc.evictions += int64(sg.end() - k)
		sg.refs = sg.refs[:k-sg.from]
		f := es.frozenOf(gi)
		*f = min(*f, g.extent(nd))
	}
	pc.tree.Shorten(leaf, nd)
	pc.ev.cut(e, nd, false)
	pc.evictedTokens += int64(n - nd)
	pc.evictedBytes += freed
	e.n, es.n = nd, nd
	es.refreshStats()
	return cutOff(cut, freed, nil)
}

// lruOf returns the least recently used leaf, not mapped from now, for which ok
// holds, or nil. pc.mu is held.
func (pc *PrefixCache) lruOf(ok func(*radix.Node[*pcEntry]) bool) *radix.Node[*pcEntry] {
	var best *radix.Node[*pcEntry]
	pc.tree.EachLeaf(func(l *radix.Node[*pcEntry]) bool {
		if l.Value().busy == 0 && (best == nil || l.Used() < best.Used()) && ok(l) {
			best = l
		}
		return true
	})
	return best
}

// keepFrom returns the first unit of window group gi that e keeps when it gives back
// its older ones: those below the unit that holds FirstLive(e.n) (a hit on all of e
// needs none of them: the window rule), from its first on, as long as e alone holds each and, with
// frees, no live sequence maps it. pc.mu is held.
func (pc *PrefixCache) keepFrom(e *pcEntry, gi int, frees bool) int {
	g := &pc.c.groups[gi]
	sg := e.segs[gi]
	u := sg.from
	keep := e.n
	if pc.tiers != nil {
		// What the step at the end of its last whole tier block below its last
		// token reads too: the last block written down serves a lookup of the
		// entry's own tokens (whose last is never matched) only with it.
		keep = max(e.n-1, 0) / pc.tiers.bt * pc.tiers.bt
	}
	for end := min(g.dropOff(keep)/g.unit, sg.end()); u < end; u++ {
		if r := sg.refs[u-sg.from]; r.entries != 1 || frees && r.live > 0 {
			break
		}
	}
	return u
}

// trimGain returns the bytes that leaf's entry would give back by its older window
// units (keepFrom): 0 under a pin. pc.mu is held.
func (pc *PrefixCache) trimGain(leaf *radix.Node[*pcEntry], frees bool) int64 {
	e := leaf.Value()
	if e.seq == nil || pinnedAbove(leaf) {
		return 0
	}
	var gain int64
	for gi := range pc.c.groups {
		if pc.c.groups[gi].windowed() {
			gain += int64(pc.keepFrom(e, gi, frees)-e.segs[gi].from) * pc.ubytes[gi]
		}
	}
	return gain
}

// trimWindows gives back leaf's older window units (keepFrom) from its entry's ranges:
// the entry stays, for the hits whose windows it still holds. It returns the bytes
// that came back and, where the backing failed, the entry, out of the index, to
// close. pc.mu is held.
func (pc *PrefixCache) trimWindows(leaf *radix.Node[*pcEntry], frees bool) (int64, *pcEntry) {
	e := leaf.Value()
	es := e.seq
	var freed int64
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		if !g.windowed() {
			continue
		}
		sg := &e.segs[gi]
		to := pc.keepFrom(e, gi, frees)
		if to == sg.from {
			continue
		}
		for _, b := range g.ranges(es.bufs) {
			if err := b.DecommitBelow(to * g.unit); err != nil {
				es.err = err
				pc.evictedTokens += int64(leaf.Depth() - leaf.Parent().Depth())
				pc.removeDamaged(e)
				return pc.evict(e)
			}
		}
		for _, r := range sg.refs[:to-sg.from] {
			freed += pc.release(r)
		}
		pc.evictions += int64(to - sg.from)
		sg.refs, sg.from = sg.refs[to-sg.from:], to
		es.gs[gi].held = max(es.gs[gi].held, g.heldFrom(to*g.unit))
		pc.ev.from(e, gi, es.gs[gi].held)
	}
	es.refreshStats()
	pc.evictedBytes += freed
	return freed, nil
}

// pinnedAbove reports whether a pin ends at n or one of its ancestors: on a cache of
// several groups eviction takes no leaf there, since which of the pinned prefix's
// leaves holds its window groups' units is each leaf's own.
func pinnedAbove(n *radix.Node[*pcEntry]) bool {
	for ; n.Parent() != nil; n = n.Parent() {
		if n.Pinned() {
			return true
		}
	}
	return false
}

// spareLocked, on a miss for a prompt of tokens, evicts the least recently used entry
// whole and returns its sequence, whose ranges the new sequence then takes over with
// their committed granules, when the budget can not hold the prompt's granules now
// and that entry's granules all fit in them: the eviction a growth of the new
// sequence would otherwise make through a refusal, without unmapping the granules
// (and the range) only for the growth to commit as many again. It returns nil when
// the budget holds the prompt, or when that entry is not one whose ranges can be
// taken as they are: pinned or under a pin that would need it, mapped from, lazy,
// holding a granule another entry or a live sequence maps, or with bytes that are
// read-only in its ranges (shared in, or protected once). With tiers it also returns
// what of the entry to write down before the new sequence writes (see pcTiers.pick).
// pc.mu is held.
func (pc *PrefixCache) spareLocked(tokens int) (*Sequence, *tierWrite) {
	if tokens <= 0 || pc.c.multi {
		return nil, nil // several groups: their ranges are not taken over
	}
	need := int64(pc.c.unitsFor(tokens)) * pc.gbytes
	if be := pc.c.budget(need, 0); be == nil || errors.Is(be, accounting.ErrExceedsLimit) {
		return nil, nil
	}
	leaf := pc.victim(true)
	if leaf == nil {
		return nil, nil
	}
	e, p := leaf.Value(), leaf.Parent()
	es := e.seq
	switch {
	case es == nil || es.err != nil || es.guarded || es.bufs[0].Shared() != 0:
		return nil, nil
	case int64(len(e.grefs))*pc.gbytes > need:
		return nil, nil // more than the prompt takes: evicted by its tail, as the need asks
	case p.Parent() != nil && p.Children() == 1:
		return nil, nil // a pinned parent would become the leaf, needing the entry
	case es.bufs[0].Committed() != len(e.grefs)*pc.c.unit:
		return nil, nil
	}
	for _, g := range e.grefs {
		if g.entries != 1 || g.live > 0 {
			return nil, nil
		}
	}
	wb := pc.tiers.pick(e, leaf)
	pc.tree.Remove(leaf)
	pc.ev.cut(e, p.Depth(), true)
	pc.evictedTokens += int64(leaf.Depth() - p.Depth())
	pc.evictions += int64(len(e.grefs))
	pc.evict(e) // every granule comes back: counted in EvictedBytes
	e.seq, e.wb = nil, nil
	return es, wb
}

// capLocked evicts down to MaxBytes and returns the entries to close. pc.mu is held.
func (pc *PrefixCache) capLocked() []*pcEntry {
	if over := pc.cachedBytes - pc.opts.MaxBytes; pc.opts.MaxBytes > 0 && over > 0 {
		return pc.evictLocked(over, evictCap)
	}
	return nil
}

// storingVictim returns the channel of the least recently used entry's write-through
// among the leaves that eviction could take but for it (victim), nil when there is
// none. pc.mu is held.
func (pc *PrefixCache) storingVictim() <-chan struct{} {
	t := pc.tiers
	if t == nil || len(t.storing) == 0 {
		return nil
	}
	if pc.c.multi {
		return pc.storingVictimGroups()
	}
	if leaf := pc.victimOf(true, t.storing); leaf != nil {
		return t.storing[leaf.Value()]
	}
	return nil
}

// storingVictimGroups is storingVictim on a cache of several groups: the least
// recently used entry whose write-through runs and which an eviction step could take
// memory from but for it (evictGroupStep's steps that give memory back: older window
// units, older checkpoints, last units). pc.mu is held.
func (pc *PrefixCache) storingVictimGroups() <-chan struct{} {
	var best *pcEntry
	for e := range pc.tiers.storing {
		l := e.leaf
		if e.closed || e.busy != 1 || l == nil || l.Pinned() || l.Children() > 0 {
			continue // out of the index, or busy with more than its store
		}
		if pc.trimGain(l, true) == 0 && pc.ckTrimGain(l, true) == 0 && !pc.tailFree(l, true) {
			continue
		}
		if best == nil || l.Used() < best.leaf.Used() {
			best = e
		}
	}
	if best == nil {
		return nil
	}
	return pc.tiers.storing[best]
}

// ckTrimGain returns the bytes that leaf's entry would give back by its checkpoints
// below its latest that it alone holds (and, with frees, no live sequence): 0 under a
// pin. pc.mu is held.
func (pc *PrefixCache) ckTrimGain(leaf *radix.Node[*pcEntry], frees bool) int64 {
	e := leaf.Value()
	if len(e.ckpts) < 2 || pinnedAbove(leaf) {
		return 0
	}
	var gain int64
	for _, ck := range e.ckpts[:len(e.ckpts)-1] {
		if trimmable(ck, frees) {
			gain += ck.bytes
		}
	}
	return gain
}

// trimmable reports whether an entry may let ck go in an eviction step: it alone
// holds it, and, with frees, no live sequence does.
func trimmable(ck *checkpoint, frees bool) bool {
	return ck.entries == 1 && (!frees || ck.live == 0)
}

// trimCheckpoints lets leaf's entry's checkpoints below its latest go that ckTrimGain
// counts, and returns the bytes that came back; with tiers, also the holder from
// which the tier blocks ending at them go down with their states (pickTrim), as an
// entry to close, or nil. pc.mu is held.
func (pc *PrefixCache) trimCheckpoints(leaf *radix.Node[*pcEntry], frees bool) (int64, *pcEntry) {
	e := leaf.Value()
	last := len(e.ckpts) - 1
	var gone []*checkpoint
	kept := e.ckpts[:0]
	for i, ck := range e.ckpts {
		if i < last && trimmable(ck, frees) {
			gone = append(gone, ck)
		} else {
			kept = append(kept, ck)
		}
	}
	clear(e.ckpts[len(kept):])
	e.ckpts = kept
	held := pc.tiers.pickTrim(e, leaf, gone) // NB: before ckRef lets them go
	var freed int64
	for _, ck := range gone {
		freed += pc.ckRef(ck, -1, 0)
	}
	pc.evictions += int64(len(gone))
	pc.evictedBytes += freed
	return freed, held
}
