package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// The strategies of the prefix-cache replay (a trace with token IDs: Mooncake).
const (
	namePrefixOn  = "vmarena+prefix-cache"
	namePrefixOff = "vmarena"
	namePagedPC   = "paged+prefix-cache"
)

var prefixStrategies = []string{namePrefixOn, namePrefixOff, namePagedPC}

// DefaultPrefillRate is the default -prefill-rate: prompt tokens a server prefills per
// second of model time. Prefill is compute-bound at about 2 FLOP per parameter per
// token: 1 GFLOP for Qwen2.5-0.5B, 2.5 GFLOP for Llama-3.2-1B. 50,000 tokens/s is 50 to
// 125 TFLOP/s, 5 to 13% of an H100 SXM's dense FP16 peak of 989 TFLOP/s (NVIDIA's
// H100 datasheet): a rate a single GPU sustains on long prompts, whose attention adds
// to the count. At 25 ms per decode step a 12,000-token prompt then costs 0.24 s, about
// ten decode steps, so what the cache saves shows in time to first token without
// drowning the decode time.
const DefaultPrefillRate = 50000

// pseq is a sequence of a prefix strategy.
type pseq interface {
	Append(n int) error
	Len() int
}

// pstrategy is what the prefix-cache replay drives: a memory layer with a prefix cache
// (or without one: lookup then starts every sequence empty).
type pstrategy interface {
	Name() string
	// lookup starts a sequence on the longest cached prefix of tokens of adapter a
	// and returns how many tokens that is.
	lookup(a padapter, tokens []int32) (pseq, int, error)
	// insert caches the sequence's first len(tokens) tokens, of adapter a.
	insert(a padapter, s pseq, tokens []int32) error
	write(s pseq, from, to int, fill []byte) error
	// writeToken and readToken write and read one token's K (v 0) or V (v 1) of one
	// layer: what the replay uses when it checks the bytes it reads back.
	writeToken(s pseq, layer, v, token int, src []byte) error
	readToken(s pseq, layer, v, token int, dst []byte) error
	closeSeq(s pseq) error
	// physical returns the bytes held now and the peak.
	physical() (now, peak int64)
	// cached returns the bytes the prefix cache holds and the packed floor of its
	// tokens (their bytes with no partly filled granule or block).
	cached() (bytes, floor int64)
	// idle gives back what a pool keeps idle for future growth and returns the bytes.
	trim() int64
	Close() error
}

// kvPrefix is vmarena's cache, with a prefix cache or without.
type kvPrefix struct {
	name string
	cs   *cacheStrategy
	pc   *kv.PrefixCache // nil: prefix caching off
	g    kv.Model
	// plan is each layer's tensors on a model of layer groups (planLayers), nil on
	// a uniform model; bpt the model's bytes per token.
	plan []layerPlan
	bpt  int
	// tiers close the prefix cache's tiers, after it and before the cache (nil
	// without tiers); tierList are the tiers, tierStores count the values each
	// kept, each a block of blockTokens tokens.
	tiers       func() error
	tierList    []kv.Tier
	tierStores  []func() int64
	blockTokens int
	// every is the tokens between recurrent-state checkpoints on a model with
	// recurrent groups (checkpoints.go); 0 elsewhere.
	every int
}

func (k *kvPrefix) Name() string { return k.name }

func (k *kvPrefix) lookup(a padapter, tokens []int32) (pseq, int, error) {
	if k.pc == nil {
		s, err := k.cs.c.NewSequence()
		if err != nil {
			return nil, 0, err
		}
		return s, 0, nil
	}
	s, m, err := k.pc.LookupIn(a.ns, tokens)
	if err != nil {
		return nil, 0, err
	}
	return s, m, nil
}

func (k *kvPrefix) insert(a padapter, s pseq, tokens []int32) error {
	if k.pc == nil {
		return nil
	}
	return k.pc.InsertIn(a.ns, s.(*kv.Sequence), tokens)
}

