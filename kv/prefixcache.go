package kv

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/nocopy"
	"github.com/vmarena/vmarena/internal/radix"
)

// PrefixCacheOptions configures a PrefixCache: the argument of NewPrefixCache, whose
// zero value is a prefix cache without a byte bound, tiers or events: what most
// servers want until they add a tier or a router.
type PrefixCacheOptions struct {
	// MaxBytes caps the physical bytes the cache's entries hold (CachedBytes); 0 means
	// no cap other than the governor's budget, which takes cached prefixes back when
	// it runs short.
	MaxBytes int64
	// Events, when it has an observer, is told the blocks the cache caches and
	// evicts (see events.go).
	Events EventOptions
	// Tiers, when set, are the stores below the device, in order (host memory first,
	// then a shared store, say): eviction writes an entry's whole blocks down into
	// each, and a lookup that does not find all of a prompt locally asks them for the
	// blocks that follow (see prefixcache_tier.go and docs/tiers.md).
	// Only the Blocked layout has blocks that are one contiguous unit; another is
	// refused with ErrConfig, as are two tiers of one Name (their counts, in Stats
	// and in metrics, are told apart by it) and more than MaxTiers.
	Tiers []Tier
	// TierPrefix is the user's part of the tiers' namespace (TierNamespace): the
	// model's weights or revision, an adapter, a tenant.
	TierPrefix string
	// TierStores bounds the stores into tiers that run at once; 0 means 2.
	TierStores int
	// TierLoads bounds the lookups that load from the tiers at once (each asks one
	// tier at a time, block after block); 0 means 16. A lookup that finds every
	// slot taken waits for one within its TierWait, and prefills what it could not
	// load.
	TierLoads int
	// TierWait bounds how long one lookup waits on the tiers, and one store, and all
	// of Close's stores together; 0 means 100ms.
	TierWait time.Duration
	// TierWriteThrough, when set, stores an entry's whole blocks into the tiers as
	// soon as the cache holds them in ranges of its own (the inserted sequence
	// closed, or was about to change them), off the token path, on TierStores
	// workers; eviction then writes down only what was not stored. When stores fall
	// behind, so that 8 write-throughs per worker wait already, the
	// next is deferred (TierStats.Deferred): its blocks go down as they are
	// evicted, as without write-through. The default,
	// false, is write-back only: blocks go down as they leave the device. It
	// requires Tiers (ErrConfig otherwise).
	TierWriteThrough bool
	// TierMinHits, when above 0, is the reuse threshold: only the blocks of entries
	// that lookups hit at least that many times go down (by write-back or, with
	// TierWriteThrough, once the count is reached). A hit counts for the entry it
	// maps from, one per lookup. 0, the default, stores every block; below 0, or
	// above 0 without Tiers, is refused with ErrConfig.
	TierMinHits int
}

