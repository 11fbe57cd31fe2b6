package kv

import (
	"context"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/radix"
)

// The index of a PrefixCache: its entries and the counts of the granules they hold.
// This file and the eviction that shortens entries (prefixcache_evict.go) are the only
// code that changes the index's tree and counts; the others ask them.
//
// An entry (pcEntry) is in one of four states, named by entryState; its fields say
// which (state):
//
//  1. Lazy: in the index, with no ranges of its own: its tokens are the granules of
//     the sequence it was inserted from (origin), which keeps writing past them.
//  2. Owned: in the index, holding ranges of its own (seq): whole granules mapped,
//     the tail copied, or the origin's ranges taken over as it closed.
//  3. Draining: out of the index while lookups still map from it (busy > 0); the
//     last of them closes it.
//  4. Out: out of the index, its granules released from the counts; its ranges, if
//     it had any, closed or handed to a new sequence (spareLocked).
//
// Transitions:
//
//   - Insert makes a Lazy entry (add).
//   - Lazy → Owned: its origin closes and the entry takes over its ranges (handOver),
//     or the origin is about to change its tokens and the entry gets ranges of its
//     own first (materialize).
//   - Lazy, Owned → Out: eviction takes its last granule (evictGranules), a longer
//     entry displaces it (add, by unhold), its origin can not keep its tokens
//     (detach), a miss takes its ranges over (spareLocked), Close.
//   - Lazy, Owned → Draining: as → Out, while a lookup maps from it; Draining → Out
//     when the last of those lookups ends (Lookup closes it).
//
// A granule index (granuleRef) counts the entries that hold it and the live
// sequences and prefixes that map it (holders: see prefixcache_holders.go), forks and
// frozen prefixes made before the insert too, where the PrefixCache existed when they
// were made. NB: one made earlier is not counted, and eviction may count its granules
// as memory it gives back. Both counts change only through ref, which panics with
// panicRefCount below zero.
//
// The tree is a radix tree of token IDs, not vLLM's chain of block hashes: a match is
// exact to the token (the partial tail is copied anyway, so there is nothing to gain
// from rounding to blocks), equal keys are equal tokens by construction (no hash whose
// collisions would map another prompt's K/V), and a lookup compares tokens once where
// the hash chain hashes them and then compares them too (docs/benchmarks/prefix-cache.md
// has the figures). The index lives in package kv, not beside it, because eviction
// shrinks the cache's own sequences without the copy Truncate makes and runs inside
// the cache's budget check, and because a closing sequence hands its ranges to its
// entry.

// granuleRef is one sharing unit's physical memory in one layer group (a granule, or
// a block, in each of the group's ranges; in a one-group cache, in each of a
// sequence's ranges): the entries that hold it and the live sequences that map it.
// The prefix cache's lock guards it.
type granuleRef struct {
	entries int32
	live    int32
	grp     int32 // the index of its layer group (0 in a one-group cache)
}

// unitSeg is a holder's references to one layer group's sharing units [from, end())
// on a cache of several groups (pcEntry.segs, pcLive.segs): a window group's units
// below from are not held (given back by a window, or never mapped).
type unitSeg struct {
	from int
	refs []*granuleRef
}

// end returns the first unit past the ones sg refers to.
func (sg unitSeg) end() int { return sg.from + len(sg.refs) }

// slice returns the references to units [lo, hi), which sg must cover.
func (sg unitSeg) slice(lo, hi int) []*granuleRef { return sg.refs[lo-sg.from : hi-sg.from] }

// ref adds d to the count n and returns it, panicking with panicRefCount when the
// count would go below zero: a count that went wrong would free memory something
// still maps.
func ref(n *int32, d int32) int32 {
	if *n+d < 0 {
		panic(panicRefCount)
	}
	*n += d
	return *n
}

// mapped counts g mapped by one more live holder. pc.mu is held.
func (g *granuleRef) mapped() { ref(&g.live, 1) }

