package kv

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/radix"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kv/tierval"
)

// The tiers of a prefix cache (PrefixCacheOptions.Tiers): a cached block leaves the
// device for the tiers below it rather than for nowhere. A block is a sharing
// unit of the Blocked layout (Config.BlockTokens tokens of every layer, one
// contiguous run of whole granules); its key is the kv/blockhash chain (FNV64CBOR,
// no seed) of the prompt's blocks up to it, under TierNamespace(the cache's Config,
// its granule, TierPrefix) for the default Namespace, and for another under a tier
// namespace derived from that and the Namespace's fields (spaceTierNS), so that no
// value of one namespace is another's. Other layouts are refused: their block is not one unit.
// On a model of several layer groups a tier's block is a run of tokens every group's
// blocks tile, and its value carries each group's part (prefixcache_tier_groups.go).
//
// Write-down: every block that leaves the device goes down into every tier, in order,
// by one rule: what leaves is picked under the locks, its bytes are copied out with no
// lock held, and its granules come back only after that (CachedBytes and EvictedBytes
// count them at the pick, as without tiers). The cases:
//
//   - A leaf evicted whole (with tiers, eviction takes a leaf whole where every granule
//     of its own gives memory back): its whole blocks from the one that holds its
//     parent's last token on, copied out of its ranges before they close.
//   - A leaf only shortened (a granule of it mapped elsewhere, or a pinned parent
//     taking its place): the whole blocks cut off, which a holder of the cache's own
//     maps (no copy) before the entry's ranges shrink; the copies are made from it,
//     and it closes after them.
//   - A lazy entry evicted while its inserted sequence (origin) lives: its memory does
//     not come back then, so its blocks wait in the origin's ranges. They go down when
//     it does come back: the origin closes (a holder maps them and they are copied on
//     a goroutine of their own, off the origin's Close), or truncates below them
//     (copied first, in the Truncate: the only copy a token path makes).
//   - An entry whose ranges a miss takes over: copied out before the lookup returns
//     the new sequence, which writes over them.
//   - Close: every entry it evicts, each block of the index once (from one of the
//     entries that hold it), and the blocks still waiting in origins' ranges, copied
//     under each origin's ranges lock so that it can not close meanwhile; all of
//     Close's stores together within one TierWait, so that Close finishes.
//
// An eviction down to MaxBytes after an Insert or a lookup copies on a goroutine of
// its own, off the request's path (Close waits for it); one for a growth, a waiting
// request or Evict copies in the goroutine that evicts, since it needs the memory the
// copies give back. At most TierStores stores run at once, each within TierWait; a
// failed store (or a holder that could not be mapped) is a counted drop
// (TierStats.Drops). Blocks waiting in an origin's ranges go down from a holder also
// when it closes into another of its entries (a shorter lazy one, which keeps only its
// own); a damaged entry's or origin's blocks never go down.
//
// Policy: by default blocks go down as they leave the device (write-back), every one
// of them. PrefixCacheOptions.TierWriteThrough stores an entry's whole blocks as soon
// as the cache holds them in ranges of its own (its origin closed into it, or was
// about to change them), on one of TierStores workers with the entry held busy meanwhile
// (NB: eviction passes it over until its stores end, but a growth that finds nothing
// else to evict waits for them and then evicts it, as it would copy a write-back), and
// eviction then stores only what was not stored; a write-through that finds the
// workers' bounded queue full is deferred to eviction (TierStats.Deferred).
// PrefixCacheOptions.TierMinHits is the reuse threshold: only the blocks of entries
// that lookups hit that many times go down, the count kept per entry (a lookup counts
// once, for the entry it maps from; a longer entry that displaces one inherits it).
//
// Lookup: past the local match (a miss, or a partial hit), the tiers are asked in
// order for the whole blocks that follow, up to the last token, which is never
// matched: Contains, then Load of the run it reports, into granules the new sequence
// commits for them (the block holding the match's last token is loaded whole over its
// copy). Where the device's budget can not hold the whole run even after
// eviction (which runs first, as for any growth), the longest start of it that fits
// is loaded, the rest counted in TierStats.Unfit, and no tier below is asked. Every
// value is checked by DecodeTierValue against the prompt's own tokens before its
// bytes are copied, so no stale key, hash collision or other tenant's value maps
// another prompt's K/V; the first block that fails ends the run (TierStats.Invalid or
// Drops), the sequence is cut back to the blocks that passed, and the next tier is
// asked for the rest. At most TierLoads lookups load at once: a lookup waits for its
// turn within its wait, and one that gets none is a counted drop of that tier. The
// whole wait is bounded by TierWait; a tier's failure is a shorter match, never an
// error of Lookup. The loaded tokens count in Hits and in their tier's
// TierStats.Hits. LookupAsync runs the same loads on a goroutine of their own, its
// caller's context ending them too (prefixcache_async.go).