// PrefixCache reuses K and V across requests by token IDs (automatic prefix caching).
// A server passes each prompt's token IDs to Lookup, which starts a sequence on the
// longest prefix the cache holds; after prefill (and, optionally, after decoding) it
// passes the sequence to Insert, so that later prompts can start on its tokens.
//
// An entry of the cache is a sequence the cache owns, holding one path of the index
// from its first token: whole granules mapped from the sequence that was inserted, the
// partly filled last granule copied. A prefix's physical granules are owned once
// however many entries and live sequences map them. The index is a radix tree of
// token IDs: a match is exact to the token, and equal keys are equal tokens, with no
// hash whose collision would map another prompt's K/V.
//
// Insert is bookkeeping only, so that a cache that is never hit costs no system call:
// the entry refers to the inserted sequence's granules until that sequence closes and
// hands its ranges over, or is about to change the cached tokens (Insert says what it
// may still write meanwhile).
//
// The cache's memory is the budget's to take back (see the package doc's memory
// rules): eviction takes the least recently used leaf's granules that give memory
// back, and a [PrefixPin] holds a prefix against it. With PrefixCacheOptions.Tiers,
// the blocks that leave the device are written down into the tiers, and a lookup asks
// them for the blocks past its local match (docs/tiers.md).
//
// A cache serves any number of namespaces (Namespace: a LoRA adapter, a tenant's salt),
// whose entries share nothing: LookupIn, MatchIn, InsertIn, NeedIn and PinIn take one,
// and Lookup, Match, Insert, Need and Pin are the default namespace's. One LRU evicts
// across them all (namespace.go says why).
//
// The mechanisms are told beside their code: the index and its counts in
// prefixcache_index.go, eviction in prefixcache_evict.go, lazy entries in
// prefixcache_lazy.go, tiers in prefixcache_tier.go, layer groups in
// prefixcache_groups.go.
//
// Its zero value is not usable; call NewPrefixCache.
type PrefixCache struct {
	_ nocopy.NoCopy

	mu sync.Mutex
	// ev queues the changes for the events (no observer: ev.side nil), under mu. NB: mu
	// and ev's counters are the struct's first 50 bytes, and its first slots follow:
	// queueing finds them in or next to the cache line that the call's lock has just
	// brought in, no memory of the events' own. (unsafe.go checks this layout.)
	ev pcEvents

	c      *Cache
	leak   invariants.Tracker // reports it collected unclosed in the invariants build
	opts   PrefixCacheOptions
	gbytes int64                 // physical bytes of one granule index: a granule in each range
	ubytes []int64               // per group, the physical bytes of one of its granuleRefs
	auth   *accounting.Authority // a ledger of its own, owning nothing, for the reclaimer
	tiers  *pcTiers              // nil without tiers

	tree   *radix.Tree[*pcEntry]
	closed bool
	// reclaimers, lookups and inserts running: Close waits for them.
	reclaiming sync.WaitGroup
	working    sync.WaitGroup
	// reclaimed, when not nil, is called as each reclaim returns: a test's hook
	// (export_events_test.go), set under mu.
	reclaimed func()
	// guarded by mu
	cachedBytes   int64 // physical bytes of the distinct granuleRefs held by entries
	queries, hits int64
	inserted      int64
	evictedTokens int64
	evictedBytes  int64
	evictions     int64
	entries       int
	// Recurrent-state checkpoints (prefixcache_checkpoint.go): the bytes and number
	// of those entries hold (ckBytes is part of cachedBytes), and the bytes of those
	// live sequences alone hold.
	ckBytes, ckPending int64
	ckCount            int
}

// PrefixCacheStats is a snapshot of a PrefixCache. Counters are in tokens where their
// names say so; where a meaning matches vLLM's metric of the same name (queries,
// hits), it is the same. Read it for metrics and logs (package metrics reads it).
type PrefixCacheStats struct {
	Queries int64 // prefix_cache_queries: prompt tokens passed to Lookup
	Hits    int64 // prefix_cache_hits: of which found cached
	// InsertedTokens is the tokens Insert added to the index.
	InsertedTokens int64
	// EvictedTokens is the tokens eviction took out of the index; Evictions the
	// granule indexes (and recurrent-state checkpoints) it dropped from entries,
	// EvictedBytes the physical bytes that
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
	// Tiers is each of PrefixCacheOptions.Tiers' counts, in its order; nil without
	// tiers. Hits counts the tokens they gave too.
	Tiers []TierStats
	// Checkpoints is the recurrent-state checkpoints (Sequence.Checkpoint) the
	// entries hold, each once however many hold it, and CheckpointBytes their
	// physical bytes: part of CachedBytes (and of PinnedBytes where a live sequence
	// holds one too). 0 on a model without recurrent groups.
	Checkpoints     int
	CheckpointBytes int64
	// PendingCheckpointBytes is the bytes of the checkpoints that live sequences
	// alone hold (recorded and not inserted yet, or started on by a hit of an entry
	// that has left the index since), or a write-through into the tiers that still
	// copies them after their entry let them go: not part of CachedBytes, never
	// evicted, gone with those sequences (or that store) or held by an entry once one
	// of them is inserted.
	PendingCheckpointBytes int64
}