// unmap counts g mapped by one live holder fewer. pc.mu is held.
func (g *granuleRef) unmap() { ref(&g.live, -1) }

// entryState names the states of an entry (see above).
type entryState uint8

const (
	entryLazy entryState = iota
	entryOwned
	entryDraining
	entryOut
)

func (st entryState) String() string {
	return [...]string{"lazy", "owned", "draining", "out"}[st]
}

// pcEntry is an entry of the cache: a sequence the cache owns, holding the tokens of
// the index path that ends at leaf. Its state (Lazy, Owned, Draining, Out) is told by
// its fields: see state.
type pcEntry struct {
	seq    *Sequence     // Owned: its own ranges; else nil
	origin *Sequence     // Lazy: the sequence whose ranges hold its tokens; else nil
	ol     *pcLive       // origin's pcLive (its lock outlives origin.pcl)
	n      int           // tokens
	grefs  []*granuleRef // one per granule index it holds (one group)
	segs   []unitSeg     // on a cache of several groups, per group, in place of grefs
	tail   *granuleRef   // Lazy: its last gref, for origin's partly filled granule, or nil
	busy   int           // lookups mapping from it without the lock
	leaf   *radix.Node[*pcEntry]
	ns     Namespace // the namespace it was inserted in
	closed bool      // out of the index: Draining or Out
	// evID is its inserted path's id in the events (pcEvents), 0 without.
	evID uint64
	// wb is what eviction picked to write down into the tiers before the entry's
	// ranges close, or nil.
	wb *tierWrite
	// hits is the lookups that mapped from it (the reuse threshold's count);
	// stored the blocks from the first that a write-through stored already.
	hits   int64
	stored int
	// then is another entry to close after this one, or nil.
	then *pcEntry
	// ckpts is, on a model with recurrent groups, the checkpoints it holds, ascending
	// by tokens (see prefixcache_checkpoint.go).
	ckpts []*checkpoint
}

// state returns the entry's state. pc.mu is held.
func (e *pcEntry) state() entryState {
	switch {
	case e.closed && e.busy > 0:
		return entryDraining
	case e.closed:
		return entryOut
	case e.seq != nil:
		return entryOwned
	}
	return entryLazy
}

// refs returns how many granule references e holds.
func (e *pcEntry) refs() int {
	n := len(e.grefs)
	for _, sg := range e.segs {
		n += len(sg.refs)
	}
	return n
}

// close closes the entry's own ranges, if it has any (a lazy entry has none), after
// writing down into the tiers the blocks eviction picked (pick): no lock is held, and
// the granules come back only once their copies are done.
func (e *pcEntry) close() { e.closeCtx(context.Background()) }

// closeCtx is close with the write-down bounded by ctx too; it returns the ranges'
// release.
func (e *pcEntry) closeCtx(ctx context.Context) accounting.ReleaseOutcome {
	var out accounting.ReleaseOutcome
	if e.seq != nil {
		if wb := e.wb; wb != nil {
			e.wb = nil
			wb.t.writeDown(ctx, e.seq, wb)
		}
		out = e.seq.closeEntry()
	}
	if e.then != nil {
		e.then.closeCtx(ctx)
	}
	return out
}

// detach takes a lazy entry whose origin can not keep its tokens out of the index,
// with the tokens only it holds. It returns what to close. pc.mu is held.
func (pc *PrefixCache) detach(e *pcEntry) []*pcEntry {
	pc.evictedTokens += int64(e.leaf.Depth() - e.leaf.Parent().Depth())
	pc.removeDamaged(e)
	if _, d := pc.evict(e); d != nil {
		return []*pcEntry{d}
	}
	return nil
}

// hold counts g held by one more entry. pc.mu is held.
func (pc *PrefixCache) hold(g *granuleRef) {
	if ref(&g.entries, 1) == 1 {
		pc.cachedBytes += pc.ubytes[g.grp]
	}
}

