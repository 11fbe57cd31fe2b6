package main

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// replicaModel is the replicas' model: small, so that a replay of thousands of Mooncake
// prompts (12,000 tokens on average) fits a development machine: 32 bytes a token.
var replicaModel = kv.Uniform("router-tiny", 1, 1, 8, arena.Float16)

// simConfig is a cluster's shape and its servers' speed (in model time).
type simConfig struct {
	Replicas    int
	Budget      int64 // bytes of K/V memory of each replica
	Concurrency int   // most requests a replica runs at once
	PrefillRate float64
	Step        time.Duration // one decode step of a replica's batch
	MaxTokens   int           // a prompt is clipped to MaxTokens-1 tokens
	BlockSize   int           // tokens of a block of the KV events
}

// replica is one server: its own cache and prefix cache, and its batch.
type replica struct {
	id    int
	pool  *host.Shared
	cache *kv.Cache
	pc    *kv.PrefixCache

	waiting, running []*job
	busy             bool
	until            time.Duration // when the iteration in flight ends
	firsts           []*job        // their first token comes at until

	queries, hits int64
	rejected      int
	preempted     int
}

// job is a request on its way through a replica.
type job struct {
	q       *request
	tokens  []int32
	gen     int
	seq     *kv.Sequence
	done    int
	counted bool // its lookup counted in the hit rate
	first   bool // its first token came
}

// newReplica returns replica id: a cache of cfg.Budget bytes on host shared memory,
// with a prefix cache that tells obs (may be nil) its block events.
func newReplica(id int, cfg simConfig, obs kv.BlockEvents) (*replica, error) {
	gov := accounting.NewGovernor()
	if err := gov.SetLimit(accounting.HostKey, cfg.Budget); err != nil {
		return nil, err
	}
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: gov.Authority(fmt.Sprintf("replica %d", id), accounting.HostKey)})
	if err != nil {
		return nil, err
	}
	cache, err := kv.New(pool, kv.Config{Model: replicaModel, MaxTokens: cfg.MaxTokens})
	if err != nil {
		return nil, errors.Join(err, pool.Close())
	}
	opts := kv.PrefixCacheOptions{}
	if obs != nil {
		opts.Events = kv.EventOptions{Observer: obs, Hash: blockhash.Options{BlockSize: cfg.BlockSize, Seed: fmt.Sprintf("replica-%d", id)}}
	}
	pc, err := kv.NewPrefixCache(cache, opts)
	if err != nil {
		return nil, errors.Join(err, cache.Close(), pool.Close())
	}
	return &replica{id: id, pool: pool, cache: cache, pc: pc}, nil
}

// close closes what the replica still runs, then its caches and its pool.
func (r *replica) close() error {
	var errs []error
	for _, j := range r.running {
		if out := j.seq.Close(); !out.OK() {
			errs = append(errs, out.Err)
		}
	}
	r.running = nil
	errs = append(errs, r.pc.Close(), r.cache.Close(), r.pool.Close())
	return errors.Join(errs...)
}

// load returns the replica's load as the router sees it: the requests waiting to be
// admitted (the waiting queue size the load-aware scorer reads) and those it has
// not finished (what the router counts of the requests it sent).
func (r *replica) load() load {
	return load{waiting: len(r.waiting), active: len(r.waiting) + len(r.running)}
}

// admit starts j: looks its prompt up, prefills the rest, inserts the prompt. It
// returns the tokens prefilled.
func (r *replica) admit(j *job) (int, error) {
	s, m, err := r.pc.Lookup(j.tokens)
	if err != nil {
		return 0, err
	}
	if err = s.Append(len(j.tokens) - m); err == nil {
		// A prompt the budget can not cache stays uncached: the request goes on.
		if err = r.pc.Insert(s, j.tokens); errors.Is(err, accounting.ErrBudgetExceeded) {
			err = nil
		}
	}
	if err != nil {
		s.Close()
		return 0, err
	}
	j.seq = s
	if !j.counted {
		j.counted = true
		r.queries += int64(len(j.tokens))
		r.hits += int64(m)
	}
	return len(j.tokens) - m, nil
}

