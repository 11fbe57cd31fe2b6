package kv_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// replaySeq is what the replay uses of a sequence, kv's or the paged baseline's.
type replaySeq interface {
	Append(n int) error
	WriteToken(layer int, v bool, t int, src []byte) error
	Close()
}

type kvReplaySeq struct{ s *kv.Sequence }

func (q kvReplaySeq) Append(n int) error { return q.s.Append(n) }
func (q kvReplaySeq) WriteToken(layer int, v bool, t int, src []byte) error {
	kind := kv.K
	if v {
		kind = kv.V
	}
	return q.s.WriteToken(layer, kind, t, src)
}
func (q kvReplaySeq) Close() { q.s.Close() }

type pagedReplaySeq struct{ s baseline.Sequence }

func (q pagedReplaySeq) Append(n int) error { return q.s.Append(n) }
func (q pagedReplaySeq) WriteToken(layer int, v bool, t int, src []byte) error {
	kind := baseline.K
	if v {
		kind = baseline.V
	}
	return q.s.WriteToken(layer, kind, t, src)
}
func (q pagedReplaySeq) Close() { _ = q.s.Close() }

// replayResult is one replay's figures.
type replayResult struct {
	steps  []time.Duration // memory-layer time of each decode step of one request
	memory time.Duration   // all memory-layer time: starts, prompts, steps, closes
	peak   int64           // the device's peak use
	need   int64           // the most bytes the live tokens needed at once
	// Steps that committed a block (kv only): those that found idle granules in
	// the pool, and those that found none.
	idleCommits, freshCommits []time.Duration
	// slept counts the steps in which the replaying thread slept (a voluntary
	// context switch: a wait for a lock, in Go or in the kernel), whatever the load
	// of the machine, which preempts (involuntary switches) rather than sleeps.
	slept int
}

// voluntarySwitches returns the calling thread's voluntary context switches so far.
func voluntarySwitches(b *testing.B) int64 {
	var u unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &u); err != nil {
		b.Fatal(err)
	}
	return u.Nvcsw
}

// replayLongPrompts replays requests of long prompts through a server loop under a
// budget (continuous batching, as examples/kvcache does): a request is admitted when
// its prompt fits (start, append the prompt, write its K and V in every layer), each
// step appends one token to every running request and writes it, a request that
// finished is closed, and a step that can not grow any running request preempts the
// youngest. start makes a sequence; used reads the device's use and idle the pool's
// idle bytes (nil for the baseline).
func replayLongPrompts(b *testing.B, g kv.Model, prompts, gens []int, start func() (replaySeq, error), gov *accounting.Governor, dev accounting.DeviceKey, idle func() int64, gran int) replayResult {
	tok := make([]byte, g.Groups[0].TokenBytes())
	var res replayResult
	// One thread for the whole replay, so that its context switches are the steps'.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	write := func(q replaySeq, from, to int) error {
		for t := from; t < to; t++ {
			for l := range g.Layers {
				if err := q.WriteToken(l, false, t, tok); err != nil {
					return err
				}
				if err := q.WriteToken(l, true, t, tok); err != nil {
					return err
				}
			}
		}
		return nil
	}
	type req struct {
		seq       replaySeq
		n, done   int
		prompt, g int
	}
	var waiting, running []*req
	for i := range prompts {
		waiting = append(waiting, &req{prompt: prompts[i], g: gens[i]})
	}
	live := func() int64 {
		var n int64
		for _, q := range running {
			n += int64(q.n)
		}
		return n * int64(g.BytesPerToken())
	}
	// retry: a refused head is tried again once a sequence closed; evicting: after a
	// preemption, nothing is admitted until a request completes.
	retry, evicting := true, false
	for len(waiting)+len(running) > 0 {
		if len(running) == 0 {
			retry, evicting = true, false // nothing else can free memory
		}
		for len(waiting) > 0 && len(running) < 32 && retry && !evicting {
			q := waiting[0]
			t0 := time.Now()
			s, err := start()
			if err == nil {
				if err = s.Append(q.prompt); err == nil {
					err = write(s, 0, q.prompt)
				} else {
					s.Close()
				}
			}
			res.memory += time.Since(t0)
			if errors.Is(err, accounting.ErrBudgetExceeded) && len(running) > 0 {
				retry = false
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			q.seq, q.n, q.done = s, q.prompt, 0
			waiting = waiting[1:]
			running = append(running, q)
		}
		res.need = max(res.need, live())
		progressed := false
		for i := 0; i < len(running); i++ {
			q := running[i]
			commits := false
			var before int64
			if idle != nil && (q.n%(gran/g.BytesPerToken()) == 0) {
				commits, before = true, idle()
			}
			sw := voluntarySwitches(b)
			t0 := time.Now()
			err := q.seq.Append(1)
			if err == nil {
				err = write(q.seq, q.n, q.n+1)
			}
			dt := time.Since(t0)
			if voluntarySwitches(b) != sw {
				res.slept++
			}
			res.memory += dt
			if errors.Is(err, accounting.ErrBudgetExceeded) {
				continue
			}
			if err != nil {
				b.Fatal(err)
			}
			switch {
			case commits && before == 0:
				res.freshCommits = append(res.freshCommits, dt)
			case commits:
				res.idleCommits = append(res.idleCommits, dt)
			}
			res.steps = append(res.steps, dt)
			progressed = true
			q.n++
			if q.done++; q.done == q.g {
				t0 := time.Now()
				q.seq.Close()
				res.memory += time.Since(t0)
				running = slices.Delete(running, i, i+1)
				i--
				retry, evicting = true, false
			}
		}
		res.need = max(res.need, live())
		if !progressed && len(running) > 0 {
			q := running[len(running)-1]
			running = running[:len(running)-1]
			t0 := time.Now()
			q.seq.Close()
			res.memory += time.Since(t0)
			waiting = slices.Insert(waiting, 0, q)
			evicting = true
		}
	}
	res.peak = gov.Stats(dev).Peak
	return res
}