func (k *kvPrefix) write(s pseq, from, to int, fill []byte) error {
	q := s.(*kv.Sequence)
	if k.plan == nil {
		return writeLayerMajor(q.WriteToken, kv.K, kv.V, k.g.Layers, from, to, fill)
	}
	for l, p := range k.plan {
		// A window layer's tokens below FirstHeld were given back (the tokens of a
		// prefill chunk that its later queries skip): nothing to write there.
		for t := max(from, q.FirstHeld(l)); t < to; t++ {
			for _, v := range p.kinds {
				if err := q.WriteToken(l, kvKind(int(v)), t, fill[:p.tokenBytes]); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func (k *kvPrefix) writeToken(s pseq, layer, v, token int, src []byte) error {
	return s.(*kv.Sequence).WriteToken(layer, kvKind(v), token, src)
}

func (k *kvPrefix) readToken(s pseq, layer, v, token int, dst []byte) error {
	return s.(*kv.Sequence).ReadToken(layer, kvKind(v), token, dst)
}

// kvKind returns K for 0 and V for 1.
func kvKind(v int) kv.Kind {
	if v == 0 {
		return kv.K
	}
	return kv.V
}

func (k *kvPrefix) closeSeq(s pseq) error {
	if out := s.(*kv.Sequence).Close(); !out.OK() {
		return fmt.Errorf("kv: sequence close: %v", out)
	}
	return nil
}

func (k *kvPrefix) physical() (int64, int64) {
	st := k.cs.auth.Stats()
	return st.Owned, st.OwnedPeak
}

func (k *kvPrefix) cached() (int64, int64) {
	if k.pc == nil {
		return 0, 0
	}
	st := k.pc.Stats()
	return st.CachedBytes, st.CachedTokens * int64(k.bpt)
}

func (k *kvPrefix) trim() int64 {
	if k.cs.pool == nil {
		return 0
	}
	n, _ := k.cs.pool.Trim(0)
	return n
}

func (k *kvPrefix) Close() error {
	var err error
	if k.pc != nil {
		err = k.pc.Close()
	}
	if k.tiers != nil {
		err = errors.Join(err, k.tiers())
	}
	return errors.Join(err, k.cs.Close())
}

// pagedPrefix is the paged baseline with its vLLM-style prefix cache.
type pagedPrefix struct {
	p     *baseline.Paged
	shape baseline.Shape
}

func (p *pagedPrefix) Name() string { return namePagedPC }

func (p *pagedPrefix) lookup(a padapter, tokens []int32) (pseq, int, error) {
	return p.p.Lookup(a.apart(tokens))
}

func (p *pagedPrefix) insert(a padapter, s pseq, tokens []int32) error {
	return p.p.Insert(s.(baseline.Sequence), a.apart(tokens))
}

func (p *pagedPrefix) write(s pseq, from, to int, fill []byte) error {
	return writeLayerMajor(s.(baseline.Sequence).WriteToken, baseline.K, baseline.V, p.shape.Layers, from, to, fill)
}

func (p *pagedPrefix) writeToken(s pseq, layer, v, token int, src []byte) error {
	return s.(baseline.Sequence).WriteToken(layer, pagedKind(v), token, src)
}

func (p *pagedPrefix) readToken(s pseq, layer, v, token int, dst []byte) error {
	// Every baseline sequence reads tokens back, though baseline.Sequence does not
	// say so.
	r := s.(interface {
		ReadToken(layer int, v baseline.Kind, token int, dst []byte) error
	})
	return r.ReadToken(layer, pagedKind(v), token, dst)
}

// pagedKind returns K for 0 and V for 1.
func pagedKind(v int) baseline.Kind {
	if v == 0 {
		return baseline.K
	}
	return baseline.V
}

func (p *pagedPrefix) closeSeq(s pseq) error { return s.(baseline.Sequence).Close() }

func (p *pagedPrefix) physical() (int64, int64) {
	st := p.p.Stats()
	return st.Physical, st.PeakPhysical
}

func (p *pagedPrefix) cached() (int64, int64) {
	st := p.p.PrefixStats()
	return st.CachedBytes, st.CachedBytes // whole blocks of cached tokens: packed
}

func (p *pagedPrefix) trim() int64 { return 0 } // the pool never shrinks

func (p *pagedPrefix) Close() error { return p.p.Close() }

// buildPrefixReplica makes the prefix strategy called name under s's budget, for
// one of the replicas of a tiered strategy, numbered from 0 (0 when there is one),
// each with a cache and a host tier of its own.
func buildPrefixReplica(name string, s setup, replica int) (pstrategy, *accounting.Governor, error) {
	base, off := splitAhead(name)
	if off {
		s.mapAhead = false
	}
	switch base {
	case namePrefixOn, namePrefixOff, namePrefixTiers:
		if name == namePrefixTiers && s.tiers == nil {
			return nil, nil, errors.New(namePrefixTiers + " needs -tiers")
		}
		b, err := build(nameCache, s)
		if err != nil {
			return nil, nil, err
		}
		cs := b.st.(*cacheStrategy)
		k := &kvPrefix{name: name, cs: cs, g: s.model, plan: planLayers(s.groups), bpt: s.model.BytesPerToken()}
		if s.groups != nil {
			k.bpt = s.groups.BytesPerToken()
		}
		var opts kv.PrefixCacheOptions
		if name == namePrefixTiers {
			if k.blockTokens, err = blockTokens(cs.c); err != nil {
				return nil, nil, errors.Join(err, cs.Close())
			}
			vs, err := kv.TierValueSize(cs.c.Config(), cs.c.Granularity())
			if err != nil {
				return nil, nil, errors.Join(err, cs.Close())
			}
			bt, err := s.tiers.build(b.gov, replica, vs)
			if err != nil {
				return nil, nil, errors.Join(err, cs.Close())
			}
			opts = s.tiers.options(bt)
			k.tiers, k.tierList, k.tierStores = bt.close, bt.tiers, bt.stores
		}
		if base != namePrefixOff {
			if k.pc, err = kv.NewPrefixCache(cs.c, opts); err != nil {
				if k.tiers != nil {
					err = errors.Join(err, k.tiers())
				}
				return nil, nil, errors.Join(err, cs.Close())
			}
			if hasRecurrent(s.groups) {
				k.every = MooncakeBlockTokens
			}
		}
		return k, b.gov, nil
	case namePagedPC:
		gov, auth, err := s.newGovernor(name, accounting.HostKey)
		if err != nil {
			return nil, nil, err
		}
		o := baseline.PagedOptions{Authority: auth, PrefixCache: true}
		if s.budget > 0 {
			block := int64(baseline.DefaultBlockTokens * s.shape().BytesPerToken())
			o.ChunkBlocks = int(max(1, min(baseline.DefaultChunkBytes, s.budget/16)/block))
		}
		p, err := baseline.NewPaged(s.shape(), o)
		if err != nil {
			return nil, nil, err
		}
		return &pagedPrefix{p: p, shape: s.shape()}, gov, nil
	}
	return nil, nil, fmt.Errorf("unknown prefix-cache strategy %q (known: %v)", name, prefixStrategies)
}

// PrefixWorkload is what the prefix-cache replay serves.
type PrefixWorkload struct {
	Requests    []Request // with Blocks
	Speed       float64
	Step        time.Duration // model time of one decode step
	PrefillRate float64       // prompt tokens prefilled per second of model time
	Concurrency int
	MaxTokens   int
	TokenBytes  int
	Layers      int
	// Plan is each layer's tensors on a model of layer groups (planLayers); nil on
	// a uniform model, whose every layer keeps K and V of TokenBytes.
	Plan []layerPlan
	// Groups is the model of layer groups, for the live tokens' need (liveNeed);
	// nil on a uniform model.
	Groups *kv.Model
	// Verify writes every prompt token's K and V as a function of the tokens up to
	// it (as a model's are), and of its adapter, and reads every hit token back and
	// compares: a failure of the replay if one byte differs.
	Verify bool
	// Adapters is the LoRA adapters the requests are served under, request i (in
	// Requests' order) under adapter i mod Adapters; 0 or 1: the base model only.
	Adapters int
	// Causes counts what each decode step paid, by cause (causes.go), as
	// Workload.Causes does.
	Causes bool
}

// PrefixSample is one reading, after a batch iteration.
type PrefixSample struct {
	At       time.Duration
	Physical int64
	Cached   int64
	HitRate  float64 // cumulative, in tokens
}

// PrefixResult is what one strategy did.
type PrefixResult struct {
	Strategy                      string
	Requests, Completed, Rejected int
	Clipped, Preempted            int
	Queries, Hits, IdealHits      int64 // prompt tokens
	TTFTP50, TTFTP99              time.Duration
	// StepP50 and StepP99 are the wall time of one request's decode step in the
	// memory layer (append one token, write its K and V in every layer), as in
	// Result: fair timing compares them.
	StepP50, StepP99         time.Duration
	Makespan                 time.Duration
	PeakPhysical, PeakNeeded int64
	Waste                    float64 // share of held memory not holding live tokens, over time
	MemoryTime               time.Duration
	// After the load stopped (every sequence closed): what the strategy holds, what
	// the pool kept idle and gave back on a trim, and what the prefix cache holds
	// with its packed floor.
	After, Trimmed, CachedAfter, FloorAfter int64
	Samples                                 []PrefixSample
	Wall                                    time.Duration
	// With tiers: the prompt tokens of Hits that each tier gave (in the order of
	// -tiers; the rest came from the device), the prefix cache's counts of each at
	// the end, and the blocks loaded from the shared tier that another replica had
	// stored there.
	TierHits     []int64        `json:",omitempty"`
	Tiers        []kv.TierStats `json:",omitempty"`
	ForeignLoads int64          `json:",omitempty"`
	// EvictedTokens is the tokens the prefix cache evicted, WrittenTokens those of
	// the blocks each tier kept: what eviction wrote down, less what a tier dropped.
	EvictedTokens int64   `json:",omitempty"`
	WrittenTokens []int64 `json:",omitempty"`
	Verified      int64   `json:",omitempty"` // hit tokens read back and compared
	// With tiers, the lookups asked first what they would find (kv.Probe) whose
	// loads all succeeded (no value unfit, dropped or invalid) and whose own
	// evictions stored nothing into a tier (see loadsWhole), and of them those that
	// started on exactly the tokens Probe said.
	Probed, ProbeExact int64 `json:",omitempty"`
	// With Adapters above 1, per adapter: its prompt tokens looked up, found cached,
	// and found by an unbounded cache of its own; and what one unbounded cache that
	// every adapter shared would find (hits that cross adapters among them).
	AdapterQueries []int64 `json:",omitempty"`
	AdapterHits    []int64 `json:",omitempty"`
	AdapterIdeal   []int64 `json:",omitempty"`
	SharedIdeal    int64   `json:",omitempty"`
	// Causes is, with PrefixWorkload.Causes, what the decode steps paid by cause
	// (Result.Causes).
	Causes []CauseClass `json:",omitempty"`
	// On a model with recurrent groups: the checkpoints the prefills recorded, the
	// bytes of one, and the bytes the prefix cache's entries held of them at the
	// peak (sampled after each iteration) and once the load stopped.
	Checkpoints     int64 `json:",omitempty"`
	CheckpointSize  int64 `json:",omitempty"`
	CheckpointPeak  int64 `json:",omitempty"`
	CheckpointBytes int64 `json:",omitempty"`
}

// preq is a request during the prefix replay.
type preq struct {
	Request
	tokens   []int32 // the prompt's token IDs, clipped
	adapter  padapter
	gen      int
	seq      pseq
	done     int
	hit      int
	arrived  time.Duration
	counted  bool // its lookup counted in the hit rate
	first    bool // its first token was produced
	liveKeys []uint64
	prefix   []uint64 // with Verify, while admitted: prefixHashes(tokens)
}

// IdealHits returns the prompt tokens an unbounded cache would hold for each request
// (the longest prefix it shares with any earlier request, short of its last token),
// summed over reqs. It works block by block on the trace's hash ids (equal ids, equal
// tokens), each request's prompt clipped to its length in tokens.
func IdealHits(reqs []Request, lengths []int) int64 {
	hits, _ := IdealCache(reqs, lengths)
	return hits
}

// IdealCache returns IdealHits and the ideal cache's size in tokens: the distinct
// prompt tokens those hits read (each shared prefix once), which is what a cache must
// hold, and no more, to find every hit an unbounded one finds.
func IdealCache(reqs []Request, lengths []int) (hits, tokens int64) {
	type node struct {
		cover int // most tokens of this block any earlier prompt held
		used  int // most tokens of this block any hit read
		kids  map[int64]*node
	}
	root := &node{kids: map[int64]*node{}}
	var path []*node
	for i, r := range reqs {
		n, m, L := root, 0, lengths[i]
		path = path[:0]
		for b := 0; b*MooncakeBlockTokens < L; b++ {
			cover := min(MooncakeBlockTokens, L-b*MooncakeBlockTokens)
			c := n.kids[r.Blocks[b]]
			if c == nil {
				break
			}
			m += min(cover, c.cover)
			path = append(path, c)
			if c.cover < cover || cover < MooncakeBlockTokens {
				break
			}
			n = c
		}
		hit := min(m, max(L-1, 0))
		hits += int64(hit)
		// The hit reads each node on its path whole but the last, of which it reads
		// what is left.
		for j, c := range path {
			u := min(MooncakeBlockTokens, hit-j*MooncakeBlockTokens)
			if u > c.used {
				tokens += int64(u - c.used)
				c.used = u
			}
		}
		n = root
		for b := 0; b*MooncakeBlockTokens < L; b++ {
			cover := min(MooncakeBlockTokens, L-b*MooncakeBlockTokens)
			c := n.kids[r.Blocks[b]]
			if c == nil {
				c = &node{kids: map[int64]*node{}}
				n.kids[r.Blocks[b]] = c
			}
			c.cover = max(c.cover, cover)
			n = c
		}
	}
	return hits, tokens
}

// clipRequest returns the prompt and output tokens r is replayed with in a context
// window of maxTokens: at least one output token, and a request that does not fit
// clipped to half the window's output, the rest prompt.
func clipRequest(r Request, maxTokens int) (prompt, gen int, clipped bool) {
	prompt, gen = r.Context, max(r.Generated, 1)
	if prompt+gen > maxTokens {
		gen = min(gen, maxTokens/2)
		return maxTokens - gen, gen, true
	}
	return prompt, gen, false
}

// idealHitsAfter returns IdealHits of w's requests served once more after they were
// served before times (by other replicas, into a cache they share): what an
// unbounded shared cache finds for a replica that replays them then.
func idealHitsAfter(w PrefixWorkload, before int) int64 {
	var reqs []Request
	var lengths []int
	for range before + 1 {
		for _, r := range w.Requests {
			p, _, _ := clipRequest(r, w.MaxTokens)
			reqs, lengths = append(reqs, r), append(lengths, max(1, len(r.Tokens(p))))
		}
	}
	n := before * len(w.Requests)
	reqs = w.apart(reqs)
	return IdealHits(reqs, lengths) - IdealHits(reqs[:n], lengths[:n])
}

// idealCacheBytes returns the ideal cache of w (IdealCache) in tokens and in bytes.
func idealCacheBytes(w PrefixWorkload) (tokens, bytes int64) {
	lengths := make([]int, len(w.Requests))
	for i, r := range w.Requests {
		p, _, _ := clipRequest(r, w.MaxTokens)
		lengths[i] = max(1, len(r.Tokens(p)))
	}
	_, tokens = IdealCache(w.apart(w.Requests), lengths)
	return tokens, tokens * 2 * int64(w.Layers) * int64(w.TokenBytes)
}

// prefixBudget applies -budget-ideal (the budget a fraction of w's ideal cache, and
// the host tier's too where -host-tier-budget did not set it) and checks the flags
// that need the trace; it returns a nonzero exit status on a failure, reported on
// stderr.
func (c *config) prefixBudget(s *setup, w PrefixWorkload, stderr io.Writer) int {
	if s.tiers != nil && s.tiers.killAt > len(w.Requests) {
		fmt.Fprintf(stderr, "kvcache: -redis-kill-at %d: the replay has only %d requests\n", s.tiers.killAt, len(w.Requests))
		return 2
	}
	if c.budgetIdeal == 0 {
		return 0
	}
	tokens, bytes := idealCacheBytes(w)
	s.budget = int64(math.Ceil(c.budgetIdeal * float64(bytes)))
	if s.budget == 0 {
		fmt.Fprintf(stderr, "kvcache: -budget-ideal %v: the trace's ideal cache is empty (no request shares a prefix with an earlier one)\n", c.budgetIdeal)
		return 2
	}
	if s.tiers != nil && s.tiers.has(tierHost) && !c.set["host-tier-budget"] {
		s.tiers.hostBudget = s.budget
	}
	c.idealNote = fmt.Sprintf("%v of the ideal cache (%d distinct prompt tokens an unbounded cache's hits read, %s)",
		c.budgetIdeal, tokens, formatBytes(bytes))
	return 0
}

// ReplayPrefix serves w with st: each request looks its prompt up, prefills what was
// not cached (taking model time in proportion), inserts its prompt, then decodes one
// token per step in a continuous batch. It leaves st empty of sequences but open.
func ReplayPrefix(ctx context.Context, st pstrategy, w PrefixWorkload, progress func(done int)) (PrefixResult, error) {
	res := PrefixResult{Strategy: st.Name(), Requests: len(w.Requests)}
	if len(w.Requests) == 0 || w.Step <= 0 || w.PrefillRate <= 0 || w.Concurrency <= 0 {
		return res, fmt.Errorf("prefix replay: %d requests, step %v, prefill rate %v, concurrency %d", len(w.Requests), w.Step, w.PrefillRate, w.Concurrency)
	}
	var meter *causeMeter
	if w.Causes {
		m, stop, err := startCauses()
		if err != nil {
			return res, err
		}
		defer stop()
		meter = m
	}
	start := time.Now()
	bpt := 2 * int64(w.Layers) * int64(w.TokenBytes)
	reqs := make([]*preq, len(w.Requests))
	lengths := make([]int, len(w.Requests))
	for i, r := range w.Requests {
		ctxLen, gen, clipped := clipRequest(r, w.MaxTokens)
		q := &preq{Request: r, gen: gen, adapter: w.adapter(i)}
		if clipped {
			res.Clipped++
		}
		q.tokens = r.Tokens(ctxLen)
		if len(q.tokens) < 1 {
			q.tokens = []int32{TokenID(-1, i)}
		}
		reqs[i] = q
		lengths[i] = len(q.tokens)
	}
	res.IdealHits = IdealHits(w.apart(w.Requests), lengths)
	if w.Adapters > 1 {
		res.AdapterQueries, res.AdapterHits = make([]int64, w.Adapters), make([]int64, w.Adapters)
		res.AdapterIdeal = w.idealPerAdapter(lengths)
		res.SharedIdeal = IdealHits(w.Requests, lengths)
	}
	fill := make([]byte, planBytes(w.Plan, w.TokenBytes))
	for i := range fill {
		fill[i] = 0x5A
	}
	arrival := func(i int) time.Duration {
		if w.Speed == 0 {
			return 0
		}
		return time.Duration(float64(reqs[i].Arrival-reqs[0].Arrival) / w.Speed)
	}
	var (
		now                time.Duration
		next, finished     int
		waiting, running   []*preq
		ttfts              []time.Duration
		steps              []time.Duration
		retry              = true
		evicting           bool
		physSum, needSum   float64
		live               = map[uint64]int{} // block keys of live prompts, for the exact need
		liveTokens, shared int64
	)
	timed := func(f func() error) error {
		t0 := time.Now()
		err := f()
		res.MemoryTime += time.Since(t0)
		return err
	}
	release := func(q *preq) error {
		err := timed(func() error { return st.closeSeq(q.seq) })
		q.seq = nil
		for _, k := range q.liveKeys {
			if live[k]--; live[k] == 0 {
				delete(live, k)
			} else {
				shared -= MooncakeBlockTokens
			}
		}
		q.liveKeys = nil
		q.prefix = nil
		liveTokens -= int64(len(q.tokens) + q.done)
		return err
	}
	defer func() {
		for _, q := range running {
			_ = release(q)
		}
	}()
	// admit looks q up, prefills the rest and inserts the prompt; it returns the
	// prefilled tokens.
	scratch := make([]byte, planBytes(w.Plan, w.TokenBytes))
	tiered, _ := st.(tieredStrategy)
	if tiered != nil && tiered.tierStats() == nil {
		tiered = nil
	}
	if tiered != nil {
		res.TierHits = make([]int64, len(tiered.tierStats()))
	}
	cp, _ := st.(checkpointer)
	if cp != nil && cp.checkpointEvery() == 0 {
		cp = nil
	}
	admit := func(q *preq) (int, error) {
		var s pseq
		var m int
		var tierBefore []kv.TierStats
		var probe kv.Probe
		var probeErr error
		if tiered != nil {
			// Not timed: a scheduler's question before admission, checked against
			// what the lookup then starts on.
			probe, probeErr = tiered.probe(q.adapter, q.tokens)
			tierBefore = tiered.tierStats()
		}
		err := timed(func() error {
			var err error
			s, m, err = st.lookup(q.adapter, q.tokens)
			return err
		})
		if err == nil && tiered != nil && probeErr == nil && loadsWhole(tierBefore, tiered.tierStats()) {
			res.Probed++
			if probe.Total == m {
				res.ProbeExact++
			}
		}
		if err == nil && w.Verify && cp != nil {
			// Not timed; before the prefill steps the states on from the hit's.
			if err = verifyStates(s, q, m, w); err != nil {
				_ = st.closeSeq(s)
			}
		}
		if err == nil {
			err = timed(func() error {
				made, err := prefillPrompt(st, s, q, m, fill, scratch, w)
				res.Checkpoints += int64(made)
				if err == nil {
					err = st.insert(q.adapter, s, q.tokens)
					if errors.Is(err, accounting.ErrBudgetExceeded) {
						err = nil // not cached: the request goes on
					}
				}
				if err != nil {
					_ = st.closeSeq(s)
				}
				return err
			})
		}
		if err == nil && w.Verify {
			// Not timed: the check is the replay's, not the memory layer's.
			err = verifyHit(st, s, q, m, w, scratch)
			res.Verified += int64(m)
			if err != nil {
				_ = st.closeSeq(s)
			}
		}
		if err != nil {
			return 0, err
		}
		q.seq, q.hit = s, m
		if !q.counted {
			q.counted = true
			res.Queries += int64(len(q.tokens))
			res.Hits += int64(m)
			if res.AdapterQueries != nil {
				res.AdapterQueries[q.adapter.index] += int64(len(q.tokens))
				res.AdapterHits[q.adapter.index] += int64(m)
			}
			if tiered != nil {
				now := tiered.tierStats()
				for i := range now {
					res.TierHits[i] += now[i].Hits - tierBefore[i].Hits
				}
			}
		}
		// Whole 512-token blocks of the prompt count once among live requests.
		var h uint64
		for b := 0; (b+1)*MooncakeBlockTokens <= len(q.tokens); b++ {
			h = h*1000003 + uint64(q.Blocks[b]) + 1
			if live[h]++; live[h] > 1 {
				shared += MooncakeBlockTokens
			}
			q.liveKeys = append(q.liveKeys, h)
		}
		liveTokens += int64(len(q.tokens))
		return len(q.tokens) - m, nil
	}
	for finished < len(reqs) {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		for next < len(reqs) && arrival(next) <= now {
			reqs[next].arrived = now
			waiting = append(waiting, reqs[next])
			next++
		}
		if len(running) == 0 && len(waiting) == 0 {
			now = arrival(next)
			continue
		}
		prefill := 0
		var firsts []*preq
		for len(waiting) > 0 && len(running) < w.Concurrency && retry && !evicting {
			q := waiting[0]
			n, err := admit(q)
			if err != nil && !errors.Is(err, accounting.ErrBudgetExceeded) {
				return res, fmt.Errorf("request %d: %w", q.ID, err)
			}
			if err != nil {
				if len(running) == 0 || errors.Is(err, accounting.ErrExceedsLimit) {
					res.Rejected++
					waiting = waiting[1:]
					finished++
					progress(finished)
					continue
				}
				retry = false
				break
			}
			waiting = waiting[1:]
			prefill += n
			running = append(running, q)
		}
		// The iteration: the admitted requests' prefill, then one decode step of
		// every running request (the first token of those just admitted).
		progressed := false
		for i := 0; i < len(running); i++ {
			q := running[i]
			meter.begin()
			t0 := time.Now()
			err := timed(func() error {
				if err := q.seq.Append(1); err != nil {
					return err
				}
				t := q.seq.Len() - 1
				return st.write(q.seq, t, t+1, fill)
			})
			dt := time.Since(t0)
			meter.stop()
			if errors.Is(err, accounting.ErrBudgetExceeded) {
				continue
			}
			if err != nil {
				return res, fmt.Errorf("request %d: decode: %w", q.ID, err)
			}
			meter.end(dt)
			steps = append(steps, dt)
			progressed = true
			q.done++
			liveTokens++
			if !q.first {
				q.first = true
				firsts = append(firsts, q)
			}
			if q.done == q.gen {
				if err := release(q); err != nil {
					return res, fmt.Errorf("request %d: %w", q.ID, err)
				}
				running = slices.Delete(running, i, i+1)
				i--
				res.Completed++
				finished++
				retry, evicting = true, false
				progress(finished)
			}
		}
		if !progressed && len(running) > 0 {
			q := running[len(running)-1]
			running = running[:len(running)-1]
			if err := release(q); err != nil {
				return res, fmt.Errorf("request %d: %w", q.ID, err)
			}
			q.done = 0
			switch {
			case len(running) == 0:
				// It could not take a step alone: waiting frees nothing for it (and
				// with evicting set and none running to finish, nothing would be
				// admitted again).
				res.Rejected++
				finished++
				progress(finished)
				retry, evicting = true, false
			default:
				res.Preempted++
				waiting = slices.Insert(waiting, 0, q)
				retry, evicting = true, true
			}
		}
		now += w.Step + time.Duration(float64(prefill)/w.PrefillRate*float64(time.Second))
		for _, q := range firsts {
			ttfts = append(ttfts, now-q.arrived)
		}
		phys, _ := st.physical()
		cached, _ := st.cached()
		need := liveNeed(w.Groups, bpt, running, liveTokens, shared)
		res.PeakNeeded = max(res.PeakNeeded, need)
		if len(running) > 0 {
			physSum += float64(phys)
			needSum += float64(need)
		}
		hr := 0.0
		if res.Queries > 0 {
			hr = float64(res.Hits) / float64(res.Queries)
		}
		res.Samples = append(res.Samples, PrefixSample{At: now, Physical: phys, Cached: cached, HitRate: hr})
		if cp != nil {
			res.CheckpointPeak = max(res.CheckpointPeak, cp.checkpoints())
		}
	}
	res.Makespan = now
	_, res.PeakPhysical = st.physical()
	if physSum > 0 {
		res.Waste = 100 * (1 - needSum/physSum)
	}
	res.TTFTP50, res.TTFTP99 = quantile(ttfts, 0.5), quantile(ttfts, 0.99)
	res.StepP50, res.StepP99 = quantile(steps, 0.5), quantile(steps, 0.99)
	res.Causes = meter.classes()
	res.After, _ = st.physical()
	res.Trimmed = st.trim()
	res.CachedAfter, res.FloorAfter = st.cached()
	if cp != nil {
		res.CheckpointBytes, res.CheckpointSize = cp.checkpoints(), cp.checkpointSize()
	}
	if tiered != nil {
		res.Tiers = tiered.tierStats()
		res.ForeignLoads = tiered.foreignLoads()
		res.WrittenTokens, res.EvictedTokens = tiered.written()
	}
	res.Wall = time.Since(start)
	return res, nil
}

// Defaults of the prefix-cache replay, for flags not given: a small model, since
// Mooncake's prompts average 12,000 tokens (144 MiB of K/V each for Qwen2.5-0.5B); a
// context window that holds all but the longest; as many requests as replay in about
// a minute here for the three strategies; and a budget of about ten such prompts,
// which keeps each strategy (the paged one holds Go heap) within 2 GiB.
const (
	prefixModel     = "qwen2.5-0.5b"
	prefixMaxTokens = 32768
	prefixRequests  = 100
	prefixBudget    = 1536 << 20
)

// prefixDefaults sniffs the -trace file: one with token IDs (Mooncake JSON lines)
// selects the prefix-cache replay, whose defaults replace those of flags not given.
func (c *config) prefixDefaults() error {
	head := make([]byte, 512)
	n := 0
	switch c.trace {
	case "":
		return nil
	case mooncakeFlag:
		n = copy(head, bundledMooncake)
	default:
		f, err := os.Open(c.trace)
		if err != nil {
			return err
		}
		defer f.Close()
		n, _ = io.ReadFull(f, head)
	}
	if b := bytes.TrimLeft(head[:n], " \t\r\n\ufeff"); len(b) == 0 || b[0] != '{' {
		return nil
	}
	c.prefix = true
	for flagName, set := range map[string]func(){
		"model":         func() { c.model = prefixModel },
		"max-tokens":    func() { c.maxTokens = prefixMaxTokens },
		"requests":      func() { c.requests = prefixRequests },
		"system-prompt": func() { c.system = 0 },
		"budget":        func() { c.budget = prefixBudget },
		"strategies":    func() { c.strategies = strings.Join(prefixStrategies, ",") },
	} {
		if !c.set[flagName] {
			set()
		}
	}
	return nil
}

// printPrefixTable writes the prefix-cache comparison.
func printPrefixTable(w io.Writer, rs []PrefixResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "strategy\thit rate\tideal\tTTFT p50\tTTFT p99\tmakespan\tpeak\t/need\twaste\tmemory\tafter\t/cached floor\tdone\t")
	for _, r := range rs {
		ratio, floor := "-", "-"
		if r.PeakNeeded > 0 {
			ratio = fmt.Sprintf("%.2fx", float64(r.PeakPhysical)/float64(r.PeakNeeded))
		}
		after := r.After - r.Trimmed
		if r.FloorAfter > 0 {
			floor = fmt.Sprintf("%.2fx", float64(after)/float64(r.FloorAfter))
		}
		hr := func(h int64) string {
			if r.Queries == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f%%", 100*float64(h)/float64(r.Queries))
		}
		done := fmt.Sprintf("%d/%d", r.Completed, r.Requests)
		if r.Rejected > 0 {
			done += fmt.Sprintf(" (%d rejected)", r.Rejected)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.1f%%\t%s\t%s\t%s\t%s\t\n",
			r.Strategy, hr(r.Hits), hr(r.IdealHits), fmtDur(r.TTFTP50), fmtDur(r.TTFTP99), fmtDur(r.Makespan),
			formatBytes(r.PeakPhysical), ratio, r.Waste, fmtDur(r.MemoryTime), formatBytes(after), floor, done)
	}
	tw.Flush()
	fmt.Fprintln(w, `
hit rate   prompt tokens found cached (vLLM's prefix_cache_hits over queries); ideal: an
           unbounded cache, the longest prefix shared with any earlier request
TTFT       model time from arrival to the first token: waiting, then prefill of the
           uncached tokens at -prefill-rate, then one step
memory     wall time of every memory-layer call (lookup, append, K/V writes, insert, close)
after      memory held once every request finished (cached prefixes included; vmarena's
           idle pool given back); /cached floor: over the cached tokens' packed bytes`)
}

// prefixReadingLine says in one line what the hit rates mean and what to compare them
// with: the ideal column, an unbounded cache on the same requests, bounds every hit
// rate, so a low ideal is the trace's (its requests share few prompt blocks) and a
// gap below it is the budget's; with tiers, a tier's share is the hits the device had
// evicted. It is empty without a prefix cache's result.
func prefixReadingLine(rs []PrefixResult, tiers bool) string {
	for _, r := range rs {
		if r.Strategy != namePrefixOn || r.Queries == 0 {
			continue
		}
		line := fmt.Sprintf("%s found %.2f%% of the prompt tokens cached; an unbounded cache would find %.2f%% (ideal)",
			r.Strategy, 100*float64(r.Hits)/float64(r.Queries), 100*float64(r.IdealHits)/float64(r.Queries))
		if r.IdealHits > 0 {
			line += fmt.Sprintf(", so the budget cost %.1f%% of the possible hits", 100*(1-float64(r.Hits)/float64(r.IdealHits)))
		}
		line += "; the ideal is the trace's: these requests share that much of their prompts with earlier ones (more -requests reach later turns of the same conversations)"
		if !tiers {
			return line
		}
		for _, t := range rs {
			if strings.HasPrefix(t.Strategy, namePrefixTiers) && t.Queries > 0 {
				line += fmt.Sprintf("; %s found %.2f%%: the tiers gave back blocks the device had evicted, each tier only what its own budget kept (the host tier's is -host-tier-budget, by default -budget), so a tier no larger than the device may serve little of it",
					t.Strategy, 100*float64(t.Hits)/float64(t.Queries))
				break
			}
		}
		return line
	}
	return ""
}

// printPrefixHeader says what the prefix-cache replay is about to replay.
func printPrefixHeader(stdout io.Writer, c *config, s setup, reqs []Request, traceName string) {
	last := reqs[len(reqs)-1].Arrival - reqs[0].Arrival
	budget := "unlimited"
	if s.budget > 0 {
		budget = formatBytes(s.budget)
	}
	fmt.Fprintf(stdout, "Trace:   %s: %d requests over %v of trace time, prompts with token IDs: prefix-cache replay\n", traceName, len(reqs), last.Round(time.Second))
	fmt.Fprintf(stdout, "Model:   %s, %s of K/V per token, max %d tokens per sequence\n", s.model.Name, formatBytes(int64(s.model.BytesPerToken())), c.maxTokens)
	if s.groups != nil {
		window := ""
		if slices.ContainsFunc(s.groups.Groups, func(g kv.Group) bool { return g.Window > 0 }) {
			window = ", a hit needing each window group's last window before it"
		}
		fmt.Fprintf(stdout, "Groups:  %s; vmarena's cache on them (kv.Config.Model)%s\n", groupKinds(*s.groups), window)
	}
	fmt.Fprintf(stdout, "Server:  batch of at most %d, %v per decode step, prefill %.0f tokens/s, budget %s per strategy\n", c.concurrency, c.step, c.prefillRate, budget)
	if c.idealNote != "" {
		fmt.Fprintf(stdout, "Budget:  %s\n", c.idealNote)
	}
	if s.tiers != nil {
		printTierHeader(stdout, s.tiers)
	}
	fmt.Fprintln(stdout)
}

// replayPrefixOne builds the prefix strategy called name, replays w on it, closes it
// and checks that the governor got every byte back.
func replayPrefixOne(ctx context.Context, name string, s setup, w PrefixWorkload) (PrefixResult, error) {
	return replayPrefixReplica(ctx, name, s, w, 0)
}

// replayPrefixReplica is replayPrefixOne for one replica of a tiered strategy; the
// first kills the redis-server at -redis-kill-at.
func replayPrefixReplica(ctx context.Context, name string, s setup, w PrefixWorkload, replica int) (PrefixResult, error) {
	st, gov, err := buildPrefixReplica(name, s, replica)
	if err != nil {
		return PrefixResult{Strategy: name}, err
	}
	progress := func(int) {}
	if t := s.tiers; name == namePrefixTiers && replica == 0 && t.killAt > 0 && t.server != nil {
		progress = func(done int) {
			if done == t.killAt {
				t.server.kill()
			}
		}
	}
	if s.metrics != nil {
		if err := s.metrics.watch(name, gov, accounting.HostKey, st); err != nil {
			return PrefixResult{Strategy: name}, fmt.Errorf("metrics: %w", errors.Join(err, st.Close()))
		}
	}
	res, err := ReplayPrefix(ctx, st, w, progress)
	if replica > 0 {
		// Its requests follow the same ones of the replicas before it.
		res.IdealHits = idealHitsAfter(w, replica)
	}
	if cerr := st.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("close: %w", cerr)
	}
	if used := gov.AllStats(); err == nil {
		for _, d := range used {
			if d.Used != 0 {
				err = fmt.Errorf("%d bytes still charged to the governor after Close", d.Used)
			}
		}
	}
	return res, err
}

// runPrefix replays a trace with token IDs against the prefix strategies.
func runPrefix(ctx context.Context, c *config, s setup, names []string, w PrefixWorkload, traceName string, stdout, stderr io.Writer) int {
	printPrefixHeader(stdout, c, s, w.Requests, traceName)
	runs, failed, stopped := replayEach(ctx, stderr, names, func(name string) ([]PrefixResult, error) {
		replicas := 1
		if name == namePrefixTiers {
			replicas = s.tiers.replicas
		}
		var rs []PrefixResult
		for r := range replicas {
			label := name
			if replicas > 1 {
				label += "/" + string(rune('A'+r))
			}
			fmt.Fprintf(stdout, "%s ...", label)
			res, err := replayPrefixReplica(ctx, name, s, w, r)
			res.Strategy = label
			fmt.Fprintf(stdout, " %v\n", res.Wall.Round(time.Millisecond))
			if err != nil {
				return rs, fmt.Errorf("%s: %w", label, err)
			}
			rs = append(rs, res)
		}
		return rs, nil
	})
	results := slices.Concat(runs...)
	if stopped || len(results) == 0 {
		return 1
	}
	if hasRecurrent(s.groups) && slices.Contains(names, namePrefixOn) {
		// The same trace and budget on the model's full-attention layers alone: what
		// a prefix cache finds without checkpoints.
		fs, fw := fullLayersAlone(s, w, *s.groups)
		fmt.Fprintf(stdout, "%s ...", nameFullLayers)
		res, err := replayPrefixOne(ctx, namePrefixOn, fs, fw)
		res.Strategy = nameFullLayers
		fmt.Fprintf(stdout, " %v\n", res.Wall.Round(time.Millisecond))
		if err != nil {
			fmt.Fprintf(stderr, "kvcache: %s: %v\n", nameFullLayers, err)
			failed = true
		} else {
			results = append(results, res)
		}
	}
	fmt.Fprintln(stdout)
	printPrefixTable(stdout, results)
	if hasRecurrent(s.groups) {
		printCheckpointLine(stdout, results, MooncakeBlockTokens)
	}
	if w.Adapters > 1 {
		fmt.Fprintln(stdout)
		printAdapterTable(stdout, results, w.Adapters)
	}
	if w.Causes {
		names, cls := make([]string, len(results)), make([][]CauseClass, len(results))
		for i, r := range results {
			names[i], cls[i] = r.Strategy, r.Causes
		}
		printCauses(stdout, names, cls)
	}
	if w.Verify && s.tiers == nil {
		for _, r := range results {
			fmt.Fprintf(stdout, "%s: %d hit tokens read back in every layer that a later step reads, each as written for its prefix\n", r.Strategy, r.Verified)
		}
	}
	if s.tiers != nil {
		fmt.Fprintln(stdout)
		printTierTable(stdout, results, s.tiers)
		if t := s.tiers; t.killAt > 0 && t.server != nil && t.server.killed() {
			fmt.Fprintf(stdout, "\nredis-server was killed once %d requests of %s were done.\n", t.killAt, namePrefixTiers)
		}
	}
	if line := prefixReadingLine(results, s.tiers != nil); line != "" {
		fmt.Fprintln(stdout, "\nReading: "+line)
	}
	paths, err := writePrefixPlots(c.out, c.format, results, s.budget)
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: plot: %v\n", err)
		return 1
	}
	slices.Sort(paths)
	fmt.Fprintf(stdout, "\nPlots of memory and of the hit rate over time: %s\n", strings.Join(paths, ", "))
	if failed {
		return 1
	}
	return 0
}