// HitRate returns Hits over Queries (0 before any query), in tokens: the figure a
// server logs to tell whether its prefix cache earns its memory.
func (s PrefixCacheStats) HitRate() float64 {
	if s.Queries == 0 {
		return 0
	}
	return float64(s.Hits) / float64(s.Queries)
}

// NewPrefixCache returns an empty prefix cache over c, registered with the governor
// (its reclaimer) and with c, so that they take cached prefixes back as the package
// doc's memory rules say. c's backing must share memory (host.Shared, cuda), else
// the error matches ErrNoSharing; a cache has at most one PrefixCache. It MUST be
// closed before c. A server makes one at start-up, after New, when its requests
// share prompt prefixes (a system prompt, a conversation's earlier turns).
//
// A Model of one MLA group (DeepSeek-V3/R1) has one as a full-attention cache does:
// its latent is one tensor per layer, every token of it kept. A Model of window
// groups beside full or MLA ones (gpt-oss, Gemma-3, Llama-4) has one too, under the
// window rule (see the package doc and prefixcache_groups.go): a hit of m tokens
// needs the full groups' first m tokens and each window group's tokens that the step
// at m reads (none at a chunk boundary), all held by one entry; an entry keeps every
// unit its inserted sequence's windows still held below its tokens.
// There Insert is not lazy (it maps the sequence's whole units and copies each
// group's last partly filled one at once, as ForkAt does), eviction gives back older
// window units first, then entries' last units as on one group, events tell each
// group's blocks apart (a window group's those its entries' window units hold: see
// BlocksStored and events_groups.go), and tiers store one value per tier block (the
// least common multiple of the groups' blocks) that carries each group's units of it,
// under the groups' layout, and a load serves a hit only where every window group
// holds what the step there reads (prefixcache_tier_groups.go). A Model with Recurrent
// groups beside groups that keep tokens (Qwen3-Next, Nemotron-H, Jamba, Granite-4.0-H)
// has one too, of checkpoints (see prefixcache_checkpoint.go): a state is a function of
// every token before it, so the server records copies of the states where its prefill
// reaches a point a later prompt may start on (Sequence.Checkpoint: a block boundary,
// the end of a system prompt or of a turn), Insert keeps those at or below the inserted
// tokens beside the full and window groups' units, and a hit of m tokens starts on the
// latest checkpoint at or below m where the window rule holds, its states copied into
// the new sequence; with none, the hit is 0. Checkpoints are cached memory
// (PrefixCacheStats.CheckpointBytes) that eviction takes back, the older ones of an
// entry first, once an Insert handed them to an entry. Tiers beside a recurrent group
// store a checkpoint's states with the tier block that ends at it, and a load starts
// on the states of the last such block it loads (prefixcache_tier_groups.go). A Model
// of Recurrent groups alone has none (ErrConfig): there is no token to map.
func NewPrefixCache(c *Cache, opts PrefixCacheOptions) (*PrefixCache, error) {
	if c == nil {
		return nil, fmt.Errorf("%w: nil cache", ErrConfig)
	}
	if !c.sharer {
		return nil, fmt.Errorf("%w: a prefix cache maps cached prefixes into sequences", ErrNoSharing)
	}
	if err := c.prefixCacheable(); err != nil {
		return nil, err
	}
	if opts.MaxBytes < 0 {
		return nil, fmt.Errorf("%w: MaxBytes %d", ErrConfig, opts.MaxBytes)
	}
	tiers, err := newTiersOf(c, opts)
	if err != nil {
		return nil, err
	}
	ev, err := newEvents(c, opts.Events)
	if err != nil {
		return nil, err
	}
	pc := &PrefixCache{
		c: c, opts: opts, gbytes: int64(c.nbuf) * int64(c.unit), ubytes: make([]int64, len(c.groups)),
		tree: radix.New[*pcEntry](), tiers: tiers,
	}
	for gi := range c.groups {
		pc.ubytes[gi] = int64(c.groups[gi].nbuf) * int64(c.groups[gi].unit)
	}
	if tiers != nil {
		tiers.pc = pc
	}
	pc.ev.attach(ev, &pc.mu)
	if ev != nil {
		pc.tree.DeferReuse() // the events' goroutine reads the edges Insert names
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
	if c.ph.Load() == nil {
		var h prefixHooks = pcHooks{c}
		c.ph.Store(&h)
	}
	c.mu.Unlock()
	pc.auth = c.gov.Authority("kv prefix cache", c.dev)
	pc.auth.SetReclaimer(pc.reclaim)
	invariants.Track(&pc.leak, pc, "kv.PrefixCache")
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
// hold the prompt's granules for, on a cache of one layer group, the least recently
// used entry may leave the index whole and hand its ranges to the new sequence, their
// granules still committed (Len is 0; the first growths up to them commit nothing): the
// eviction the prompt's growth would make, without unmapping and mapping as many
// granules again (see prefixcache_evict.go). The sequence MUST be closed. With tiers,
// Lookup reads them in the caller's goroutine; LookupAsync reads them in the background.
func (pc *PrefixCache) Lookup(tokens []int32) (*Sequence, int, error) {
	return pc.LookupIn(Namespace{}, tokens)
}

// LookupIn is Lookup in namespace ns: it starts on the longest prefix of tokens that
// ns's entries hold, never on another namespace's, and binds the sequence to ns when
// it maps anything (see Namespace).
func (pc *PrefixCache) LookupIn(ns Namespace, tokens []int32) (*Sequence, int, error) {
	for {
		s, m, err := pc.lookup(ns, tokens)
		if !errors.Is(err, errEntryGone) {
			return s, m, err
		}
		// The entry it matched left the index before it could map from it: a miss
		// after all, or another entry now. Look again.
	}
}

// hit is what a lookup found in the index (find), for the steps that map from it
// (start) and settle its books (settle).
type hit struct {
	m      int         // tokens matched
	e      *pcEntry    // the entry to map from (busy while the lookup maps), or nil
	l      *pcLive     // the new sequence's holdings of e's granules, or nil
	spare  *Sequence   // on a miss, an evicted entry's ranges for the new sequence
	sparWB *tierWrite  // what of spare to write down into the tiers first, or nil
	spared evictTally  // what taking spare evicted
	lazy   bool        // e was lazy when found: its origin's ranges hold the tokens
	ck     *checkpoint // with recurrent groups: the states to start on (l holds it)
}

// lookup is one try of Lookup: errEntryGone when the entry it matched left the
// index, with nothing to map from, before it could map from it. Its three steps take
// the locks in the package's order, each released before the next step: pc.mu
// (find), then the origin's ranges lock before pc.mu (start), then pc.mu (settle).
func (pc *PrefixCache) lookup(ns Namespace, tokens []int32) (*Sequence, int, error) {
	h, err := pc.find(ns, tokens)
	if err != nil {
		return nil, 0, err
	}
	defer pc.working.Done()
	s, err := pc.start(h)
	if err == nil && pc.tiers != nil {
		h.m = pc.tiers.loadFor(context.Background(), ns, s, tokens, h.m, pc.matchable(tokens))
	}
	pc.settle(h, s, err, len(tokens))
	if err != nil {
		return nil, 0, err
	}
	return s, h.m, nil
}

// find matches tokens in the index under pc.mu. On a hit the entry is marked busy and
// the granules the new sequence will map count as mapped by a live sequence from now
// on, so that eviction does not count on them; on a miss the least recently used
// entry may be spared for the new sequence (spareLocked). It matches in ns's part of
// the index only, and binds what the new sequence maps to ns. It counts the lookup in
// pc.working, which the caller ends.
func (pc *PrefixCache) find(ns Namespace, tokens []int32) (hit, error) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closed {
		return hit{}, ErrClosed
	}
	pc.working.Add(1)
	root := pc.space(ns, false)
	if pc.c.multi {
		m, leaf := pc.hitLocked(root, tokens[:pc.matchable(tokens)])
		h := hit{m: m}
		if leaf != nil {
			pc.tree.Touch(leaf)
			h.e = leaf.Value()
			h.e.busy++
			h.l = pc.hitLive(h.e, m)
			h.l.ns, h.l.bound = ns, true
			h.ck = pc.hitCheckpoints(h.l, h.e, m)
		}
		return h, nil
	}
	m, node := pc.tree.MatchFrom(root, tokens[:pc.matchable(tokens)])
	h := hit{m: m}
	if m == 0 {
		mark := pc.evictMark()
		h.spare, h.sparWB = pc.spareLocked(min(len(tokens), pc.c.cfg.MaxTokens))
		h.spared = pc.evictMark().minus(mark)
		return h, nil
	}
	leaf := pc.tree.Cover(node)
	pc.tree.Touch(leaf)
	h.e = leaf.Value()
	h.e.busy++
	h.lazy = h.e.state() == entryLazy
	h.l = &pcLive{pc: pc, ns: ns, bound: true}
	h.l.grefs = append(h.l.grefs, h.e.grefs[:pc.c.fullUnits(m)]...)
	for _, g := range h.l.grefs {
		g.mapped()
	}
	return h, nil
}

// start returns the new sequence of a lookup that found h. A lazy entry's tokens are
// mapped from its origin's ranges under their lock (taken before pc.mu, which only
// tells whether the origin still holds them), protected in the origin first; an owned
// entry's from its own ranges.
func (pc *PrefixCache) start(h hit) (*Sequence, error) {
	switch {
	case h.spare != nil:
		if h.sparWB != nil {
			// Before the new sequence writes over them, in this goroutine: a growth
			// would copy them out here too (see prefixcache_tier.go).
			h.sparWB.t.writeBack(context.Background(), h.spare, h.sparWB)
		}
		s := pc.c.reuse(h.spare)
		pc.logEviction(evictForGrowth, h.spared.bytes, h.spared)
		return s, nil
	case h.e == nil:
		return pc.c.NewSequence()
	}
	full := pc.c.fullUnits(h.m) * pc.c.unit
	var ol *pcLive
	if h.lazy {
		ol = h.e.ol
		ol.mu.Lock()
	}
	pc.mu.Lock()
	origin, own := h.e.origin, h.e.seq
	pc.mu.Unlock()
	if ol != nil && origin != nil {
		defer ol.mu.Unlock()
		if err := ol.protectFrom(origin, full); err != nil {
			return nil, err
		}
		return pc.startFrom(origin, h.m, true)
	}
	if ol != nil {
		ol.mu.Unlock() // the origin handed its ranges over (or dropped the entry)
	}
	if own == nil {
		// The entry left the index with its origin's ranges: nothing to map from.
		return nil, errEntryGone
	}
	return pc.startFromBelow(own, h.m, true, nil, h.ck)
}

// settle ends a lookup under pc.mu: the entry is no longer busy (closed now if it
// left the index meanwhile), the new sequence holds what find counted for it or the
// counts are undone, the queries and hits are counted, and an insert that went over
// MaxBytes while the lookup held its entry is evicted down to it.
func (pc *PrefixCache) settle(h hit, s *Sequence, err error, queried int) {
	pc.mu.Lock()
	var drop []*pcEntry
	if e := h.e; e != nil {
		e.busy--
		if e.state() == entryOut {
			// It left the index while this lookup mapped from it.
			drop = append(drop, e)
		}
	}
	switch {
	case err != nil && h.l != nil:
		h.l.unmapAll()
	case err == nil:
		if h.l != nil {
			s.pcl = h.l
		}
		pc.queries += int64(queried)
		pc.hits += int64(h.m)
		if e := h.e; e != nil && !e.closed {
			e.hits++
			pc.tiers.writeThrough(pc, e)
		}
	}
	drop = append(drop, pc.capLocked()...)
	drop, later := pc.tiers.later(drop)
	pc.mu.Unlock()
	pc.tiers.closeAll(drop, later)
}

// errEntryGone: the entry a lookup matched left the index, with nothing to map from,
// before the lookup could map from it; the lookup starts again.
var errEntryGone = errors.New("kv: prefix cache entry gone")

// Insert adds the first len(tokens) tokens of s, whose IDs are tokens, to the cache
// (more tokens than s holds fail with ErrRange and change nothing), so that later
// lookups can start on them: a server calls it after a request's prefill (and,
// optionally, when it ends); tokens the cache holds already are left as they are. It is
// bookkeeping only: the new entry refers to s's granules (see prefixcache_lazy.go).
// s's whole granules below them become shared: below s.Writable from then on,
// refused by WriteToken, and they MUST NOT be written through Bytes or a View (on a
// backing.Protector the first lookup that maps them makes them read-only in s too); nor
// may s's tokens past them and below len(tokens) be written through Bytes or a View
// (WriteToken may: the entry first copies them). When s closes, the entry takes over
// s's ranges; where s was inserted more than once under tokens that do not extend each
// other, only the longest of its entries does, and the others leave the index then. s
// must belong to the prefix cache's cache and stays the caller's, usable and to be
// closed as before. A cache over MaxBytes afterwards evicts down to it. A sequence that
// maps granules of an earlier prefix cache of the same cache, closed since (a hit or an
// insert there, or a fork or prefix of one), is refused with ErrConfig and nothing
// changes: this one's books can not tell which of those granules others still map.
//
// On a Model of window groups beside full ones, Insert gives the new entry ranges of
// its own at once (a window that moves on in s afterwards then gives back only s's
// mappings): it commits each group's partly filled last unit, evicting cached
// prefixes before it refuses for budget, and the entry keeps each window group's
// units from the first s still holds. An insert of n tokens that s's windows can no
// longer serve (a step at n would read a token they gave back) fails with ErrDropped
// and changes nothing.
func (pc *PrefixCache) Insert(s *Sequence, tokens []int32) error {
	return pc.InsertIn(Namespace{}, s, tokens)
}

// InsertIn is Insert into namespace ns: the entry is ns's, found only by lookups in
// ns. A sequence bound to another namespace (a Lookup hit or an Insert there) is
// refused with ErrConfig and nothing changes.
func (pc *PrefixCache) InsertIn(ns Namespace, s *Sequence, tokens []int32) error {
	if s == nil {
		panic(panicNilSequence)
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
	if err := s.dropAhead(); err != nil {
		return err
	}
	if pc.c.multi {
		drop, err := pc.insertGroups(ns, s, tokens)
		if err != nil {
			return err
		}
		drop = append(drop, pc.capLocked()...)
		// NB: what the cap evicts goes down into the tiers off the insert's path,
		// as on one group.
		drop, later := pc.tiers.later(drop)
		pc.mu.Unlock()
		pc.tiers.closeAll(drop, later)
		return nil
	}
	n := len(tokens)
	frozen := s.frozen // before the entry shares more of s
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return ErrClosed
	}
	if s.pcl != nil {
		if err := s.pcl.bind(ns); err != nil {
			pc.mu.Unlock()
			return err
		}
	}
	root := pc.space(ns, n > 0) // NB: no root is made for nothing
	m, _ := pc.tree.PeekFrom(root, tokens)
	var drop []*pcEntry
	e := &pcEntry{origin: s, n: n, ns: ns}
	leaf, old, displaced := pc.tree.InsertFrom(root, tokens, e) // marks the path used, new or not
	if leaf == nil {
		pc.mu.Unlock()
		return nil
	}
	e.leaf = leaf
	pc.ev.inserted(pc.tree, e, m, old, displaced)
	if s.pcl == nil {
		s.pcl = &pcLive{pc: pc, ns: ns, bound: true}
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
		g.unmap()
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
		pc.ev.displaced(old)
		e.hits, e.stored = old.hits, old.stored
		if _, d := pc.unhold(old); d != nil {
			drop = append(drop, d)
		}
	}
	drop = append(drop, pc.capLocked()...)
	drop, later := pc.tiers.later(drop)
	pc.mu.Unlock()
	pc.tiers.closeAll(drop, later)
	return nil
}

// closeFirst returns the first block Close writes down of leaf's entry: from the
// highest of its ancestors no other leaf claimed before (claimed) on, so that every
// block of the index goes down once, from one of the entries that hold it. pc.mu is
// held.
func (pc *PrefixCache) closeFirst(leaf *radix.Node[*pcEntry], claimed map[*radix.Node[*pcEntry]]bool) int {
	if pc.tiers == nil {
		return 0
	}
	n := leaf.Parent()
	for n != nil && n.Parent() != nil && !claimed[n] {
		claimed[n] = true
		n = n.Parent()
	}
	if n == nil {
		return 0
	}
	return n.Depth() / pc.tiers.bt
}

// Stats returns a snapshot of the prefix cache (see PrefixCacheStats): a metrics
// collector's call.
func (pc *PrefixCache) Stats() PrefixCacheStats {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	st := PrefixCacheStats{
		Queries: pc.queries, Hits: pc.hits, InsertedTokens: pc.inserted,
		EvictedTokens: pc.evictedTokens, Evictions: pc.evictions, EvictedBytes: pc.evictedBytes,
		Entries: pc.entries, CachedBytes: pc.cachedBytes,
		Checkpoints: pc.ckCount, CheckpointBytes: pc.ckBytes, PendingCheckpointBytes: pc.ckPending,
	}
	st.PinnedBytes = pc.pinnedLocked()
	st.CachedTokens = pc.tree.Tokens()
	st.Tiers = pc.tiers.stats()
	return st
}

// Close evicts every entry, pins or not, and detaches the prefix cache from its cache
// and the governor (its ledger leaves the governor's list). Sequences started by
// Lookup stay valid (they map what they use). Close waits for a reclaimer that is
// running. A second Close changes nothing and returns an error matching ErrClosed
// (docs/server.md, "A second Close"). A server closes it at shutdown, before
// Cache.Close.
func (pc *PrefixCache) Close() error {
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return fmt.Errorf("%w: PrefixCache closed twice", ErrClosed)
	}
	pc.closed = true
	pc.mu.Unlock()
	pc.leak.Close()
	pc.auth.SetReclaimer(nil)
	pc.reclaiming.Wait()
	pc.working.Wait()
	pc.tiers.seal(pc)
	ctx, cancel := pc.tiers.closeContext()
	defer cancel()
	pc.mu.Lock()
	var drop []*pcEntry
	claimed := make(map[*radix.Node[*pcEntry]]bool)
	pc.tree.EachLeaf(func(leaf *radix.Node[*pcEntry]) bool {
		drop = append(drop, leaf.Value())
		pc.tiers.pickFrom(leaf.Value(), leaf, pc.closeFirst(leaf, claimed))
		return true
	})
	for _, e := range drop {
		pc.evict(e)
	}
	if invariants.Enabled {
		pc.checkEmptyLocked()
	}
	pc.tree = radix.New[*pcEntry]()
	pc.ev.clear()
	pc.mu.Unlock()
	pc.ev.wait() // the events' goroutine takes pc.mu for the clear
	var errs []error
	for _, e := range drop {
		if e.seq == nil {
			continue // lazy: its origin keeps its ranges (and its blocks: flush)
		}
		if out := e.closeCtx(ctx); out.Err != nil {
			errs = append(errs, out.Err)
		}
	}
	errs = append(errs, pc.tiers.flush(ctx, pc)...)
	pc.c.pc.Store(nil)
	// Its ledger never owned or mapped a byte: it leaves the governor's list.
	if err := pc.auth.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