// Defaults of PrefixCacheOptions' tier fields.
const (
	// defaultTierStores is the stores into tiers that run at once when
	// PrefixCacheOptions.TierStores is 0.
	defaultTierStores = 2
	// defaultTierLoads is the lookups that load from the tiers at once when
	// PrefixCacheOptions.TierLoads is 0.
	defaultTierLoads = 16
	// defaultTierWait bounds a lookup's wait on the tiers, and one store, when
	// PrefixCacheOptions.TierWait is 0.
	defaultTierWait = 100 * time.Millisecond
	// tierThroughQueue is the write-throughs that wait for a store worker, per
	// worker (PrefixCacheOptions.TierStores of them): one that finds the queue full
	// is deferred (TierStats.Deferred), its blocks left to go down as the entry is
	// evicted, rather than a goroutine that waits holding its entry busy.
	tierThroughQueue = 8
)

// TierStats counts what a prefix cache did with one of its tiers
// (PrefixCacheStats.Tiers), for metrics and logs: a server reads Hits against
// Misses and Drops to tell whether a tier earns its cost.
type TierStats struct {
	Name string // the tier's Name
	// Hits is the prompt tokens lookups found in the tier and loaded (they count in
	// PrefixCacheStats.Hits too); Misses the lookups that asked the tier and loaded
	// nothing from it.
	Hits   int64
	Misses int64
	// LoadBytes and StoreBytes are the bytes of the values loaded from the tier (those
	// that passed their check) and stored into it.
	LoadBytes  int64
	StoreBytes int64
	// Drops counts the blocks not stored (the tier failed, or the copy out did, or
	// the granules of blocks cut off could not be held for the copy) and the loads
	// that failed other than by a value's check: each a miss, never an error of the
	// caller.
	Drops int64
	// Deferred counts the blocks whose write-through found the queue of the store
	// workers full (8 waiting per worker), so that stores fell behind the inserts: they
	// were not stored then, and go down as their entry is evicted (write-back), as
	// without TierWriteThrough. Not drops: nothing is lost unless that fails too.
	Deferred int64
	// Invalid counts the values that failed tierval.Decode's check: misses, never
	// mapped.
	Invalid int64
	// Unfit counts the blocks the tier held, next in a lookup's run, that the device's
	// budget could not take even after eviction: the lookup loaded the blocks before
	// them that fit, and asked no tier below for more.
	Unfit int64
}

