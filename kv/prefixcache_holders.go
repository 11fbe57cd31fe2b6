package kv

import (
	"errors"
	"slices"
	"sync"

	"github.com/vmarena/vmarena/internal/causes"
)

// Holders: the live sequences and prefixes that map a prefix cache's granules, and
// the prefix cache's side of the hooks by which the core tells it what they do.
//
// A live sequence is, to the prefix cache, in one of three states:
//
//  1. Plain: it maps no granule the prefix cache counts (pcl is nil).
//  2. Holder: it maps some (pcl.grefs, each counted in its granuleRef.live): a
//     lookup's hit, a fork or a frozen prefix of a holder, a sequence started on
//     such a prefix, or a sequence whose granules a fork or freeze shares while a
//     prefix cache exists (share counts them, by references no entry holds yet).
//  3. Origin: a lazy entry referred to its ranges once (pcl.origin, set by Insert):
//     a Holder whose calls that resize or protect its ranges hold its ranges lock
//     (pcl.mu), which a lookup mapping from those ranges holds too.
//
// Transitions: Plain → Holder (Lookup, share, inherit), Plain or Holder → Origin
// (Insert); any → closed (Sequence.Close: handOver, then drop). Origin is for good:
// the lock stays in use until the sequence closes. A Truncate drops the granules the
// sequence gave up from its holdings (dropPast), but leaves its state as it is.

// pcLive is what a live sequence (or a prefix) maps of the cache's granules: set by
// Lookup and Insert, passed on to forks, frozen prefixes and the sequences started on
// them (inherit), dropped by Sequence.Close and a prefix's last release. A sequence
// that shares granules the cache does not hold yet (Fork, Freeze) counts them too, by
// references no entry holds (share), so that an entry inserted afterwards sees every
// holder that maps them.
type pcLive struct {
	pc    *PrefixCache
	grefs []*granuleRef
	// segs is, on a cache of several groups, what it maps of each group (grefs is
	// nil there): a window group's from the unit its ranges start at.
	segs  []unitSeg
	entry *pcEntry // the last entry Insert made from the sequence, or nil (pc.mu)
	// lazy is the entries that refer to the sequence's ranges (pc.mu; see pcEntry).
	lazy []*pcEntry
	// origin: an entry referred to the sequence's ranges once. Read and written by the
	// sequence's owner only; from then on its calls that resize or protect its ranges
	// hold mu, which a lookup mapping from them holds too.
	origin bool
	lazyN  int // owner's too: at least the tokens of every lazy entry referring to it
	// ns is the namespace the sequence is bound to once bound (its first hit or
	// Insert: see Namespace), under pc.mu.
	ns    Namespace
	bound bool
	mu    sync.Mutex
	// protected is the bytes at the start of each range that lookups made read-only
	// in the sequence's own mapping (mu).
	protected int
	// ckpts is the checkpoints the sequence holds (it recorded them, or started on
	// them by a hit), ascending by tokens (pc.mu; see prefixcache_checkpoint.go).
	ckpts []*checkpoint
}

// protectFrom makes the first full bytes of each of s's ranges read-only in s's own
// mapping, where the backing can protect memory in place, before a lookup maps them
// into another sequence: an origin's stray write through Bytes or a View then faults
// rather than reach the sequences started on it. One call per range, for what earlier
// lookups did not protect yet. l.mu is held; on error nothing changed.
func (l *pcLive) protectFrom(s *Sequence, full int) error {
	if !s.c.protector || full <= l.protected {
		return nil
	}
	if err, rerr := readOnly(s.bufs, l.protected, full-l.protected); err != nil {
		return errors.Join(err, rerr)
	}
	l.protected = full
	return nil
}

// inherit returns what a fork or a frozen prefix that maps the first k sharing units
// of the ranges l belongs to (s's, or a prefix's when s is nil) maps of the cache's
// granules, counted as mapped by one more holder, or nil when it maps none: so that
// eviction does not count on them, nor a miss take over their entry's ranges, while
// the new holder lives. Only the owner of those ranges calls it.
func (l *pcLive) inherit(s *Sequence, k int) *pcLive {
	pc := l.pc
	pc.mu.Lock()
	defer pc.mu.Unlock()
	grefs := slices.Clone(l.grefs[:min(len(l.grefs), k)])
	if s != nil && len(grefs) == len(l.grefs) && len(grefs) < k {
		// s's granule past those it maps may be a lazy entry's partly filled tail.
		if g := pc.lazyTailAt(s, len(grefs)); g != nil {
			grefs = append(grefs, g)
		}
	}
	if len(grefs) == 0 {
		return nil
	}
	for _, g := range grefs {
		g.mapped()
	}
	return &pcLive{pc: pc, grefs: grefs}
}

