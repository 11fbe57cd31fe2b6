package kv

import (
	"context"
	"fmt"
	"slices"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/kv/tierval"
)

// The question a scheduler or a router asks before it admits or places a request
// (Probe): where the prompt's tokens are held, and what a Lookup of it would commit.

// MaxTiers is the most tiers a PrefixCache takes (PrefixCacheOptions.Tiers): a
// Probe counts each one's tokens in an array of that length, so that the question
// allocates nothing.
const MaxTiers = 8

// Probe is what a Lookup of a prompt would find now (PrefixCache.Probe): the tokens
// of it that the device holds, those each tier holds past them, and the bytes the
// Lookup would commit. Its zero value is a prompt that nothing holds.
type Probe struct {
	// Device is the tokens a Lookup would map from the device's cached prefixes:
	// Match's answer (at most len(tokens)-1).
	Device int
	// Tiers[i] is the tokens past Device and past the earlier tiers' that tier i
	// (PrefixCacheOptions.Tiers[i]) holds, whole blocks in a run, that a Lookup
	// would serve from it, asking the tiers in order as it does (on a model of
	// window or recurrent groups, up to the last block the window rule and the
	// states let it start on; see PrefixCache.Probe). Tiers past the cache's are 0.
	Tiers [MaxTiers]int
	// Total is Device plus every Tiers[i]: the tokens a Lookup would start on, the
	// rest to prefill, when the tiers' loads succeed and the budget takes them.
	Total int
	// Commit is the bytes of granules the Lookup would commit: the device hit's
	// partly filled last unit, copied, and the granules the tier loads fill. The
	// whole units of the device hit are mapped and commit nothing. It is the
	// Lookup's part of Need, which adds the prefill of the tokens past the device
	// hit (Need counts no tier) and subtracts the pool's idle granules.
	Commit int64
}

// Tiered returns the tokens the tiers hold past the device's: Total - Device.
func (p Probe) Tiered() int { return p.Total - p.Device }

// Probe answers, for the prompt tokens of the default namespace, how many of its
// tokens the device holds, how many each tier holds past them, in total, and what a
// Lookup would commit (see Probe), and changes nothing: as Match, it makes no
// sequence, counts no query (nor a tier's hit or miss in TierStats), copies nothing,
// loads nothing and marks no entry used. It allocates nothing (but see below for
// tiers that are not in-process).
//
// A scheduler asks it before admission, a router to place a request where most of
// its prompt is held: the tokens to prefill are len(tokens) - Total, and those to
// load from the tiers Tiered; Need (with Cache.Headroom) says whether the request's
// memory fits. The answer holds for a Lookup made now: an eviction, an insert or
// another request's Lookup may change it before the Lookup is made. Where the budget
// can not take all of the tier loads, a Lookup loads fewer of them (TierStats.Unfit)
// and Commit is an upper bound; so it is on a miss that takes over an evicted entry's
// committed granules (see Lookup). On a model of several groups with window or
// recurrent groups (gpt-oss's, Gemma-3's, Llama-4's, Qwen3-Next's), a Lookup serves a
// tier's run only up to the last block at which every window group holds what the
// step reads and, with recurrent groups, whose value carries the states
// (prefixcache_tier_groups.go); Probe finds it from the lengths of the values' parts,
// peeking at their heads (TierPeeker, which kvtier's tiers implement) from the last
// block back, and at the blocks before it whose tokens the step there reads: what the
// Lookup serves where each value is whole. A value the load would refuse below the
// blocks peeked at, or damaged past its head, is not seen; from a tier that can not
// peek, or whose peek fails, it counts the run. Each is an upper bound.
//
// Without tiers it costs about a Match (BenchmarkProbe). With tiers, past a device
// hit that does not cover the prompt, it also hashes the prompt's whole blocks (as
// Lookup does: most of its cost then) and asks each tier's Contains at most once, in
// order, for the blocks past those the earlier ones hold (and, on a model of window
// or recurrent groups, peeks at the heads of values, a few hundred bytes each: from
// the end of each run back to the last block a Lookup would serve, and at the blocks
// before each candidate that the step there reads; one where the last block serves
// and its step reads no further back, as many as the run's blocks where none
// serves), with no lock held and none of the cache's load slots taken
// (TierLoads; a tier's own bound, as the file tier's Loads, may hold a peek): no data
// moves, but Contains (and a peek) on a remote tier is a round trip, bounded
// by TierWait (kvtier/redistier's is one pipelined EXISTS per block, which its own
// counters see; kvtier/hosttier's and filetier's a map lookup per block under their
// lock). Only with tiers that are all in-process (InProcessTier) does it allocate
// nothing: another's wait needs a context with a timer.
//
// It fails with ErrTooLong for a prompt longer than MaxTokens and with ErrClosed
// once the prefix cache is closed (where Match answers 0).
func (pc *PrefixCache) Probe(tokens []int32) (Probe, error) {
	return pc.ProbeIn(Namespace{}, tokens)
}