// pcTiers is a prefix cache's tiers: the keys of its blocks, the bound on stores that
// run at once, the policy (write-through, reuse threshold), the write-downs that wait
// for an origin's ranges, and the counts. Its lock is taken after every other of the
// package's and guards only the counts.
type pcTiers struct {
	c     *Cache
	pc    *PrefixCache // the prefix cache of these tiers (its lock guards checkpoints' counts)
	tiers []Tier
	ns    uint64
	// bt is the tokens of a tier's block: the cache's block on one group, the least
	// common multiple of the groups' on several (grp: prefixcache_tier_groups.go).
	bt      int
	grp     *tierGroups
	hash    *blockhash.Hasher
	wait    time.Duration
	slots   chan struct{} // one token per store running
	loads   chan struct{} // one token per lookup loading from a tier
	through bool          // PrefixCacheOptions.TierWriteThrough
	minHits int64         // PrefixCacheOptions.TierMinHits
	// inProc[i]: tier i keeps its values in this process's memory (InProcessTier),
	// so their payloads go unsummed.
	inProc []bool
	// peek[i]: tier i as a TierPeeker, or nil where it is not one.
	peek []TierPeeker

	// bg counts the write-downs running on goroutines of their own (behind an
	// Insert or a lookup, a write-through, an origin's close): Close waits for them.
	bg sync.WaitGroup
	// owed is the bytes the reclaimer could not give requests that wait for memory
	// on the device: entries a write-through held busy may give them once their
	// stores end (repay).
	owed atomic.Int64

	// Guarded by the prefix cache's lock:
	// pending is the blocks of lazy entries that eviction took while their origin
	// (the key) still maps them: written down when that memory does come back (the
	// origin closes, or truncates below them), or by Close.
	pending map[*Sequence]*tierPending
	// sealed: Close is writing down what is left; write-downs are no longer
	// started in the background but parked for Close.
	sealed bool
	parked []*pcEntry
	// queue feeds the write-throughs to the store workers, TierStores of them,
	// started with the first (working); at most tierThroughQueue per worker wait in
	// it. Only writeThrough sends, pc.mu held and the tiers not sealed; seal closes
	// it, and the workers end once it is drained.
	queue   chan throughJob
	working bool
	// storing is the entries whose write-through runs, each with a channel closed
	// once it ended (and the entry, if it left the index meanwhile, closed): a
	// growth that finds nothing else to evict waits for one (PrefixCache.evictFor).
	storing map[*pcEntry]chan struct{}
	// onStoringWait, nil outside tests (export_test.go), is called as a growth starts
	// to wait for a write-through (PrefixCache.evictFor), with no lock held: a test
	// then knows the growth waits rather than guessing it from a timer.
	onStoringWait func()
	// onLoadWait, nil outside tests, is called as a lookup starts to wait for a
	// load slot (takeLoad), with no lock held.
	onLoadWait func()

	mu     sync.Mutex
	counts []TierStats
}

// tierPart is a run of whole blocks to write down: blocks [first, last) of the path
// whose tokens are tokens (at least last blocks of them), of the entry whose tier
// namespace is ns (spaceNS); on a cache of several groups, held is the first token
// each group of the entry held when it was picked, and on a cache with recurrent
// groups cks the entry's checkpoints at the ends of blocks [first, last), ascending,
// which the write-down holds (holdStates) until it ends (letStates): as a live
// sequence does where live is set (a write-through's, holdStatesLive).
type tierPart struct {
	tokens      []int32
	first, last int
	ns          uint64
	held        []int
	cks         []*checkpoint
	live        bool
}

// tierWrite is what eviction picked of an entry to write down: its parts, copied out
// of the entry's sequence (or of a holder mapping their granules) before it closes.
type tierWrite struct {
	t     *pcTiers
	parts []tierPart
	// dropped: nothing is written (the entry's ranges failed under the holder); its
	// close only lets the parts' holds go.
	dropped bool
}

// tierPending is the parts of an origin's evicted lazy entries (pcTiers.pending), and
// the origin's ranges lock, which Close takes before it copies them out.
type tierPending struct {
	ol    *pcLive
	parts []tierPart
}

