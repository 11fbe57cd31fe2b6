package kv

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/nocopy"
	"github.com/vmarena/vmarena/internal/radix"
)

// PrefixCacheOptions configures a PrefixCache.
type PrefixCacheOptions struct {
	// MaxBytes caps the physical bytes the cache's entries hold (CachedBytes); 0 means
	// no cap other than the governor's budget, which takes cached prefixes back when
	// it runs short.
	MaxBytes int64
	// Events, when it has an observer, is told the blocks the cache caches and
	// evicts (see events.go).
	Events EventOptions
}

// PrefixCache reuses K and V across requests by token IDs (automatic prefix caching).
// A server passes each prompt's token IDs to Lookup, which starts a sequence on the
// longest prefix the cache holds; after prefill (and, optionally, after decoding) it
// passes the sequence to Insert, so that later prompts can start on its tokens.
//
// An entry of the cache is a sequence the cache owns, holding one path of the index
// from its first token: whole granules mapped from the sequence that was inserted, the
// partly filled last granule copied. A prefix's physical granules are owned once
// however many entries and live sequences map them. The cache's memory is the
// governor's to take back: see the package doc's "Prefix caching".
//
// Its zero value is not usable; call NewPrefixCache.
type PrefixCache struct {
	_ nocopy.NoCopy

	c      *Cache
	opts   PrefixCacheOptions
	gbytes int64                 // physical bytes of one granule index: a granule in each range
	auth   *accounting.Authority // a ledger of its own, owning nothing, for the reclaimer
	ev     *pcEvents             // nil without an observer; guarded by mu

	mu     sync.Mutex
	tree   *radix.Tree[*pcEntry]
	closed bool
	// reclaimers, lookups and inserts running: Close waits for them.
	reclaiming sync.WaitGroup
	working    sync.WaitGroup
	// guarded by mu
	cachedGranules int64 // distinct granule indexes held by entries
	queries, hits  int64
	inserted       int64
	evictedTokens  int64
	evictedBytes   int64
	evictions      int64
	entries        int
}

// granuleRef is one granule index's physical memory (a granule in each of a sequence's
// ranges): the entries that hold it and the live sequences that map it. The cache's
// lock guards it.
type granuleRef struct {
	entries int32
	live    int32
}

// pcEntry is an entry of the cache: a sequence the cache owns, holding the tokens of
// the index path that ends at leaf.
//
// An entry starts lazy: Insert only records it, and its granules are those of the
// inserted sequence (origin), which keeps mapping them read-write. It gets ranges of
// its own only when the origin closes (it takes the origin's over: no system call) or
// when the origin is about to change what it cached (Truncate below it, WriteToken
// into its tail: it then maps the whole granules and copies the tail, as Insert did
// before it was lazy). A cache that is never hit so costs no more than bookkeeping.
type pcEntry struct {
	seq    *Sequence     // its own ranges, or nil while lazy
	origin *Sequence     // while lazy: the sequence whose ranges hold its tokens
	ol     *pcLive       // origin's pcLive (its lock outlives origin.pcl)
	n      int           // tokens
	grefs  []*granuleRef // one per granule index it holds
	tail   *granuleRef   // while lazy: its last gref, for origin's partly filled granule, or nil
	busy   int           // lookups mapping from it without the lock
	leaf   *radix.Node[*pcEntry]
	closed bool // out of the index; closed by the last lookup mapping from it
}

// close closes the entry's own ranges, if it has any (a lazy entry has none).
func (e *pcEntry) close() {
	if e.seq != nil {
		e.seq.closeEntry()
	}
}