// release counts g held by one entry fewer and returns the bytes that came back (0
// while a live sequence or another entry maps it). pc.mu is held.
func (pc *PrefixCache) release(g *granuleRef) int64 {
	if ref(&g.entries, -1) > 0 {
		return 0
	}
	pc.cachedBytes -= pc.ubytes[g.grp]
	if g.live > 0 {
		return 0
	}
	return pc.ubytes[g.grp]
}

// unhold drops every granule e holds from the counts and marks it out of the index.
// It returns the physical bytes that came back (granules no other entry or live
// sequence maps), which an eviction counts in EvictedBytes and a displacement by a
// longer entry does not, and e for the caller to close once pc.mu is released, or nil
// when a lookup maps from it now (that lookup closes it). pc.mu is held.
func (pc *PrefixCache) unhold(e *pcEntry) (int64, *pcEntry) {
	var freed int64
	for _, g := range e.grefs {
		freed += pc.release(g)
	}
	for _, sg := range e.segs {
		for _, g := range sg.refs {
			freed += pc.release(g)
		}
	}
	for _, ck := range e.ckpts {
		freed += pc.ckRef(ck, -1, 0)
	}
	e.grefs, e.segs, e.ckpts = nil, nil, nil
	e.closed = true
	e.origin, e.tail = nil, nil // a lazy entry refers to nothing from now on
	pc.entries--
	if invariants.Enabled {
		pc.checkCountsLocked()
	}
	if e.busy > 0 {
		return freed, nil
	}
	return freed, e
}

// evict is unhold for an entry that eviction takes out of the index: what comes back
// counts in EvictedBytes. pc.mu is held.
func (pc *PrefixCache) evict(e *pcEntry) (int64, *pcEntry) {
	freed, d := pc.unhold(e)
	pc.evictedBytes += freed
	return freed, d
}

// evictGranules takes the last k granule indexes of leaf's entry: the leaf is
// shortened to the tokens below them, or, when none of its own would be left, leaves
// the index (its entry closes, or moves up to a pinned parent). It returns the
// physical bytes that came back and the entry to close, if any. pc.mu is held.
func (pc *PrefixCache) evictGranules(leaf *radix.Node[*pcEntry], k int) (int64, *pcEntry) {
	e := leaf.Value()
	depth := leaf.Depth()
	p := leaf.Parent()
	nd := pc.c.tokensIn(len(e.grefs) - k)
	switch {
	case nd > p.Depth():
		cut := pc.tiers.pickCut(e, leaf, nd)
		pc.tree.Shorten(leaf, nd)
		pc.ev.cut(e, nd, false)
		freed, d := pc.shrink(e, depth, nd)
		return cutOff(cut, freed, d)
	case p.Parent() == nil || p.Children() > 1:
		return pc.evictLeaf(leaf)
	default:
		// The parent is pinned and this is its only child: it becomes the leaf.
		cut := pc.tiers.pickCut(e, leaf, p.Depth())
		pc.tree.Remove(leaf)
		pc.tree.SetValue(p, e)
		e.leaf = p
		pc.ev.cut(e, p.Depth(), false)
		freed, d := pc.shrink(e, depth, p.Depth())
		return cutOff(cut, freed, d)
	}
}

// evictLeaf takes leaf, whose parent is the root or has other children, out of the
// index with every granule its entry holds. It returns the physical bytes that came
// back and the entry to close, if any. pc.mu is held.
func (pc *PrefixCache) evictLeaf(leaf *radix.Node[*pcEntry]) (int64, *pcEntry) {
	e, p, depth := leaf.Value(), leaf.Parent(), leaf.Depth()
	pc.tiers.pick(e, leaf)
	pc.tree.Remove(leaf)
	pc.ev.cut(e, p.Depth(), true)
	pc.evictedTokens += int64(depth - p.Depth())
	pc.evictions += int64(e.refs() + len(e.ckpts))
	return pc.evict(e)
}