// newTiers returns the tiers of opts for c, nil without any, or an error matching
// ErrConfig: a layout other than Blocked (only its block is one contiguous unit of
// every layer), more than MaxTiers tiers, a nil tier, two tiers of one name (their counts are told apart by
// it), a negative bound or threshold, or a tier policy without tiers. On a cache of
// several groups grp is their part and bt the tier block's tokens (newTiersOf); on one
// group, nil and the cache's block.
func newTiers(c *Cache, opts PrefixCacheOptions, grp *tierGroups, bt int) (*pcTiers, error) {
	if opts.TierStores < 0 || opts.TierLoads < 0 || opts.TierWait < 0 || opts.TierMinHits < 0 {
		return nil, fmt.Errorf("%w: TierStores %d, TierLoads %d, TierWait %v, TierMinHits %d: none may be negative",
			ErrConfig, opts.TierStores, opts.TierLoads, opts.TierWait, opts.TierMinHits)
	}
	if len(opts.Tiers) == 0 {
		if opts.TierWriteThrough || opts.TierMinHits > 0 {
			return nil, fmt.Errorf("%w: TierWriteThrough %v, TierMinHits %d without Tiers: nothing to store into", ErrConfig, opts.TierWriteThrough, opts.TierMinHits)
		}
		return nil, nil
	}
	if grp == nil && (c.cfg.Layout != Blocked || c.nbuf != 1 || c.tpb <= 0) {
		return nil, fmt.Errorf("%w: tiers store whole blocks, and only the Blocked layout lays a block out as one contiguous unit (layout %v)", ErrConfig, c.cfg.Layout)
	}
	if len(opts.Tiers) > MaxTiers {
		return nil, fmt.Errorf("%w: %d tiers, at most MaxTiers (%d)", ErrConfig, len(opts.Tiers), MaxTiers)
	}
	names := make(map[string]int, len(opts.Tiers))
	for i, t := range opts.Tiers {
		if t == nil {
			return nil, fmt.Errorf("%w: tier %d is nil", ErrConfig, i)
		}
		if j, ok := names[t.Name()]; ok {
			return nil, fmt.Errorf("%w: tiers %d and %d are both named %q", ErrConfig, j, i, t.Name())
		}
		names[t.Name()] = i
	}
	ns, err := TierNamespace(c.cfg, c.gran, opts.TierPrefix)
	if err != nil {
		return nil, err
	}
	h, err := blockhash.New(blockhash.Options{BlockSize: bt})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	t := &pcTiers{
		c: c, tiers: append([]Tier(nil), opts.Tiers...), ns: ns, bt: bt, grp: grp, hash: h,
		wait: opts.TierWait, slots: make(chan struct{}, opts.TierStores),
		through: opts.TierWriteThrough, minHits: int64(opts.TierMinHits),
		counts: make([]TierStats, len(opts.Tiers)), inProc: make([]bool, len(opts.Tiers)),
		peek:    make([]TierPeeker, len(opts.Tiers)),
		pending: make(map[*Sequence]*tierPending), storing: make(map[*pcEntry]chan struct{}),
	}
	if t.wait == 0 {
		t.wait = defaultTierWait
	}
	if opts.TierStores == 0 {
		t.slots = make(chan struct{}, defaultTierStores)
	}
	if t.through {
		t.queue = make(chan throughJob, tierThroughQueue*cap(t.slots))
	}
	t.loads = make(chan struct{}, opts.TierLoads)
	if opts.TierLoads == 0 {
		t.loads = make(chan struct{}, defaultTierLoads)
	}
	for i, tier := range t.tiers {
		t.counts[i].Name = tier.Name()
		t.inProc[i] = inProcess(tier)
		t.peek[i], _ = tier.(TierPeeker)
	}
	return t, nil
}

// stats returns a copy of the counts, nil without tiers.
func (t *pcTiers) stats() []TierStats {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]TierStats(nil), t.counts...)
}

// loadFailed counts a load of block blk from tier i that failed with err, under a
// lookup's ctx (loadContext): a value refused (invalid) in Invalid, with a Warn that
// says why; any other failure but a miss, or the lookup's caller ending the load, in
// Drops.
func (t *pcTiers) loadFailed(ctx context.Context, i, blk int, err error, invalid bool) {
	t.count(i, func(st *TierStats) {
		if invalid {
			st.Invalid++
		} else if !errors.Is(err, ErrTierMiss) && !callerEnded(ctx) {
			st.Drops++
		}
	})
	if invalid {
		logInvalidTierValue(t.c.cfg.Logger, i, blk, err)
	}
}

// count applies f to tier i's counts.
func (t *pcTiers) count(i int, f func(*TierStats)) {
	t.mu.Lock()
	f(&t.counts[i])
	t.mu.Unlock()
}

// keys returns the keys of the whole blocks of tokens from block first on, under the
// tier namespace ns (spaceNS).
func (t *pcTiers) keys(ns uint64, tokens []int32, first int) []tierval.Key {
	hs := t.hash.Chain(nil, t.hash.Root(), 0, tokens)
	if first >= len(hs) {
		return nil
	}
	keys := make([]tierval.Key, 0, len(hs)-first)
	for _, h := range hs[first:] {
		keys = append(keys, tierval.Key{Namespace: ns, Hash: h.Uint64()})
	}
	return keys
}