// pcLive is what a live sequence (or a prefix) maps of the cache's granules: set by
// Lookup and Insert, passed on to forks, frozen prefixes and the sequences started on
// them (inherit), dropped by Sequence.Close and a prefix's last release. A sequence
// that shares granules the cache does not hold yet (Fork, Freeze) counts them too, by
// references no entry holds (sharing), so that an entry inserted afterwards sees every
// holder that maps them.
type pcLive struct {
	pc    *PrefixCache
	grefs []*granuleRef
	entry *pcEntry // the last entry Insert made from the sequence, or nil (pc.mu)
	// lazy is the entries that refer to the sequence's ranges (pc.mu; see pcEntry).
	lazy []*pcEntry
	// origin: an entry referred to the sequence's ranges once. Read and written by the
	// sequence's owner only; from then on its calls that resize or protect its ranges
	// hold mu, which a lookup mapping from them holds too.
	origin bool
	lazyN  int // owner's too: at least the tokens of every lazy entry referring to it
	mu     sync.Mutex
	// protected is the bytes at the start of each range that lookups made read-only
	// in the sequence's own mapping (mu).
	protected int
}

// PrefixCacheStats is a snapshot of a PrefixCache. Counters are in tokens where their
// names say so; where a meaning matches vLLM's metric of the same name (queries,
// hits), it is the same.
type PrefixCacheStats struct {
	Queries int64 // prefix_cache_queries: prompt tokens passed to Lookup
	Hits    int64 // prefix_cache_hits: of which found cached
	// InsertedTokens is the tokens Insert added to the index.
	InsertedTokens int64
	// EvictedTokens is the tokens eviction took out of the index; Evictions the
	// granule indexes it dropped from entries, EvictedBytes the physical bytes that
	// came back by it (granules no live sequence still mapped), to the pool or to a
	// new sequence that took over an evicted entry's ranges.
	EvictedTokens int64
	Evictions     int64
	EvictedBytes  int64
	Entries       int   // cached sequences: leaves of the index
	CachedTokens  int64 // tokens the index holds, each shared prefix once
	// CachedBytes is the physical bytes the entries hold, every granule once however
	// many entries and sequences map it.
	CachedBytes int64
	// PinnedBytes is the part of CachedBytes eviction can not take now: under a pin
	// or mapped by a live sequence.
	PinnedBytes int64
}

// HitRate returns Hits over Queries (0 before any query).
func (s PrefixCacheStats) HitRate() float64 {
	if s.Queries == 0 {
		return 0
	}
	return float64(s.Hits) / float64(s.Queries)
}

// NewPrefixCache returns an empty prefix cache over c, registered with the governor
// so that a request on c's device that waits for memory first takes back cached
// prefixes no live sequence maps, and so that c's own growth does so before it is
// refused. c's backing must share memory (host.Shared, cuda), else the error matches
// ErrNoSharing; a cache has at most one PrefixCache. It MUST be closed before c.
func NewPrefixCache(c *Cache, opts PrefixCacheOptions) (*PrefixCache, error) {
	if c == nil {
		return nil, fmt.Errorf("%w: nil cache", ErrConfig)
	}
	if !c.sharer {
		return nil, fmt.Errorf("%w: a prefix cache maps cached prefixes into sequences", ErrNoSharing)
	}
	if opts.MaxBytes < 0 {
		return nil, fmt.Errorf("%w: MaxBytes %d", ErrConfig, opts.MaxBytes)
	}
	ev, err := newEvents(c, opts.Events)
	if err != nil {
		return nil, err
	}
	pc := &PrefixCache{
		c: c, opts: opts, gbytes: int64(c.nbuf) * int64(c.unit),
		tree: radix.New[*pcEntry](), ev: ev,
	}
	c.mu.Lock()
	switch {
	case c.closed:
		c.mu.Unlock()
		return nil, ErrClosed
	case c.pc.Load() != nil:
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: the cache has a prefix cache already", ErrConfig)
	}
	c.pc.Store(pc)
	c.mu.Unlock()
	pc.auth = c.gov.Authority("kv prefix cache", c.dev)
	pc.auth.SetReclaimer(pc.reclaim)
	return pc, nil
}