// cutOff returns what a shrink returns, with cut (the holder of the blocks it cut
// off, for the tiers) to close as well: before the entry when the shrink dropped it
// whole, its holder's blocks unwritten then (the entry's ranges failed).
func cutOff(cut *pcEntry, freed int64, d *pcEntry) (int64, *pcEntry) {
	switch {
	case cut == nil:
		return freed, d
	case d != nil:
		cut.wb.dropped = true // closed unwritten, its holds let go (writeDown)
		cut.then = d
	}
	return freed, cut
}

// shrink cuts e's sequence from depth to n tokens, giving back the granules wholly
// past them (no copy: an entry is never written). A failed resize drops the whole
// entry instead, for the caller to close. pc.mu is held.
func (pc *PrefixCache) shrink(e *pcEntry, depth, n int) (int64, *pcEntry) {
	k := pc.c.unitsFor(n)
	if e.seq == nil {
		// Lazy: its origin maps what it gives up, so only the counts change.
		e.n = n
	} else if err := e.seq.resizeAll(pc.c.extent(n)); err != nil {
		// NB: resizeAll changed nothing, or damaged the sequence; either way the
		// entry leaves the index whole.
		pc.evictedTokens += int64(e.leaf.Depth() - e.leaf.Parent().Depth())
		pc.removeDamaged(e)
		return pc.evict(e)
	}
	if e.seq != nil {
		e.n, e.seq.n = n, n
		e.seq.frozen = min(e.seq.frozen, pc.c.extent(n))
		e.seq.refreshStats()
	}
	pc.evictions += int64(len(e.grefs) - k)
	var freed int64
	for _, g := range e.grefs[k:] {
		freed += pc.release(g)
	}
	if k < len(e.grefs) {
		e.tail = nil // gone with the granules past k
	}
	e.grefs = e.grefs[:k]
	pc.evictedTokens += int64(depth - n)
	pc.evictedBytes += freed
	return freed, nil
}

// removeDamaged takes e's leaf out of the index, with the tokens only it holds. pc.mu
// is held.
func (pc *PrefixCache) removeDamaged(e *pcEntry) {
	p := pc.tree.Remove(e.leaf)
	for p.Leaf() {
		// A pinned parent left without a child has no entry: it goes too, and its
		// pins with it (they pin nothing now).
		p = pc.tree.Remove(p)
	}
	pc.ev.cut(e, p.Depth(), true)
}

// ckRef adds de to the entries and dl to the live sequences that hold ck, moves its
// bytes between the counts of its states (see above) and, when nothing holds it any
// more, closes its ranges. It returns the bytes that came back so. pc.mu is held.
func (pc *PrefixCache) ckRef(ck *checkpoint, de, dl int32) int64 {
	wasCached, wasPending := ck.entries > 0, ck.entries == 0 && ck.live > 0
	ref(&ck.entries, de)
	ref(&ck.live, dl)
	cached, pending := ck.entries > 0, ck.entries == 0 && ck.live > 0
	if wasCached != cached {
		d := ck.bytes
		if !cached {
			d = -d
		}
		pc.cachedBytes += d
		pc.ckBytes += d
		if cached {
			pc.ckCount++
		} else {
			pc.ckCount--
		}
	}
	if wasPending != pending {
		if pending {
			pc.ckPending += ck.bytes
		} else {
			pc.ckPending -= ck.bytes
		}
	}
	if cached || pending || ck.bufs == nil {
		return 0
	}
	if ck.writes == 0 {
		// NB: what can not be given back now the cache keeps, and retries on Close.
		pc.c.release(ck.bufs)
		ck.bufs = nil
	}
	// NB: else a write-down still reads it; its ranges close as the last ends
	// (ckUnwrite), and its bytes count as given back now, as a holder's granules do.
	return ck.bytes
}

// latest returns the last of cks (ascending by n) at or below n, and its index, or
// nil and -1.
func latest(cks []*checkpoint, n int) (*checkpoint, int) {
	for i := len(cks) - 1; i >= 0; i-- {
		if cks[i].n <= n {
			return cks[i], i
		}
	}
	return nil, -1
}