// drop forgets what a closing holder mapped.
func (l *pcLive) drop() {
	l.pc.mu.Lock()
	l.unmapAll()
	l.pc.mu.Unlock()
}

// unmapAll counts every granule l refers to as mapped by one holder fewer and forgets
// them. pc.mu is held.
func (l *pcLive) unmapAll() {
	for _, g := range l.grefs {
		g.unmap()
	}
	l.grefs = nil
	for gi := range l.segs {
		l.trim(gi, 0, 0)
	}
	l.dropLive(-1)
}

// newLive returns an empty pcLive of pc: with a unitSeg per group on a cache of
// several groups.
func newLive(pc *PrefixCache) *pcLive {
	l := &pcLive{pc: pc}
	if pc.c.multi {
		l.segs = make([]unitSeg, len(pc.c.groups))
	}
	return l
}

// trim keeps of group gi's references those of units in [lo, hi), each one it drops
// counted as mapped by one holder fewer. pc.mu is held.
func (l *pcLive) trim(gi, lo, hi int) {
	sg := &l.segs[gi]
	lo, hi = max(lo, sg.from), min(hi, sg.end())
	if lo >= hi {
		for _, g := range sg.refs {
			g.unmap()
		}
		*sg = unitSeg{}
		return
	}
	for _, g := range sg.refs[:lo-sg.from] {
		g.unmap()
	}
	for _, g := range sg.refs[hi-sg.from:] {
		g.unmap()
	}
	sg.refs = sg.refs[lo-sg.from : hi-sg.from]
	sg.from = lo
}

// cover makes l refer to every unit of group gi in [lo, hi), where the sequence l
// belongs to holds them: a unit it refers to already keeps its reference, the others
// (the sequence's own) get new ones, counted as mapped by it. [lo, hi) must not be
// empty. pc.mu is held.
func (l *pcLive) cover(gi, lo, hi int) {
	sg := &l.segs[gi]
	if len(sg.refs) > 0 {
		lo, hi = min(lo, sg.from), max(hi, sg.end())
	}
	if lo == sg.from && hi == sg.end() {
		return
	}
	refs := make([]*granuleRef, hi-lo)
	fresh := make([]granuleRef, hi-lo-len(sg.refs)) // one allocation for the new ones
	for u := lo; u < hi; u++ {
		if u >= sg.from && u < sg.end() {
			refs[u-lo] = sg.refs[u-sg.from]
			continue
		}
		g := &fresh[0]
		fresh = fresh[1:]
		g.live, g.grp = 1, int32(gi)
		refs[u-lo] = g
	}
	*sg = unitSeg{from: lo, refs: refs}
}

// inheritSegs returns what a new holder of the first n tokens of the ranges l belongs
// to maps of the cache's granules (ForkAt's: a window group's from its dropOff(n) on,
// each group's first fulls[gi] bytes), counted as mapped by one more holder; nil when
// it maps none. It is inherit on a cache of several groups.
func (l *pcLive) inheritSegs(n int, fulls []int) *pcLive {
	pc := l.pc
	pc.mu.Lock()
	defer pc.mu.Unlock()
	out := newLive(pc)
	some := false
	for gi := range pc.c.groups {
		g := &pc.c.groups[gi]
		sg := l.segs[gi]
		lo, hi := max(g.dropOff(n)/g.unit, sg.from), min(fulls[gi]/g.unit, sg.end())
		if lo >= hi {
			continue
		}
		refs := slices.Clone(sg.slice(lo, hi))
		for _, r := range refs {
			r.mapped()
		}
		out.segs[gi] = unitSeg{from: lo, refs: refs}
		some = true
	}
	if !some {
		return nil
	}
	return out
}