// spaceNS returns the tier namespace of the blocks of a prefix cache's namespace ns.
func (t *pcTiers) spaceNS(ns Namespace) uint64 { return spaceTierNS(t.ns, ns) }

// keep reports whether e's blocks go down at all: the reuse threshold (TierMinHits)
// asks for as many hits of it. pc.mu is held.
func (t *pcTiers) keep(e *pcEntry) bool {
	return t != nil && e.hits >= t.minHits
}

// part returns the whole blocks of e's path (its tokens, tokens) from block first on
// to the last whole one below n tokens, past those a write-through stored already, and
// whether there are any. pc.mu is held.
func (t *pcTiers) part(e *pcEntry, tokens []int32, first, n int) (tierPart, bool) {
	last := min(len(tokens), n) / t.bt
	first = max(first, e.stored)
	p := tierPart{tokens: tokens[:last*t.bt], first: first, last: last, ns: t.spaceNS(e.ns)}
	if t.grp != nil && e.seq != nil {
		p.held = e.seq.helds()
	}
	return p, first < last
}

// pick marks e, which eviction takes out of the index whole (leaf), to be written
// down: its blocks from the one holding its parent's last token on (those below stay
// cached in the index, held by the parent's other entries). An owned entry's are
// copied out of its ranges before they close (e.wb); a lazy entry's stay in its
// origin's ranges, which keep mapping them, until that memory comes back (pending).
// It returns e.wb. pc.mu is held.
func (t *pcTiers) pick(e *pcEntry, leaf *radix.Node[*pcEntry]) *tierWrite {
	if t == nil {
		return nil
	}
	return t.pickFrom(e, leaf, leaf.Parent().Depth()/t.bt)
}

// pickFrom is pick of e's blocks from block first on. pc.mu is held.
func (t *pcTiers) pickFrom(e *pcEntry, leaf *radix.Node[*pcEntry], first int) *tierWrite {
	if !t.keep(e) {
		return nil
	}
	switch {
	case e.seq != nil && e.seq.err == nil:
		if p, ok := t.part(e, leaf.Tokens(), first, e.n); ok {
			t.holdStates(e, &p)
			e.wb = &tierWrite{t: t, parts: []tierPart{p}}
		}
	case e.origin != nil && e.origin.err == nil:
		if p, ok := t.part(e, leaf.Tokens(), first, e.n); ok {
			t.defer_(e, p)
		}
	}
	return e.wb
}

// defer_ keeps part p of e, a lazy entry eviction takes, for when its origin's
// ranges give its memory back. pc.mu is held.
func (t *pcTiers) defer_(e *pcEntry, p tierPart) {
	pe := t.pending[e.origin]
	if pe == nil {
		pe = &tierPending{ol: e.ol}
		t.pending[e.origin] = pe
	}
	pe.parts = append(pe.parts, p)
}

// pickCut is pick for a leaf that eviction shortens to n tokens: the whole blocks cut
// off. A lazy entry's wait in its origin's ranges (pending); an owned entry's are
// mapped, before its ranges shrink, into a holder that is written down and closed
// once no lock is held: it returns that holder as an entry to close, or nil. pc.mu is
// held.
func (t *pcTiers) pickCut(e *pcEntry, leaf *radix.Node[*pcEntry], n int) *pcEntry {
	if !t.keep(e) {
		return nil
	}
	p, ok := t.part(e, leaf.Tokens(), t.c.unitsFor(n), e.n)
	switch {
	case !ok:
		return nil
	case e.seq == nil:
		if e.origin != nil && e.origin.err == nil {
			t.defer_(e, p)
		}
		return nil
	case e.seq.err != nil:
		return nil
	}
	h := t.holder(e.seq, p.first, p.last)
	if h == nil {
		return nil
	}
	return &pcEntry{seq: h, closed: true, wb: &tierWrite{t: t, parts: []tierPart{p}}}
}