// Lookup returns a sequence that starts on the longest prefix of tokens the cache
// holds, and that prefix's length: its whole granules are mapped from the cache, the
// tokens past the last whole granule copied, as NewSequenceFrom does. The last token
// is never matched (a server computes it again for its logits), so the match is at
// most len(tokens)-1; with no match the sequence is empty. The caller appends and
// writes the rest of the prompt from there. It counts len(tokens) queries and the
// match as hits: Lookup is the admission of a request, called once per request
// admitted, so that Stats' hit rate is the admitted requests' (a scheduler that
// may not admit asks Match, Need and Cache.Headroom first, which count nothing).
// When the copied tail can not be had within the budget, cached
// prefixes are evicted first; if still refused, the error matches
// accounting.ErrBudgetExceeded and nothing changed. On a miss that the budget can not
// hold the prompt's granules for, the least recently used entry may leave the index
// whole and hand its ranges to the new sequence, their granules still committed
// (Len is 0; the first growths up to them commit nothing): the eviction the prompt's
// growth would make, without unmapping and mapping as many granules again (see the
// package doc's "Prefix caching"). The sequence MUST be closed.
func (pc *PrefixCache) Lookup(tokens []int32) (*Sequence, int, error) {
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return nil, 0, ErrClosed
	}
	pc.working.Add(1)
	defer pc.working.Done()
	m, node := pc.tree.Match(tokens[:pc.matchable(tokens)])
	var e *pcEntry
	// The granules the new sequence will map count as mapped by a live sequence from
	// now on, so that eviction does not count on them.
	var l *pcLive
	var spare *Sequence // on a miss, an evicted entry's ranges for the new sequence
	var spared evictTally
	if m == 0 {
		mark := pc.evictMark()
		spare = pc.spareLocked(min(len(tokens), pc.c.cfg.MaxTokens))
		spared = pc.evictMark().minus(mark)
	} else {
		l = &pcLive{pc: pc}
		leaf := pc.tree.Cover(node)
		pc.tree.Touch(leaf)
		e = leaf.Value()
		e.busy++
		l.grefs = append(l.grefs, e.grefs[:pc.c.fullUnits(m)]...)
		for _, g := range l.grefs {
			g.live++
		}
	}
	var ol *pcLive
	if e != nil && e.origin != nil {
		// A lazy entry: map from its origin's ranges under their lock, unless the
		// origin handed them over (or dropped the entry) meanwhile.
		ol = e.ol
		pc.mu.Unlock()
		ol.mu.Lock()
		pc.mu.Lock()
		if e.origin == nil {
			ol.mu.Unlock()
			ol = nil
		}
	}
	src := (*Sequence)(nil)
	switch {
	case ol != nil:
		src = e.origin
	case e != nil:
		src = e.seq // nil when the entry left the index with its origin's ranges
	}
	pc.mu.Unlock()

	var s *Sequence
	var err error
	switch {
	case spare != nil:
		s = pc.c.reuse(spare)
		pc.logEviction(evictForGrowth, spared.bytes, spared)
	case e == nil:
		s, err = pc.c.NewSequence()
	case src == nil:
		// The entry is gone with nothing to map from: a miss after all.
		err = errEntryGone
	case ol != nil:
		if err = ol.protectFrom(src, pc.c.fullUnits(m)*pc.c.unit); err == nil {
			s, err = pc.startOn(src, m, true)
		}
		ol.mu.Unlock()
	default:
		s, err = pc.startOn(src, m, true)
	}

	pc.mu.Lock()
	var drop []*pcEntry
	if e != nil {
		e.busy--
		if e.busy == 0 && e.closed {
			// It left the index while this lookup mapped from it.
			drop = append(drop, e)
		}
	}
	if err != nil {
		if l != nil {
			for _, g := range l.grefs {
				g.live--
			}
		}
	} else {
		if l != nil {
			s.pcl = l
		}
		pc.queries += int64(len(tokens))
		pc.hits += int64(m)
	}
	// An insert may have gone over MaxBytes while this lookup held its entry.
	drop = append(drop, pc.capLocked()...)
	pc.mu.Unlock()
	for _, d := range drop {
		d.close()
	}
	if errors.Is(err, errEntryGone) {
		return pc.Lookup(tokens)
	}
	if err != nil {
		return nil, 0, err
	}
	return s, m, nil
}

// errEntryGone: the entry a lookup matched left the index, with nothing to map from,
// before the lookup could map from it; the lookup starts again.
var errEntryGone = errors.New("kv: prefix cache entry gone")