// shareSegs is share on a cache of several groups: s's pcLive counts s's mapping of
// every unit a fork or a frozen prefix of its first n tokens is about to map (each
// group's first fulls[gi] bytes, a window group's from its dropOff(n) on). Only s's
// owner calls it, once s shares them.
func shareSegs(s *Sequence, n int, fulls []int) {
	pc := s.c.pc.Load()
	if s.pcl == nil {
		if pc == nil {
			return
		}
		s.pcl = newLive(pc)
	}
	l := s.pcl
	if l.pc != pc {
		return // a record of an earlier prefix cache, closed since: Insert refuses s
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	for gi := range s.c.groups {
		g := &s.c.groups[gi]
		if lo, hi := g.dropOff(n)/g.unit, fulls[gi]/g.unit; lo < hi {
			l.cover(gi, lo, hi)
		}
	}
}

// share readies s, whose first k sharing units a fork or a frozen prefix is about to
// map, for inherit: where c has a prefix cache, s's pcLive counts s's mapping of each of
// them, those the cache does not hold yet by references of their own. An entry that
// Insert makes later, from s or from the new holder, then holds those references, and
// so counts the holder as mapping its granules until the holder drops them: eviction
// does not count on them, nor a miss take over their entry's ranges. Only s's owner
// calls it, once s shares them.
func share(s *Sequence, k int) {
	if s.pcl == nil {
		pc := s.c.pc.Load()
		if pc == nil || k == 0 {
			return
		}
		s.pcl = &pcLive{pc: pc}
	}
	l := s.pcl
	pc := l.pc
	if pc != s.c.pc.Load() {
		return // a record of an earlier prefix cache, closed since: Insert refuses s
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if k <= len(l.grefs) {
		return
	}
	from := len(l.grefs)
	l.grefs = slices.Grow(l.grefs, k-from)
	fresh := make([]granuleRef, k-from) // one allocation for s's own granules
	for j := from; j < k; j++ {
		g := pc.lazyTailAt(s, j)
		if g != nil {
			// A lazy entry of s holds granule j as its partly filled tail: from now
			// on l.grefs counts s's mapping of it, as Insert does.
			pc.untail(s, g)
		} else {
			g = &fresh[j-from]
			g.live = 1
		}
		l.grefs = append(l.grefs, g)
	}
}

// dropPast forgets the cache's granules that s no longer maps (a Truncate gave them
// up: only those below s's frozen bytes are still the cache's), so that they count as
// mapped by no live sequence for eviction and PinnedBytes. Only s's owner calls it.
func (l *pcLive) dropPast(s *Sequence) {
	keep := s.frozen / s.c.unit
	l.pc.mu.Lock()
	if e := l.entry; e != nil && s.frozen < s.c.shareable(e.n) {
		// s gave up granules the entry maps, and may write their tokens anew: its
		// ranges can not stand for the entry's when it closes (see handOver), even
		// once a later fork or freeze shares them again.
		l.entry = nil
	}
	if keep < len(l.grefs) {
		for _, g := range l.grefs[keep:] {
			g.unmap()
		}
		l.grefs = l.grefs[:keep]
	}
	for gi := range l.segs {
		g := &s.c.groups[gi]
		l.trim(gi, 0, *s.frozenOf(gi)/g.unit)
	}
	l.pc.mu.Unlock()
}

// pcHooks is the prefix cache's side of prefixHooks: it finds what s (or p) maps of a
// prefix cache's granules in its pcLive, and does nothing where it has none.
type pcHooks struct{ c *Cache }

var _ prefixHooks = pcHooks{}

// lockRanges takes l.mu for an origin (a sequence a lazy entry referred to once),
// whose ranges a lookup may be mapping from.
func (pcHooks) lockRanges(s *Sequence) {
	if l := s.pcl; l != nil && l.origin {
		causes.Lock(&l.mu, causes.WaitPrefix)
	}
}

func (pcHooks) unlockRanges(s *Sequence) {
	if l := s.pcl; l != nil && l.origin {
		l.mu.Unlock()
	}
}

// truncating holds s's ranges' lock across the truncate: lazy entries that hold s's
// tokens from n on get ranges of their own before, and the entries, s's protection
// and s's count of the cache's granules follow what it gave up after.
func (h pcHooks) truncating(s *Sequence, n int, truncate func() (int, error)) error {
	l := s.pcl
	if l == nil {
		_, err := truncate()
		return err
	}
	h.lockRanges(s)
	defer h.unlockRanges(s)
	if n < l.lazyN {
		l.pc.materialize(s, n)
		l.lazyN = n
	}
	if l.origin {
		l.pc.tiers.truncating(l.pc, s, n) // evicted lazy entries' blocks it gives up
	}
	replaced, err := truncate()
	if replaced >= 0 {
		// Sharing unit replaced is now another: lazy entries of s that held it follow.
		l.replaced(s, replaced)
	}
	l.dropPast(s)
	l.protected = min(l.protected, s.frozen)
	l.truncatedTo(s.n)
	return err
}

// beforeWrite gives the lazy entries that hold s's tokens from t on ranges of their
// own, under s's ranges' lock.
func (h pcHooks) beforeWrite(s *Sequence, t int) {
	if l := s.pcl; l != nil && t < l.lazyN {
		causes.Lock(&l.mu, causes.WaitPrefix)
		defer l.mu.Unlock()
		l.pc.materialize(s, t)
		l.lazyN = t
	}
}

func (pcHooks) forked(s *Sequence, n int, fulls []int, child *Sequence, pr *Prefix) {
	var l *pcLive
	if s.c.multi {
		shareSegs(s, n, fulls)
		if s.pcl == nil {
			return
		}
		l = s.pcl.inheritSegs(n, fulls)
	} else {
		k := fulls[0] / s.c.unit
		share(s, k)
		if s.pcl == nil {
			return
		}
		l = s.pcl.inherit(s, k)
	}
	if child != nil {
		child.pcl = l
	} else {
		pr.pcl = l
	}
}

func (pcHooks) startedOn(s *Sequence, p *Prefix, fulls []int) {
	switch {
	case p.pcl == nil:
	case s.c.multi:
		s.pcl = p.pcl.inheritSegs(p.tokens, fulls)
	default:
		s.pcl = p.pcl.inherit(nil, fulls[0]/s.c.unit)
	}
}

// windowGaveBack forgets the units below each window group's ranges' Start that s maps of
// the cache's granules: the window gave them back, so s no longer maps them.
func (pcHooks) windowGaveBack(s *Sequence) {
	l := s.pcl
	if l == nil || l.segs == nil {
		return
	}
	l.pc.mu.Lock()
	for gi := range s.c.groups {
		if g := &s.c.groups[gi]; g.windowed() {
			l.trim(gi, s.bufs[g.first].Start()/g.unit, l.segs[gi].end())
		}
	}
	l.pc.mu.Unlock()
}

func (pcHooks) closing(s *Sequence) ([]buffer, bool) {
	if s.pcl == nil {
		return nil, false
	}
	return s.pcl.handOver(s)
}

func (pcHooks) closed(s *Sequence) {
	if s.pcl != nil {
		s.pcl.drop()
		s.pcl = nil
	}
}

func (pcHooks) released(p *Prefix) {
	if p.pcl != nil {
		p.pcl.drop()
	}
}

func (h pcHooks) shortfall(need int64) int64 {
	if pc := h.c.pc.Load(); pc != nil {
		return pc.evictFor(need, evictForGrowth)
	}
	return 0
}

func (h pcHooks) evictable() int64 {
	if pc := h.c.pc.Load(); pc != nil {
		return pc.evictable()
	}
	return 0
}

// dropLive lets l's checkpoints past n go (a sequence that truncated or closed).
// pc.mu is held.
func (l *pcLive) dropLive(n int) {
	_, i := latest(l.ckpts, n)
	for _, ck := range l.ckpts[i+1:] {
		l.pc.ckRef(ck, 0, -1)
	}
	clear(l.ckpts[i+1:])
	l.ckpts = l.ckpts[:i+1]
}

// truncatedTo lets the checkpoints of s past its n tokens go, after a Truncate.
func (l *pcLive) truncatedTo(n int) {
	if len(l.ckpts) == 0 || l.ckpts[len(l.ckpts)-1].n <= n {
		return
	}
	l.pc.mu.Lock()
	l.dropLive(n)
	l.pc.mu.Unlock()
}