// holder returns a sequence of the cache's own whose ranges map the granules of
// src's blocks [first, last), at their offsets in src, so that they stay alive (and
// their bytes as they are) while src shrinks or goes on; nil (a drop, counted) when
// they can not be mapped. It is an entry of the cache (closeEntry closes it). pc.mu
// is held; it maps, and copies nothing.
func (t *pcTiers) holder(src *Sequence, first, last int) *Sequence {
	c, unit := t.c, t.c.unit
	if c.unitsFor(src.n) < last {
		t.countDrops(last - first)
		return nil
	}
	bufs, err := c.newBuffers(c.capac)
	if err == nil {
		for i := range bufs {
			if err = bufs[i].shareRange(src.bufs[i], first*unit, (last-first)*unit, backing.ReadOnly); err != nil {
				break
			}
		}
	}
	if err != nil {
		c.release(bufs)
		t.countDrops(last - first)
		return nil
	}
	c.mu.Lock()
	c.entries++
	c.mu.Unlock()
	return &Sequence{c: c, bufs: bufs, n: last * c.tpb}
}

// countDrops counts blocks that were not written down into any tier as drops.
func (t *pcTiers) countDrops(blocks int) {
	for i := range t.tiers {
		t.count(i, func(st *TierStats) { st.Drops += int64(blocks) })
	}
}

// writeBack stores the parts w picked, whose blocks s's ranges hold (an evicted
// entry's, an origin's or a holder's), into every tier, at most len(t.slots) stores
// at once across the cache, each within the wait and ctx. No lock is held: those
// blocks of s do not change until this returns. A store that fails is a drop,
// counted.
func (t *pcTiers) writeBack(ctx context.Context, s *Sequence, w *tierWrite) {
	bt, unit := t.c.tpb, t.c.unit
	buf := s.bufs[0]
	for _, p := range w.parts {
		keys := t.keys(p.ns, p.tokens, p.first)
		for j, key := range keys {
			b := p.first + j
			tokens := p.tokens[b*bt : (b+1)*bt]
			size := tierval.Size(len(tokens), unit)
			for i, tier := range t.tiers {
				t.slots <- struct{}{}
				sctx, cancel := context.WithTimeout(ctx, t.wait)
				encode := tierval.Encode
				if t.inProc[i] {
					encode = tierval.EncodeInProcess
				}
				err := tier.Store(sctx, key, size, func(dst []byte) error {
					return encode(dst, key, tokens, unit, func(p []byte) error {
						return buf.readAt(b*unit, p)
					})
				})
				cancel()
				<-t.slots
				t.count(i, func(st *TierStats) {
					if err != nil {
						st.Drops++
					} else {
						st.StoreBytes += int64(size)
					}
				})
			}
		}
	}
}

// owe records that the reclaimer gave requests waiting on the device short bytes
// fewer than they wait for (short <= 0: none).
func (t *pcTiers) owe(short int64) {
	if t != nil && short > 0 {
		t.owed.Add(short)
	}
}

// originHolder, as s (an origin) closes, returns a holder mapping the blocks of s's
// evicted lazy entries that wait in its ranges (pending), as an entry to close, or
// nil. pc.mu is held.
func (t *pcTiers) originHolder(s *Sequence) *pcEntry {
	if t == nil {
		return nil
	}
	pe := t.pending[s]
	if pe == nil {
		return nil
	}
	delete(t.pending, s)
	if s.err != nil {
		return nil
	}
	lo, hi := pe.parts[0].first, 0
	for _, p := range pe.parts {
		lo, hi = min(lo, p.first), max(hi, p.last)
	}
	h := t.holder(s, lo, hi)
	if h == nil {
		return nil
	}
	return &pcEntry{seq: h, closed: true, wb: &tierWrite{t: t, parts: pe.parts}}
}

// truncating writes down, before s (an origin) truncates to n tokens, the blocks of
// its evicted lazy entries at or past the one holding token n, which the truncate
// gives up or lets s write anew. s's ranges lock is held, not pc.mu.
func (t *pcTiers) truncating(pc *PrefixCache, s *Sequence, n int) {
	if t == nil {
		return
	}
	b := n / t.c.tpb
	var cut []tierPart
	pc.mu.Lock()
	if pe := t.pending[s]; pe != nil {
		keep := pe.parts[:0]
		for _, p := range pe.parts {
			if p.last > b {
				c := p
				c.first = max(c.first, b)
				cut = append(cut, c)
				p.last = b
			}
			if p.first < p.last {
				keep = append(keep, p)
			}
		}
		pe.parts = keep
		if len(keep) == 0 {
			delete(t.pending, s)
		}
	}
	pc.mu.Unlock()
	if len(cut) > 0 && s.err == nil {
		t.writeBack(context.Background(), s, &tierWrite{t: t, parts: cut})
	}
}

