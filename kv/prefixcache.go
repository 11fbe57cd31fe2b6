package kv

import (
	"errors"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/kv/internal/radix"
)

// PrefixCacheOptions configures a PrefixCache.
type PrefixCacheOptions struct {
	// MaxBytes caps the physical bytes the cache's entries hold (CachedBytes); 0 means
	// no cap other than the governor's budget, which takes cached prefixes back when
	// it runs short.
	MaxBytes int64
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
	_ noCopy

	c      *Cache
	opts   PrefixCacheOptions
	gbytes int64                 // physical bytes of one granule index: a granule in each range
	auth   *accounting.Authority // a ledger of its own, owning nothing, for the reclaimer

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
type pcEntry struct {
	seq    *Sequence
	grefs  []*granuleRef // one per granule index seq holds
	busy   int           // lookups mapping from seq without the lock
	leaf   *radix.Node[*pcEntry]
	closed bool // out of the index; closed by the last lookup mapping from it
}

// pcLive is what a live sequence maps of the cache's granules: set by Lookup and
// Insert, dropped by Sequence.Close.
type pcLive struct {
	pc    *PrefixCache
	grefs []*granuleRef
	entry *pcEntry // the last entry Insert made from the sequence, or nil
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
	// came back by it (granules no live sequence still mapped).
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
	pc := &PrefixCache{
		c: c, opts: opts, gbytes: int64(c.nbuf) * int64(c.gran),
		tree: radix.New[*pcEntry](),
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

// tokensBelow returns the whole tokens held by granule indexes [0, k).
func (pc *PrefixCache) tokensBelow(k int) int { return k * pc.c.gran / pc.c.row }

// granulesFor returns the granule indexes that hold n tokens.
func (pc *PrefixCache) granulesFor(n int) int {
	b, _ := backing.AlignUp(n*pc.c.row, pc.c.gran)
	return b / pc.c.gran
}

// fullGranules returns the whole granule indexes below n tokens: those a sequence
// started on n tokens maps rather than copies.
func (pc *PrefixCache) fullGranules(n int) int { return n * pc.c.row / pc.c.gran }

// Lookup returns a sequence that starts on the longest prefix of tokens the cache
// holds, and that prefix's length: its whole granules are mapped from the cache, the
// tokens past the last whole granule copied, as NewSequenceFrom does. The last token
// is never matched (a server computes it again for its logits), so the match is at
// most len(tokens)-1; with no match the sequence is empty. The caller appends and
// writes the rest of the prompt from there. It counts len(tokens) queries and the
// match as hits. When the copied tail can not be had within the budget, cached
// prefixes are evicted first; if still refused, the error matches
// accounting.ErrBudgetExceeded and nothing changed. The sequence MUST be closed.
func (pc *PrefixCache) Lookup(tokens []int32) (*Sequence, int, error) {
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return nil, 0, ErrClosed
	}
	pc.working.Add(1)
	defer pc.working.Done()
	limit := min(max(len(tokens)-1, 0), pc.c.cfg.MaxTokens)
	m, node := pc.tree.Match(tokens[:limit])
	var e *pcEntry
	// The granules the new sequence will map count as mapped by a live sequence from
	// now on, so that eviction does not count on them.
	l := &pcLive{pc: pc}
	if m > 0 {
		leaf := pc.tree.Cover(node)
		pc.tree.Touch(leaf)
		e = leaf.Value()
		e.busy++
		l.grefs = append(l.grefs, e.grefs[:pc.fullGranules(m)]...)
		for _, g := range l.grefs {
			g.live++
		}
	}
	pc.mu.Unlock()

	var s *Sequence
	var err error
	if e == nil {
		s, err = pc.c.NewSequence()
	} else {
		s, err = pc.startOn(e.seq, m, true)
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
		for _, g := range l.grefs {
			g.live--
		}
	} else {
		s.pcl = l
		pc.queries += int64(len(tokens))
		pc.hits += int64(m)
	}
	// An insert may have gone over MaxBytes while this lookup held its entry.
	drop = append(drop, pc.capLocked()...)
	pc.mu.Unlock()
	for _, d := range drop {
		d.seq.closeEntry()
	}
	if err != nil {
		return nil, 0, err
	}
	return s, m, nil
}

// capLocked evicts down to MaxBytes and returns the entries to close. pc.mu is held.
func (pc *PrefixCache) capLocked() []*pcEntry {
	if over := pc.cachedGranules*pc.gbytes - pc.opts.MaxBytes; pc.opts.MaxBytes > 0 && over > 0 {
		return pc.evictLocked(over, evictCap)
	}
	return nil
}

// startOn starts a sequence on src's first n tokens (an entry's, or an inserted
// sequence's), evicting cached prefixes and trying again once when the budget refuses
// the copied tail. An inserted sequence's shared bytes become frozen (WriteToken
// refuses them) but, unlike ForkAt, its own mapping of them stays writable.
//
// NB: protecting them (mprotect on host.Shared) would leave their page table entries
// write-protected; the entry takes those ranges over when the sequence closes, and
// once eviction hands the granules to the next sequence, its first write to each page
// faults: measured 8× slower per request at a 0% hit rate (BenchmarkPrefixCacheMiss).
func (pc *PrefixCache) startOn(src *Sequence, n int, entry bool) (*Sequence, error) {
	start := func(n int) (*Sequence, error) {
		q, err := pc.c.startOn(src, n)
		if err == nil && !entry {
			src.frozen = max(src.frozen, q.frozen)
		}
		return q, err
	}
	s, err := start(n)
	if err != nil && errors.Is(err, accounting.ErrBudgetExceeded) && pc.evictFor(pc.gbytes) > 0 {
		s, err = start(n)
	}
	return s, err
}

// startOn returns a new sequence holding src's first n tokens: the whole granules
// mapped read-only, the rest copied, as ForkAt does. Unlike ForkAt it leaves src as it
// is (an entry is never written, and many lookups read it at once).
func (c *Cache) startOn(src *Sequence, n int) (*Sequence, error) {
	s, err := c.newSequence()
	if err != nil {
		return nil, err
	}
	full, err := shareInto(s.bufs, src.bufs, n*c.row, c.gran)
	if err != nil {
		return nil, errors.Join(err, c.abandon(s))
	}
	s.n = n
	s.frozen = full
	s.publish()
	c.register(s)
	return s, nil
}

// Insert adds the first len(tokens) tokens of s (at most s.Len()), whose IDs are
// tokens, to the cache, so that later lookups can start on them; tokens the cache
// holds already are left as they are. The new entry maps s's whole granules (they
// become shared: below s.Writable from then on, refused by WriteToken, and they MUST
// NOT be written through Bytes or a View: s's own mapping of them stays writable, see
// startOn) and copies the rest; when s closes, the entry takes over s's ranges. s must belong to
// the prefix cache's cache and stays the caller's, usable and to be closed as before.
// When the copied tail can not be had within the budget, cached prefixes are evicted
// first; if still refused, the error matches accounting.ErrBudgetExceeded and nothing
// changed. A cache over MaxBytes afterwards evicts down to it.
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
	n := min(s.n, len(tokens))
	tokens = tokens[:n]
	frozen := s.frozen // before the entry shares more of s
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return ErrClosed
	}
	pc.working.Add(1)
	defer pc.working.Done()
	if m, _ := pc.tree.Peek(tokens); m == n {
		pc.tree.Match(tokens)
		pc.mu.Unlock()
		return nil
	}
	pc.mu.Unlock()

	es, err := pc.startOn(s, n, false)
	if err != nil {
		return err
	}
	var drop []*pcEntry
	pc.mu.Lock()
	e := &pcEntry{seq: es}
	m, _ := pc.tree.Peek(tokens)
	leaf, old, displaced := pc.tree.Insert(tokens, e)
	if leaf == nil {
		// Another insert brought the same tokens meanwhile.
		pc.mu.Unlock()
		es.closeEntry()
		return nil
	}
	e.leaf = leaf
	l0 := s.pcl
	if l0 == nil {
		l0 = &pcLive{pc: pc}
		s.pcl = l0
	}
	l0.entry = e
	pc.entries++
	pc.inserted += int64(n - m)
	pc.c.adopt(es)
	// The granules s maps from the cache (still unchanged: below s's frozen bytes)
	// are the ones the new entry now maps too; the rest are s's own.
	if s.pcl == nil {
		s.pcl = &pcLive{pc: pc}
	}
	l := s.pcl
	keep := min(len(l.grefs), frozen/pc.c.gran)
	for _, g := range l.grefs[keep:] {
		g.live--
	}
	l.grefs = l.grefs[:keep]
	full := pc.fullGranules(n)
	for j := range pc.granulesFor(n) {
		var g *granuleRef
		switch {
		case j < len(l.grefs):
			g = l.grefs[j]
		case j < full:
			g = &granuleRef{live: 1}
			l.grefs = append(l.grefs, g)
		default:
			g = &granuleRef{} // the copied tail: the entry's own
		}
		e.grefs = append(e.grefs, g)
		pc.hold(g)
	}
	if displaced {
		// The new entry holds the old one's tokens (and maps its granules, where s
		// did): the old one goes, giving back only its own tail.
		if d := pc.unhold(old); d != nil {
			drop = append(drop, d)
		}
	}
	drop = append(drop, pc.capLocked()...)
	pc.mu.Unlock()
	for _, d := range drop {
		d.seq.closeEntry()
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
// It returns e for the caller to close once pc.mu is released, or nil when a lookup
// maps from it now (that lookup closes it). pc.mu is held.
func (pc *PrefixCache) unhold(e *pcEntry) *pcEntry {
	var freed int64
	for _, g := range e.grefs {
		freed += pc.release(g)
	}
	pc.evictedBytes += freed
	e.grefs = nil
	e.closed = true
	pc.entries--
	if e.busy > 0 {
		return nil
	}
	return e
}

// adopt, as s closes, makes the entry Insert last made from s hold s's own ranges
// rather than its mappings of them, and returns the entry's former ranges for Close
// to release in place of s's. It reports false, changing nothing, when the entry is
// gone, is being mapped from, or holds tokens s no longer has unchanged.
//
// NB: the entry's mappings were made by Share and never touched, so they hold no page
// tables, while s's are populated by its writes. Unmapping s's would zap every page
// table entry and leave the cache with mappings whose first use faults page by page;
// keeping s's costs nothing and, when eviction later returns a granule to the pool,
// it goes with its page tables, so the next commit of it does not fault either.
func (l *pcLive) adopt(s *Sequence) ([]buffer, bool) {
	pc := l.pc
	pc.mu.Lock()
	defer pc.mu.Unlock()
	e := l.entry
	if pc.closed || e == nil || e.closed || e.busy > 0 || s.err != nil || e.seq.err != nil {
		return nil, false
	}
	n, c := e.seq.n, pc.c
	full := backing.AlignDown(n*c.row, c.gran)
	if n > s.n || s.frozen < full {
		return nil, false // s was truncated into what the entry maps
	}
	if err := s.resizeAll(n * c.row); err != nil {
		return nil, false
	}
	old := e.seq.bufs
	if tail := n*c.row - full; tail > 0 {
		// s may have rewritten its tokens past its shared granules since the insert
		// (truncated and grown again): the entry's copy of them is what was inserted.
		for i := range s.bufs {
			if err := copyRange(s.bufs[i], old[i], full, tail); err != nil {
				return nil, false
			}
		}
	}
	e.seq.bufs, s.bufs = s.bufs, nil
	e.seq.frozen = full
	e.seq.publish()
	if k := full / c.gran; k < len(e.grefs) {
		// The entry's copy of the partly filled last granule gives way to s's.
		pc.release(e.grefs[k])
		e.grefs[k] = &granuleRef{}
		pc.hold(e.grefs[k])
	}
	l.entry = nil
	return old, true
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
		d.seq.closeEntry()
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
	pinned := map[*granuleRef]struct{}{}
	pc.tree.EachLeaf(func(leaf *radix.Node[*pcEntry]) bool {
		for _, g := range leaf.Value().grefs {
			if g.live > 0 {
				pinned[g] = struct{}{}
			}
		}
		// Each pinned node on the leaf's path pins its tokens' granules.
		for n := leaf; n != nil && n.Parent() != nil; n = n.Parent() {
			if n.Pinned() {
				for _, g := range leaf.Value().grefs[:pc.granulesFor(n.Depth())] {
					pinned[g] = struct{}{}
				}
				break
			}
		}
		return true
	})
	st.PinnedBytes = int64(len(pinned)) * pc.gbytes
	st.CachedTokens = pc.tree.Tokens()
	return st
}

// Close evicts every entry, pins or not, and detaches the prefix cache from its cache
// and the governor. Sequences started by Lookup stay valid (they map what they use).
// Close waits for a reclaimer that is running; a second Close does nothing.
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
		pc.unhold(e)
	}
	pc.tree = radix.New[*pcEntry]()
	pc.mu.Unlock()
	var errs []error
	for _, e := range drop {
		if out := e.seq.closeEntry(); out.Err != nil {
			errs = append(errs, out.Err)
		}
	}
	pc.c.pc.Store(nil)
	return errors.Join(errs...)
}