// ProbeIn is Probe for a prompt of namespace ns: it counts ns's entries, and ns's
// blocks in the tiers, never another namespace's, as LookupIn would.
func (pc *PrefixCache) ProbeIn(ns Namespace, tokens []int32) (Probe, error) {
	c := pc.c
	if len(tokens) > c.cfg.MaxTokens {
		return Probe{}, fmt.Errorf("%w: a prompt of %d tokens, MaxTokens %d", ErrTooLong, len(tokens), c.cfg.MaxTokens)
	}
	limit := pc.matchable(tokens)
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return Probe{}, ErrClosed
	}
	m := pc.peekLocked(pc.space(ns, false), tokens[:limit])
	pc.mu.Unlock()
	switch {
	case pc.tiers != nil:
		return pc.probeTiers(ns, tokens, m, limit), nil
	case m == 0:
		return Probe{}, nil
	}
	return Probe{Device: m, Total: m, Commit: c.tailNeed(m)}, nil
}

// tailNeed is shareNeed(m), on one group of the Blocked layout with one division
// (a division is most of a Probe's cost past Match's).
func (c *Cache) tailNeed(m int) int64 {
	if c.multi || c.layout != Blocked || c.state > 0 {
		return c.shareNeed(m)
	}
	q, r := m/c.tpb, m%c.tpb
	units := q
	if r > 0 {
		units++
	}
	size, _ := backing.AlignUp(units*c.blk, c.gran)
	return int64(c.nbuf) * int64(size-q*c.unit)
}

// probeTiers is ProbeIn's answer past a device hit of m tokens, asking the tiers.
func (pc *PrefixCache) probeTiers(ns Namespace, tokens []int32, m, limit int) Probe {
	p := Probe{Device: m}
	p.Total = pc.tiers.probe(ns, tokens, m, limit, &p.Tiers)
	p.Commit = pc.c.commitOf(m, p.Total)
	return p
}

// commitOf returns the bytes a lookup that maps a hit of m tokens and then holds n
// (loaded from the tiers past m, or n == m) commits: the hit's whole units are
// mapped; the granules past them up to n's end are committed: the copied tail, then
// the loads' growth (the block holding the hit's last token loaded whole over its
// copy).
func (c *Cache) commitOf(m, n int) int64 {
	switch {
	case n == 0:
		return 0
	case n == m:
		return c.shareNeed(m)
	case c.multi:
		return c.needGroups(n, m)
	}
	size, _ := backing.AlignUp(c.extent(n), c.gran)
	return int64(c.nbuf) * int64(size-c.shareable(m))
}

// probe is load's question: it returns the tokens a lookup holding the prompt's
// first m would hold after its loads from the tiers (asked in order, each for the
// whole blocks past what the earlier ones hold, up to limit tokens), and sets
// held[i] to tier i's part, assuming every load succeeds and the budget takes it. It
// asks each tier's Contains and, on a model of window or recurrent groups, peeks at
// values (lastServed), no more, and counts nothing. No lock is held.
func (t *pcTiers) probe(ns Namespace, tokens []int32, m, limit int, held *[MaxTiers]int) int {
	if !t.asks(m, limit) {
		return m
	}
	bt := t.bt
	sc := probeScratches.Get().(*probeScratch)
	defer probeScratches.Put(sc)
	sc.hashes = t.hash.Chain(sc.hashes[:0], t.hash.Root(), 0, tokens[:limit/bt*bt])
	space := t.spaceNS(ns)
	keys := sc.keys[:0]
	for _, h := range sc.hashes[m/bt:] {
		keys = append(keys, tierval.Key{Namespace: space, Hash: h.Uint64()})
	}
	sc.keys = keys
	// In-process tiers answer at once: the wait's context (and its timer) is made
	// only where a tier may wait.
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if slices.Contains(t.inProc, false) {
		ctx, cancel = context.WithTimeout(ctx, t.wait)
	}
	defer cancel()
	b, dev := m/bt, m
	for i, tier := range t.tiers {
		if len(keys) == 0 || ctx.Err() != nil {
			break
		}
		run, err := tier.Contains(ctx, keys)
		if err != nil || run <= 0 {
			continue // as load: a failed Contains is a miss of that tier
		}
		run = t.lastServed(ctx, i, keys[:min(run, len(keys))], b, dev, sc)
		if run == 0 {
			continue // as loadGroups: nothing served, the next tier asked from m
		}
		n := max(m, (b+run)*bt)
		held[i] = n - m
		m, b, keys = n, b+run, keys[run:]
	}
	return m
}