// p returns the q-quantile of ds (sorted in place).
func p(ds []time.Duration, q float64) time.Duration {
	slices.Sort(ds)
	return ds[min(int(q*float64(len(ds))), len(ds)-1)]
}

// BenchmarkLongPromptStep replays 16 requests of long prompts (Llama-3-8B, prompts
// of 400 to 2,900 tokens, 40 to 160 generated, a 1 GiB budget: about a quarter of
// the requests fit at once, as in examples/kvcache with -prompt-scale 4) on kv's
// default layout over host.Shared (2 MiB granules, populated at commit, the pool
// keeping up to the budget's worth of idle granules and decaying them, as the
// example sets it up) and on the paged baseline under the same budget, one after the
// other in each iteration, and reports, from the same iteration, the ratios of kv to
// paged: the decode step's p99 (memory-layer time of one request's step: its append
// and the writes of its token) and the whole memory-layer time, and kv's peak use
// over the peak bytes the live tokens needed. fresh% is the share of kv's steps that
// crossed into a new block and found no idle granule in the pool; idle-commit-p50-ns
// and fresh-commit-p50-ns are the median of kv's steps that crossed into a new block
// with idle granules in the pool and without. NB: with map-ahead a crossing step
// adopts the block committed ahead into its range, which is not idle, so those
// figures split such steps by the pool's state, not by what they did. slept% and paged-slept% are the share of steps in
// which the replaying thread slept (waited for a lock, in Go or in the kernel): a
// figure that the machine's load does not make, as it does the p99. With map-ahead,
// queued% and inflight% are the share of kv's steps that needed their run ahead and
// found it still queued (they committed their block themselves) or being committed
// (they waited for it): the steps that make the p99 where the worker falls behind.
// ahead=false turns map-ahead off (kv.Config.MapAhead); fill=false keeps it on but
// turns off the worker's filling of the pool for the runs that follow (kv/ahead.go),
// to compare the two in one binary.
func BenchmarkLongPromptStep(b *testing.B) {
	const budget, requests, maxTokens = 1 << 30, 16, 8192
	g := kv.Llama3_8B()
	r := rand.New(rand.NewPCG(23, 4))
	prompts, gens := make([]int, requests), make([]int, requests)
	for i := range prompts {
		prompts[i], gens[i] = 400+r.IntN(2500), 40+r.IntN(120)
	}
	shape := baseline.Shape{Layers: g.Layers, TokenBytes: g.Groups[0].TokenBytes(), MaxTokens: maxTokens}
	for _, v := range []struct{ ahead, fill bool }{{false, false}, {true, true}, {true, false}} {
		name := fmt.Sprintf("ahead=%v", v.ahead)
		if v.ahead && !v.fill {
			name += ",fill=false"
		}
		ahead := v.ahead
		b.Run(name, func(b *testing.B) {
			var kvP99, pagedP99, kvMem, pagedMem time.Duration
			var peakNeed, fresh, slept, pagedSlept, queued, inFlight float64
			var idleCommit, freshCommit []time.Duration
			for b.Loop() {
				gov := accounting.NewGovernor()
				if err := gov.SetLimit(accounting.HostKey, budget); err != nil {
					b.Fatal(err)
				}
				pool, err := host.NewShared(host.SharedOptions{Authority: gov.Authority("kv", accounting.HostKey), Populate: true,
					High: budget / (2 << 20), Name: fmt.Sprintf("kv-bench-ahead-%d", os.Getpid())})
				if err != nil {
					b.Fatal(err)
				}
				c, err := kv.New(pool, kv.Config{Model: g, MaxTokens: maxTokens, MapAhead: ahead})
				if err != nil {
					b.Fatal(err)
				}
				c.SetAheadFill(v.fill)
				kres := replayLongPrompts(b, g, prompts, gens, func() (replaySeq, error) {
					s, err := c.NewSequence()
					return kvReplaySeq{s}, err
				}, gov, accounting.HostKey, func() int64 { return pool.PoolStats().Idle }, c.Granularity())
				q, f := c.AheadMisses()
				queued += 100 * float64(q) / float64(len(kres.steps))
				inFlight += 100 * float64(f) / float64(len(kres.steps))
				if err := c.Close(); err != nil {
					b.Fatal(err)
				}
				if err := pool.Close(); err != nil {
					b.Fatal(err)
				}

				pgov := accounting.NewGovernor()
				if err := pgov.SetLimit(accounting.HostKey, budget); err != nil {
					b.Fatal(err)
				}
				block := int64(baseline.DefaultBlockTokens * shape.BytesPerToken())
				paged, err := baseline.NewPaged(shape, baseline.PagedOptions{Authority: pgov.Authority("paged", accounting.HostKey),
					ChunkBlocks: int(max(1, min(baseline.DefaultChunkBytes, budget/16)/block))})
				if err != nil {
					b.Fatal(err)
				}
				pres := replayLongPrompts(b, g, prompts, gens, func() (replaySeq, error) {
					s, err := paged.NewSequence()
					return pagedReplaySeq{s}, err
				}, pgov, accounting.HostKey, nil, 0)
				if err := paged.Close(); err != nil {
					b.Fatal(err)
				}
				kvP99 += p(kres.steps, 0.99)
				pagedP99 += p(pres.steps, 0.99)
				kvMem += kres.memory
				pagedMem += pres.memory
				peakNeed += float64(kres.peak) / float64(kres.need)
				fresh += 100 * float64(len(kres.freshCommits)) / float64(len(kres.steps))
				slept += 100 * float64(kres.slept) / float64(len(kres.steps))
				pagedSlept += 100 * float64(pres.slept) / float64(len(pres.steps))
				idleCommit = append(idleCommit, kres.idleCommits...)
				freshCommit = append(freshCommit, kres.freshCommits...)
			}
			n := float64(b.N)
			b.ReportMetric(float64(kvP99.Nanoseconds())/n, "p99-ns")
			b.ReportMetric(float64(pagedP99.Nanoseconds())/n, "paged-p99-ns")
			b.ReportMetric(float64(kvP99)/float64(pagedP99), "p99/paged")
			b.ReportMetric(float64(kvMem)/float64(pagedMem), "memory/paged")
			b.ReportMetric(peakNeed/n, "peak/need")
			b.ReportMetric(fresh/n, "fresh%")
			b.ReportMetric(slept/n, "slept%")
			b.ReportMetric(pagedSlept/n, "paged-slept%")
			if ahead {
				b.ReportMetric(queued/n, "queued%")
				b.ReportMetric(inFlight/n, "inflight%")
			}
			// Where the tail comes from: a step that commits a block costs what its
			// granules cost to come by.
			if len(idleCommit) > 0 {
				b.ReportMetric(float64(p(idleCommit, 0.5).Nanoseconds()), "idle-commit-p50-ns")
			}
			if len(freshCommit) > 0 {
				b.ReportMetric(float64(p(freshCommit, 0.5).Nanoseconds()), "fresh-commit-p50-ns")
			}
		})
	}
}