// load extends s, a lookup's new sequence holding the prompt's first m tokens, by the
// blocks of tokens that follow which the tiers hold under namespace ns, asking them in
// order, up to limit tokens, within the wait and until parent ends, as far as the
// device's budget holds them (grow).
// Each value is checked against the prompt's tokens before its bytes are copied into
// s's own fresh granules; the first block that fails ends the run, and s keeps the
// tokens before it. It returns s's length. No lock is held.
func (t *pcTiers) load(parent context.Context, ns Namespace, s *Sequence, tokens []int32, m, limit int) int {
	if !t.asks(m, limit) {
		return m
	}
	bt := t.c.tpb
	ctx, cancel := t.loadContext(parent)
	defer cancel()
	keys := t.keys(t.spaceNS(ns), tokens[:limit/bt*bt], m/bt)
	b := m / bt // the next block to load
	for i, tier := range t.tiers {
		if len(keys) == 0 || ctx.Err() != nil {
			break
		}
		got, full := t.loadFrom(ctx, i, tier, s, tokens, b, keys)
		if got == 0 {
			if !callerEnded(ctx) { // a cancel is neither the tier's miss nor its drop
				t.count(i, func(st *TierStats) { st.Misses++ })
			}
		} else {
			n := max(m, (b+got)*bt)
			t.count(i, func(st *TierStats) { st.Hits += int64(n - m) })
			m, b, keys = n, b+got, keys[got:]
		}
		if full {
			break // the budget holds no more blocks, from any tier
		}
	}
	// NB: a Truncate that failed left s fewer tokens, all checked ones.
	return min(m, s.n)
}

// loadFrom loads from tier i the longest run of keys it holds, blocks b on, into s,
// or as much of its start as the device's budget takes (grow), and returns the blocks
// loaded and whether the budget cut the run; s holds the loaded blocks (and nothing
// past them) on return. It holds a load slot (takeLoad) meanwhile.
func (t *pcTiers) loadFrom(ctx context.Context, i int, tier Tier, s *Sequence, tokens []int32, b int, keys []tierval.Key) (int, bool) {
	if !t.takeLoad(ctx, i) {
		return 0, false
	}
	defer func() { <-t.loads }()
	bt, unit := t.c.tpb, t.c.unit
	before := s.n
	run, short, ok := t.loadRun(ctx, i, tier, s, b, keys)
	if !ok {
		return 0, false
	}
	decode := tierval.Decode
	if t.inProc[i] {
		decode = tierval.DecodeInProcess
	}
	got := 0
	for ; got < run; got++ {
		blk := b + got
		want := tokens[blk*bt : (blk+1)*bt]
		var invalid bool
		var size int
		err := tier.Load(ctx, keys[got], func(src []byte) error {
			payload, err := decode(src, keys[got], want, unit)
			if err != nil {
				invalid = true
				return err
			}
			size = len(src)
			return s.bufs[0].writeAt(blk*unit, payload)
		})
		if err != nil {
			t.loadFailed(ctx, i, blk, err, invalid)
			break
		}
		t.count(i, func(st *TierStats) { st.LoadBytes += int64(size) })
	}
	if keep := max(before, (b+got)*bt); keep < s.n {
		if err := s.Truncate(keep); err != nil {
			// It left s the whole tokens below a granule it could not keep, all
			// checked (load takes no more than s holds).
			return max(s.n/bt-b, 0), short
		}
	}
	return got, short
}

// asks reports whether a lookup that matched m tokens on the device, of at most limit
// (PrefixCache.matchable), asks the tiers for more: a whole tier block lies between
// them. False without tiers.
func (t *pcTiers) asks(m, limit int) bool {
	return t != nil && limit/t.bt*t.bt > m
}