// protectFrom makes the first full bytes of each of s's ranges read-only in s's own
// mapping, where the backing can protect memory in place, before a lookup maps them
// into another sequence: an origin's stray write through Bytes or a View then faults
// rather than reach the sequences started on it. One call per range, for what earlier
// lookups did not protect yet. l.mu is held; on error nothing changed.
func (l *pcLive) protectFrom(s *Sequence, full int) error {
	if !s.c.protector || full <= l.protected {
		return nil
	}
	for i, b := range s.bufs {
		if err := b.protect(l.protected, full-l.protected, backing.ReadOnly); err != nil {
			var errs []error
			for _, q := range s.bufs[:i] {
				if rerr := q.protect(l.protected, full-l.protected, backing.ReadWrite); rerr != nil {
					errs = append(errs, rerr)
				}
			}
			return errors.Join(append([]error{err}, errs...)...)
		}
	}
	l.protected = full
	return nil
}

// capLocked evicts down to MaxBytes and returns the entries to close. pc.mu is held.
func (pc *PrefixCache) capLocked() []*pcEntry {
	if over := pc.cachedGranules*pc.gbytes - pc.opts.MaxBytes; pc.opts.MaxBytes > 0 && over > 0 {
		return pc.evictLocked(over, evictCap)
	}
	return nil
}

// startOn starts a sequence on src's first n tokens (an entry's, or an inserted
// sequence's), evicting cached prefixes before the budget refuses the copied tail
// (shareBudget, evicting). An inserted sequence's shared bytes become frozen (WriteToken
// refuses them).
func (pc *PrefixCache) startOn(src *Sequence, n int, entry bool) (*Sequence, error) {
	if err := pc.c.shareBudget(n); err != nil {
		return nil, err
	}
	return evicting(pc.c, func() (*Sequence, error) {
		q, err := pc.c.startOn(src, n)
		if err == nil && !entry {
			src.frozen = max(src.frozen, q.frozen)
		}
		return q, err
	})
}

// startOn returns a new sequence holding src's first n tokens: the whole granules
// mapped read-only, the rest copied, as ForkAt does. Unlike ForkAt it leaves src as it
// is (an entry is never written, and many lookups read it at once).
func (c *Cache) startOn(src *Sequence, n int) (*Sequence, error) {
	s, err := c.newSequence()
	if err != nil {
		return nil, err
	}
	full, err := c.shareInto(s.bufs, src.bufs, n)
	if err != nil {
		return nil, errors.Join(err, c.abandon(s))
	}
	s.n = n
	s.frozen = full
	s.publish()
	c.register(s)
	return s, nil
}