// iterate runs one iteration of the replica's batch from now: it admits what it can,
// then decodes one token of every running request. It returns the requests that
// finished and the iteration's model time (a decode step, plus the prefill of what
// the admitted prompts did not find cached).
func (r *replica) iterate(cfg simConfig) (finished []*job, d time.Duration, err error) {
	prefill := 0
	for len(r.waiting) > 0 && len(r.running) < cfg.Concurrency {
		j := r.waiting[0]
		n, err := r.admit(j)
		if errors.Is(err, accounting.ErrBudgetExceeded) {
			if len(r.running) > 0 {
				break // it waits for running requests to finish
			}
			r.rejected++
			r.waiting = r.waiting[1:]
			finished = append(finished, j)
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		r.waiting = r.waiting[1:]
		r.running = append(r.running, j)
		prefill += n
	}
	progressed := false
	r.firsts = r.firsts[:0]
	for i := 0; i < len(r.running); i++ {
		j := r.running[i]
		if err := j.seq.Append(1); errors.Is(err, accounting.ErrBudgetExceeded) {
			continue
		} else if err != nil {
			return nil, 0, err
		}
		progressed = true
		if j.done++; !j.first {
			j.first = true
			r.firsts = append(r.firsts, j)
		}
		if j.done == j.gen {
			j.seq.Close()
			j.seq = nil
			r.running = slices.Delete(r.running, i, i+1)
			i--
			finished = append(finished, j)
		}
	}
	if !progressed && len(r.running) > 0 {
		// The batch can not grow: the newest request goes back to wait, its
		// memory released, to be prefilled again (its prompt may be cached now).
		j := r.running[len(r.running)-1]
		r.running = r.running[:len(r.running)-1]
		j.seq.Close()
		j.seq, j.done = nil, 0
		r.waiting = slices.Insert(r.waiting, 0, j)
		r.preempted++
	}
	return finished, cfg.Step + time.Duration(float64(prefill)/cfg.PrefillRate*float64(time.Second)), nil
}

// prompt returns the request's prompt tokens and output length as a replica of
// maxTokens serves them: a prompt and its output that do not fit are clipped, the
// output to at most half, the prompt to the rest; an empty prompt is one token.
func (q *request) prompt(maxTokens int) ([]int32, int) {
	gen, ctx := max(q.output, 1), q.input
	if ctx+gen > maxTokens {
		gen = min(gen, maxTokens/2)
		ctx = maxTokens - gen
	}
	tokens := q.tokens(ctx)
	if len(tokens) == 0 {
		tokens = []int32{int32(q.id % vocabulary)}
	}
	return tokens, gen
}

// policy sends a request to a replica.
type policy interface {
	name() string
	route(tokens []int32, loads []load) (int, error)
}

type roundRobin struct{ next, n int }

func (p *roundRobin) name() string { return "round-robin" }

func (p *roundRobin) route([]int32, []load) (int, error) {
	r := p.next
	p.next = (p.next + 1) % p.n
	return r, nil
}

// byPrefix routes by the index's longest cached prefix, weighted by load; sync, when
// set, waits until the index has every event the replicas made so far.
type byPrefix struct {
	idx    *Index
	scorer Scorer
	sync   func() error
	// away counts the requests sent elsewhere than to a replica with their longest
	// cached prefix (for load), and the blocks they so left behind.
	away, awayBlocks int
}

func (p *byPrefix) name() string { return "by prefix" }

func (p *byPrefix) route(tokens []int32, loads []load) (int, error) {
	if p.sync != nil {
		if err := p.sync(); err != nil {
			return 0, err
		}
	}
	match := p.idx.Match(p.idx.Keys(tokens), len(loads))
	r := p.scorer.Pick(match, loads)
	if best := slices.Max(match); match[r] < best {
		p.away++
		p.awayBlocks += best - match[r]
	}
	return r, nil
}

// simResult is what a replay did.
type simResult struct {
	Policy              string
	Replicas            int
	Requests, Rejected  int
	Preempted           int
	Queries, Hits       int64
	TTFTP50, TTFTP99    time.Duration
	Makespan            time.Duration
	PerReplica          []int // requests each replica took
	PerReplicaHitTokens []int64
}

// HitRate returns the cluster's prompt tokens found cached over those looked up.
func (s simResult) HitRate() float64 {
	if s.Queries == 0 {
		return 0
	}
	return float64(s.Hits) / float64(s.Queries)
}

// simulate replays reqs across reps, each request routed by p at its arrival, each
// replica running its own batch in model time; it leaves the replicas open.
func simulate(reqs []request, reps []*replica, p policy, cfg simConfig) (simResult, error) {
	res := simResult{Policy: p.name(), Replicas: len(reps), Requests: len(reqs), PerReplica: make([]int, len(reps))}
	arrived := make(map[*job]time.Duration, len(reqs))
	var ttfts []time.Duration
	next, finished := 0, 0
	loads := make([]load, len(reps))
	start := func(r *replica, now time.Duration) error {
		done, d, err := r.iterate(cfg)
		if err != nil {
			return fmt.Errorf("replica %d: %w", r.id, err)
		}
		r.busy, r.until = true, now+d
		for _, j := range r.firsts {
			ttfts = append(ttfts, r.until-arrived[j])
		}
		finished += len(done)
		if len(done) > 0 {
			res.Makespan = max(res.Makespan, r.until)
		}
		return nil
	}
	for finished < len(reqs) {
		// The earliest event: an arrival, or the end of a replica's iteration.
		var endR *replica
		for _, r := range reps {
			if r.busy && (endR == nil || r.until < endR.until) {
				endR = r
			}
		}
		if next < len(reqs) && (endR == nil || reqs[next].arrival <= endR.until) {
			q := &reqs[next]
			next++
			now := q.arrival
			tokens, gen := q.prompt(cfg.MaxTokens)
			j := &job{q: q, tokens: tokens, gen: gen}
			for i, r := range reps {
				loads[i] = r.load()
			}
			ri, err := p.route(j.tokens, loads)
			if err != nil {
				return res, err
			}
			r := reps[ri]
			res.PerReplica[ri]++
			arrived[j] = now
			r.waiting = append(r.waiting, j)
			if !r.busy {
				if err := start(r, now); err != nil {
					return res, err
				}
			}
			continue
		}
		if endR == nil {
			return res, fmt.Errorf("router: %d of %d requests finished and nothing runs", finished, len(reqs))
		}
		endR.busy = false
		if len(endR.waiting)+len(endR.running) > 0 {
			if err := start(endR, endR.until); err != nil {
				return res, err
			}
		}
	}
	for _, r := range reps {
		res.Queries += r.queries
		res.Hits += r.hits
		res.Rejected += r.rejected
		res.Preempted += r.preempted
		res.PerReplicaHitTokens = append(res.PerReplicaHitTokens, r.hits)
	}
	res.TTFTP50, res.TTFTP99 = quantile(ttfts, 0.5), quantile(ttfts, 0.99)
	return res, nil
}

// quantile returns the q-quantile of d (0 for none), sorting d.
func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[min(len(d)-1, int(q*float64(len(d))))]
}