// errTierWait is the cause of a lookup's loads ending at TierWait (loadContext).
var errTierWait = errors.New("kv: the tiers' wait (TierWait) ran out")

// loadContext returns the context of a lookup's loads from the tiers: parent (the
// caller's: context.Background for Lookup, LookupAsync's own), and at most the tiers'
// wait, which ends it with the cause errTierWait.
func (t *pcTiers) loadContext(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(parent, t.wait, errTierWait)
}

// callerEnded reports whether ctx, a lookup's loads' (loadContext), ended because its
// caller ended it (LookupAsync's context canceled or past its deadline) rather than at
// the tiers' wait: the tier did not fail, so no drop is counted.
func callerEnded(ctx context.Context) bool {
	return ctx.Err() != nil && !errors.Is(context.Cause(ctx), errTierWait)
}

// takeLoad takes one of the slots of the lookups that load from the tiers at once
// (TierLoads), waiting for one within ctx; false, a drop of tier i (counted), when ctx
// ended first. The caller gives the slot back once its loads from tier i ended. No
// lock is held. (Where the lookup's caller ended ctx, nothing is counted.)
func (t *pcTiers) takeLoad(ctx context.Context, i int) bool {
	select {
	case t.loads <- struct{}{}:
		return true
	default:
	}
	if f := t.onLoadWait; f != nil {
		f()
	}
	select {
	case t.loads <- struct{}{}:
		return true
	case <-ctx.Done():
		if !callerEnded(ctx) {
			t.count(i, func(st *TierStats) { st.Drops++ })
		}
		return false
	}
}

// loadRun asks tier i how long a run of keys, blocks b on, it holds, and grows s for
// as much of it as the device's budget takes (grow). It returns the run to load,
// whether the budget cut it, and false where there is nothing to load: the tier holds
// none, or failed (counted a drop), or the growth failed other than for the budget (a
// commit the backing refused: a drop of this load, not a budget cut, so the next tier
// is asked for the run).
func (t *pcTiers) loadRun(ctx context.Context, i int, tier Tier, s *Sequence, b int, keys []tierval.Key) (int, bool, bool) {
	run, err := tier.Contains(ctx, keys)
	if err != nil || run <= 0 {
		if err != nil && !callerEnded(ctx) {
			t.count(i, func(st *TierStats) { st.Drops++ })
		}
		return 0, false, false
	}
	run = min(run, len(keys))
	// NB: on a model of recurrent groups the blocks past the last value with states
	// serve nothing, yet the load reads them (and cuts them off): peeking first, as
	// Probe does, would spend the tiers' wait on the peeks before any load on a slow
	// tier, and leave a value damaged past its head unread, neither counted nor
	// deleted.
	fit, err := t.grow(s, b, run)
	if err != nil {
		t.count(i, func(st *TierStats) { st.Drops++ })
		return 0, false, false
	}
	if fit < run {
		t.count(i, func(st *TierStats) { st.Unfit += int64(run - fit) })
	}
	return fit, fit < run, true
}

// grow appends to s, which holds the tokens before block b (or part of b), blocks
// [b, b+run) for a load, or the longest start of them that the device's budget holds,
// cached prefixes evicted first as for any growth, and returns how many blocks s now
// holds room for. It sizes the start by Need against Headroom, so that no growth is
// refused for budget unless the memory went elsewhere meanwhile; then it tries one
// block fewer at each refusal. An error other than a refusal for budget is returned
// with 0 blocks, s unchanged. No lock is held.
func (t *pcTiers) grow(s *Sequence, b, run int) (int, error) {
	bt := t.bt
	tokens := func(k int) int { return (b+k)*bt - s.n }
	fit := func(below int) int {
		head := t.c.Headroom()
		// The most blocks, up to below, whose growth needs no more than head.
		return sort.Search(below+1, func(k int) bool {
			if k == 0 {
				return false
			}
			need, err := s.Need(tokens(k))
			return err != nil || need > head
		}) - 1
	}
	for k := fit(run); k > 0; k = fit(k - 1) {
		err := s.Append(tokens(k))
		if err == nil {
			return k, nil
		}
		if !errors.Is(err, accounting.ErrBudgetExceeded) {
			return 0, err
		}
	}
	return 0, nil
}