// Insert adds the first len(tokens) tokens of s, whose IDs are tokens, to the cache
// (more tokens than s holds fail with ErrRange and change nothing), so that later lookups can start on them; tokens the cache
// holds already are left as they are. It is bookkeeping only: the new entry refers to
// s's granules (see the package doc's "Prefix caching"). s's whole granules below
// them become shared: below s.Writable from then on, refused by WriteToken, and they
// MUST NOT be written through Bytes or a View (on a backing.Protector the first
// lookup that maps them makes them read-only in s too); nor may s's tokens past them
// and below len(tokens) be written through Bytes or a View (WriteToken may: the entry
// first copies them). When s closes, the entry takes over s's ranges; where s was
// inserted more than once under tokens that do not extend each other, only the longest
// of its entries does, and the others leave the index then. s must belong to the
// prefix cache's cache and stays the caller's, usable and to be closed as before. A
// cache over MaxBytes afterwards evicts down to it. A sequence that maps granules of an
// earlier prefix cache of the same cache, closed since (a hit or an insert there, or a
// fork or prefix of one), is refused with ErrConfig and nothing changes: this one's
// books can not tell which of those granules others still map.
func (pc *PrefixCache) Insert(s *Sequence, tokens []int32) error {
	if s == nil {
		panic(PanicNilSequence)
	}
	if err := s.usable(); err != nil {
		return err
	}
	if s.c != pc.c {
		return fmt.Errorf("%w: the sequence belongs to another cache", ErrConfig)
	}
	if s.pcl != nil && s.pcl.pc != pc {
		return fmt.Errorf("%w: the sequence maps granules of an earlier prefix cache, closed since", ErrConfig)
	}
	if len(tokens) > s.n {
		return fmt.Errorf("%w: insert of %d tokens from a sequence of %d", ErrRange, len(tokens), s.n)
	}
	n := len(tokens)
	frozen := s.frozen // before the entry shares more of s
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return ErrClosed
	}
	m, _ := pc.tree.Peek(tokens)
	var drop []*pcEntry
	e := &pcEntry{origin: s, n: n}
	leaf, old, displaced := pc.tree.Insert(tokens, e) // marks the path used, new or not
	if leaf == nil {
		pc.mu.Unlock()
		return nil
	}
	e.leaf = leaf
	pc.ev.sync(pc.tree, pc.ev.owned(tokens))
	if s.pcl == nil {
		s.pcl = &pcLive{pc: pc}
	}
	l := s.pcl
	l.origin = true
	l.lazyN = max(l.lazyN, n)
	e.ol = l
	l.entry = e
	l.lazy = append(l.lazy, e)
	pc.entries++
	pc.inserted += int64(n - m)
	// The granules s maps from the cache (still unchanged: below s's frozen bytes)
	// are the ones the new entry now holds too; the rest are s's own.
	keep := min(len(l.grefs), frozen/pc.c.unit)
	for _, g := range l.grefs[keep:] {
		g.live--
	}
	l.grefs = l.grefs[:keep]
	full, k := pc.c.fullUnits(n), pc.c.unitsFor(n)
	// One allocation for the granules new to the cache: s maps them all (its own).
	fresh := make([]granuleRef, max(k-len(l.grefs), 0))
	e.grefs = make([]*granuleRef, k)
	l.grefs = slices.Grow(l.grefs, max(full-len(l.grefs), 0))
	for j := range k {
		var g *granuleRef
		switch {
		case j < len(l.grefs):
			g = l.grefs[j]
		case pc.lazyTailAt(s, j) != nil:
			// An earlier entry of s holds s's granule j as its partly filled tail:
			// one granule, one reference.
			g = pc.lazyTailAt(s, j)
			if j < full {
				// From now on l.grefs counts s's mapping of it, not the tail.
				pc.untail(s, g)
			} else {
				e.tail = g
			}
		default:
			g = &fresh[j-len(l.grefs)]
			g.live = 1
			if j == full {
				e.tail = g // the partly filled last granule, which s alone maps
			}
		}
		e.grefs[j] = g
		pc.hold(g)
	}
	for j := len(l.grefs); j < full; j++ {
		l.grefs = append(l.grefs, e.grefs[j])
	}
	s.frozen = max(s.frozen, full*pc.c.unit)
	if displaced {
		// The new entry holds the old one's tokens (and maps its granules, where s
		// did): the old one goes, giving back only its own tail. That is no
		// eviction: the tokens stay cached.
		if _, d := pc.unhold(old); d != nil {
			drop = append(drop, d)
		}
	}
	drop = append(drop, pc.capLocked()...)
	pc.mu.Unlock()
	for _, d := range drop {
		d.close()
	}
	return nil
}

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
// s's owner calls it with the lock from rangesLock held.
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
			old.live-- // s no longer maps it; counted once however many entries held it
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
		es, err := pc.startOn(s, n, false)
		var drop []*pcEntry
		pc.mu.Lock()
		switch {
		case err == nil && !e.closed && e.origin == s && e.n == n:
			e.seq, e.origin = es, nil
			pc.c.adopt(es)
			if pc.lazyTail(e) {
				// The entry's copy of the tail stands for s's granule there.
				k := len(e.grefs) - 1
				pc.release(e.grefs[k])
				if e.grefs[k] == e.tail && e.tail.entries == 0 {
					e.tail.live-- // which s alone now maps
				}
				e.grefs[k] = &granuleRef{}
				pc.hold(e.grefs[k])
			}
			e.tail = nil
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
	g.entries++
	if g.entries == 1 {
		pc.cachedGranules++
	}
}

// release counts g held by one entry fewer and returns the bytes that came back (0
// while a live sequence or another entry maps it). pc.mu is held.
func (pc *PrefixCache) release(g *granuleRef) int64 {
	g.entries--
	if g.entries > 0 {
		return 0
	}
	pc.cachedGranules--
	if g.live > 0 {
		return 0
	}
	return pc.gbytes
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
	e.grefs = nil
	e.closed = true
	e.origin, e.tail = nil, nil // a lazy entry refers to nothing from now on
	pc.entries--
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

// adopt, as s closes, makes an entry made from s hold s's own ranges rather than
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
func (l *pcLive) adopt(s *Sequence) ([]buffer, bool) {
	pc := l.pc
	if l.origin {
		l.mu.Lock()
		defer l.mu.Unlock()
	}
	pc.mu.Lock()
	var drop []*pcEntry
	defer func() {
		pc.mu.Unlock()
		for _, d := range drop {
			d.close()
		}
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
		es.publish()
		s.bufs = nil
		take.seq, take.origin = es, nil
		if take.tail != nil {
			take.tail.live-- // s's tail granule is the entry's alone now
			take.tail = nil
		}
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
	e.seq.publish()
	if k := full / c.unit; k < len(e.grefs) {
		// The entry's copy of the partly filled last granule gives way to s's.
		pc.release(e.grefs[k])
		e.grefs[k] = &granuleRef{}
		pc.hold(e.grefs[k])
	}
	l.entry = nil
	return old, true
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
		g.live++
	}
	return &pcLive{pc: pc, grefs: grefs}
}

// sharing readies s, whose first k sharing units a fork or a frozen prefix is about to
// map, for inherit: where c has a prefix cache, s's pcLive counts s's mapping of each of
// them, those the cache does not hold yet by references of their own. An entry that
// Insert makes later, from s or from the new holder, then holds those references, and
// so counts the holder as mapping its granules until the holder drops them: eviction
// does not count on them, nor a miss take over their entry's ranges. Only s's owner
// calls it, once s shares them.
func (s *Sequence) sharing(k int) {
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

// dropLive forgets what a closing sequence mapped.
func (l *pcLive) drop() {
	l.pc.mu.Lock()
	for _, g := range l.grefs {
		g.live--
	}
	l.grefs = nil
	l.pc.mu.Unlock()
}

// adopt moves s from the cache's sequences to its prefix cache's entries: it no longer
// counts in Stats or SequenceStats, and Close still waits for it.
func (c *Cache) adopt(s *Sequence) {
	c.mu.Lock()
	delete(c.seqs, s)
	c.entries++
	c.mu.Unlock()
}

// closeEntry closes a sequence the prefix cache owned (adopted or not) and returns
// the outcome.
func (s *Sequence) closeEntry() accounting.ReleaseOutcome {
	c := s.c
	c.mu.Lock()
	if _, ok := c.seqs[s]; !ok {
		c.entries--
	}
	c.mu.Unlock()
	return s.Close()
}

// PrefixPin holds a cached prefix against eviction (a system prompt). It MUST be
// released.
type PrefixPin struct {
	pc   *PrefixCache
	node *radix.Node[*pcEntry]
	n    int
	done bool
}

// Len returns the pinned tokens.
func (p *PrefixPin) Len() int { return p.n }

// Pin pins the longest prefix of tokens the cache holds (at most all of it): eviction
// never takes those tokens' granules until the pin is released. Len says how many
// tokens that is (0 when none is cached: insert them first).
func (pc *PrefixCache) Pin(tokens []int32) (*PrefixPin, error) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closed {
		return nil, ErrClosed
	}
	n := pc.tree.Pin(tokens)
	return &PrefixPin{pc: pc, node: n, n: n.Depth()}, nil
}

// Release drops the pin; a cache over MaxBytes then evicts down to it. Releasing
// twice panics with PanicPinReleased.
func (p *PrefixPin) Release() {
	pc := p.pc
	pc.mu.Lock()
	if p.done {
		pc.mu.Unlock()
		panic(PanicPinReleased)
	}
	p.done = true
	var drop []*pcEntry
	if !pc.closed {
		pc.tree.Unpin(p.node)
		drop = pc.capLocked()
	}
	pc.mu.Unlock()
	for _, d := range drop {
		d.close()
	}
}

// Stats returns a snapshot of the prefix cache.
func (pc *PrefixCache) Stats() PrefixCacheStats {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	st := PrefixCacheStats{
		Queries: pc.queries, Hits: pc.hits, InsertedTokens: pc.inserted,
		EvictedTokens: pc.evictedTokens, Evictions: pc.evictions, EvictedBytes: pc.evictedBytes,
		Entries: pc.entries, CachedBytes: pc.cachedGranules * pc.gbytes,
	}
	st.PinnedBytes = pc.pinnedLocked() * pc.gbytes
	st.CachedTokens = pc.tree.Tokens()
	return st
}

// Close evicts every entry, pins or not, and detaches the prefix cache from its cache
// and the governor (its ledger leaves the governor's list). Sequences started by
// Lookup stay valid (they map what they use). Close waits for a reclaimer that is
// running; a second Close does nothing.
func (pc *PrefixCache) Close() error {
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return nil
	}
	pc.closed = true
	pc.mu.Unlock()
	pc.auth.SetReclaimer(nil)
	pc.reclaiming.Wait()
	pc.working.Wait()
	pc.mu.Lock()
	var drop []*pcEntry
	pc.tree.EachLeaf(func(leaf *radix.Node[*pcEntry]) bool {
		drop = append(drop, leaf.Value())
		return true
	})
	for _, e := range drop {
		pc.evict(e)
	}
	pc.tree = radix.New[*pcEntry]()
	pc.ev.clear()
	pc.mu.Unlock()
	var errs []error
	for _, e := range drop {
		if e.seq == nil {
			continue // lazy: its origin keeps its ranges
		}
		if out := e.seq.closeEntry(); out.Err != nil {
			errs = append(errs, out.Err)
		}
	}
	pc.c.pc.Store(nil)
	// Its ledger never owned or mapped a byte: it leaves the governor's list.
	if err := pc.auth.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// rangesLock returns the lock that s's calls resizing or protecting its ranges must
// hold (see pcLive), or nil when no entry ever referred to them. Only s's owner calls
// it.
func (s *Sequence) rangesLock() *sync.Mutex {
	if s.pcl == nil || !s.pcl.origin {
		return nil
	}
	return &s.pcl.mu
}

// beforeChange readies s to change its tokens from t on (a Truncate to t, a write of
// token t): lazy entries that hold those tokens get ranges of their own first. The
// lock from rangesLock is held.
func (s *Sequence) beforeChange(t int) {
	if l := s.pcl; l != nil && t < l.lazyN {
		l.pc.materialize(s, t)
		l.lazyN = t
	}
}

// unprotectPast forgets the protection of what s gave up (a Truncate). The lock from
// rangesLock is held.
func (l *pcLive) unprotectPast(s *Sequence) { l.protected = min(l.protected, s.frozen) }

// dropPast forgets the cache's granules that s no longer maps (a Truncate gave them
// up: only those below s's frozen bytes are still the cache's), so that they count as
// mapped by no live sequence for eviction and PinnedBytes. Only s's owner calls it.
func (l *pcLive) dropPast(s *Sequence) {
	keep := s.frozen / s.c.unit
	l.pc.mu.Lock()
	if e := l.entry; e != nil && s.frozen < s.c.shareable(e.n) {
		// s gave up granules the entry maps, and may write their tokens anew: its
		// ranges can not stand for the entry's when it closes (see adopt), even once
		// a later fork or freeze shares them again.
		l.entry = nil
	}
	if keep < len(l.grefs) {
		for _, g := range l.grefs[keep:] {
			g.live--
		}
		l.grefs = l.grefs[:keep]
	}
	l.pc.mu.Unlock()
}

// beforeWrite is beforeChange for a write of token t, taking the ranges' lock.
func (s *Sequence) beforeWrite(t int) {
	if l := s.pcl; l != nil && t < l.lazyN {
		mu := &l.mu
		mu.Lock()
		s.beforeChange(t)
		mu.Unlock()
	}
}
