package kvevents_test

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kvevents"
)

// BenchmarkPublishCost is what publishing costs the cache, against the time of its
// memory layer: kv's BenchmarkPrefixCacheMiss scenario (requests of 4,096 unique
// tokens, Qwen2.5-0.5B, 2 MiB granules, a 512 MiB budget, the prefix cache on and
// full, so that every Insert evicts the least recently used entry; every token's K and
// V written), with a publisher at its default settings (on an ephemeral loopback port,
// one subscriber reading) told what each request caches and evicts: one BlocksStored
// of 256 blocks of 16 tokens and one BlocksRemoved of the 256 blocks evicted, as the
// prefix cache's observer reports them (its block hashing, kv's work, is not timed
// here: the hashes are made beforehand).
//
// calls-ns/op (calls-cpu-ns/op: the thread's CPU time) is the time in the memory
// layer's calls (look up, append, insert, close); publish-ns/op and publish-cpu-ns/op
// are the publisher's calls on the same goroutine, and publish-% their share of the
// memory layer's time: the target is at most 1%. publish-cpu-% is the same share in
// CPU time. Both shares net out clock-ns/op and clock-cpu-ns/op, what reading the
// clocks costs around nothing (on a loaded VM, about as much as the two calls timed;
// the median of the requests'). The encoding and sending happen on
// the publisher's goroutine; BenchmarkEncodeBatch times the encoding alone.
//
// The counters say where the calls' time goes: stored-ns and removed-ns are the
// medians of each call alone (the first call of a request finds the publisher's
// memory cold after the request's 48 MiB of K/V writes; the second finds it warm
// but for the queue slot it writes); publish-ctxsw/op the thread's context
// switches inside the calls (a wake-up of the publisher's goroutine would show
// here); chain-cpu-ns/op and chain-cpu-% what the block-hash chain of the request's
// 256 blocks (kv/blockhash's default, FNV-64a over CBOR) costs in CPU time on the
// same goroutine, computed right after the K/V writes as the prefix cache's events
// did inside Insert: kv's share of publishing, outside the calls timed above.
//
// events=prefix-cache is the whole of it: the publisher is the prefix cache's own
// observer (PrefixCacheOptions.Events, default block hashing), so its calls-ns/op
// against events=false's is all that publishing costs the cache, hashing and the
// cache's announced-block index included (benchstat -col /events).
func BenchmarkPublishCost(b *testing.B) {
	const prompt, budget, block = costPrompt, costBudget, 16
	g := costModel
	data := make([]byte, g.Groups[0].TokenBytes())
	for _, mode := range []string{"false", "true", "prefix-cache"} {
		on, inCache := mode == "true", mode == "prefix-cache"
		b.Run("events="+mode, func(b *testing.B) {
			var pub *kvevents.Publisher
			if on || inCache {
				pub = costPublisher(b)
			}
			var obs kv.BlockEvents
			if inCache {
				obs = pub
			}
			pc := costCache(b, obs)
			hasher, err := blockhash.New(blockhash.Options{})
			if err != nil {
				b.Fatal(err)
			}
			var chain []blockhash.Hash
			ids := make([]int32, prompt)
			next := int32(0)
			var announced [][]uint64 // each cached request's hashes, oldest first
			var evicted int64        // tokens evicted and not yet withdrawn
			removedEvents := 0
			var calls, publish time.Duration
			var callsCPU, publishCPU int64
			var clocks, clocksCPU []int64 // per request, their medians taken: a preemption inside one would swamp a sum
			var storedNs, removedNs []int64
			var ctxsw int64
			var hashingCPU int64
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			thread := func() int64 { return testutil.ThreadCPU(b) }
			serve := func() {
				for i := range ids {
					ids[i] = next
					next++
				}
				evictedBefore := pc.Stats().EvictedTokens // taking over an entry's ranges evicts it, in Lookup or Append
				c0, t0 := thread(), time.Now()
				s, _, err := pc.Lookup(ids)
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Append(prompt); err != nil {
					b.Fatal(err)
				}
				calls += time.Since(t0)
				callsCPU += thread() - c0
				for t := range prompt {
					for l := range g.Layers {
						_ = s.WriteToken(l, kv.K, t, data)
						_ = s.WriteToken(l, kv.V, t, data)
					}
				}
				if on {
					// The chain the prefix cache's observer would hash inside Insert.
					c0 := thread()
					chain = hasher.Chain(chain[:0], hasher.Root(), 0, ids)
					hashingCPU += thread() - c0
				}
				c0, t0 = thread(), time.Now()
				if err := pc.Insert(s, ids); err != nil {
					b.Fatal(err)
				}
				s.Close()
				calls += time.Since(t0)
				callsCPU += thread() - c0
				if !on {
					return
				}
				// What the observer hands over (the cache's work, not timed).
				stored := kv.BlocksStored{Hashes: make([]uint64, prompt/block), Tokens: append([]int32(nil), ids...), BlockSize: block, Medium: "CPU"}
				for i := range stored.Hashes {
					stored.Hashes[i] = uint64(next)<<20 | uint64(i)
				}
				// Each request's worth of tokens evicted withdraws the oldest request's blocks.
				evicted += pc.Stats().EvictedTokens - evictedBefore
				var removed []kv.BlocksRemoved
				for ; evicted >= prompt && len(announced) > 0; evicted -= prompt {
					removed = append(removed, kv.BlocksRemoved{Hashes: announced[0], Medium: "CPU"})
					announced = announced[1:]
				}
				announced = append(announced, stored.Hashes)
				// The clocks' own cost, read as around the publisher's calls but around
				// nothing: on this loaded VM time.Now takes ~0.3 us and the thread's CPU
				// clock (a system call) ~1.4 us, as much as the calls they time.
				c0, t0 = thread(), time.Now()
				clocks = append(clocks, time.Since(t0).Nanoseconds())
				clocksCPU = append(clocksCPU, thread()-c0)
				var ru0, ru1 unix.Rusage
				if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru0); err != nil {
					b.Fatal(err)
				}
				c0, t0 = thread(), time.Now()
				pub.BlocksStored(stored)
				t1 := time.Now()
				for _, r := range removed {
					pub.BlocksRemoved(r)
				}
				t2 := time.Now()
				removedEvents += len(removed)
				publish += time.Since(t0)
				publishCPU += thread() - c0
				if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru1); err != nil {
					b.Fatal(err)
				}
				ctxsw += ru1.Nvcsw - ru0.Nvcsw + ru1.Nivcsw - ru0.Nivcsw
				storedNs = append(storedNs, t1.Sub(t0).Nanoseconds())
				if len(removed) > 0 {
					removedNs = append(removedNs, t2.Sub(t1).Nanoseconds()/int64(len(removed)))
				}
			}
			for range 2 * budget / (prompt * g.BytesPerToken()) {
				serve()
			}
			calls, publish, callsCPU, publishCPU, clocks, clocksCPU, removedEvents = 0, 0, 0, 0, clocks[:0], clocksCPU[:0], 0
			storedNs, removedNs, ctxsw, hashingCPU = storedNs[:0], removedNs[:0], 0, 0
			b.SetBytes(int64(prompt * g.BytesPerToken()))
			for b.Loop() {
				serve()
			}
			b.ReportMetric(float64(calls.Nanoseconds())/float64(b.N), "calls-ns/op")
			b.ReportMetric(float64(callsCPU)/float64(b.N), "calls-cpu-ns/op")
			if inCache {
				pc.FlushEvents() // what the cache's events goroutine still holds
				closeChecked(b, pub)
			}
			if !on {
				return
			}
			b.ReportMetric(float64(publish.Nanoseconds())/float64(b.N), "publish-ns/op")
			b.ReportMetric(float64(publishCPU)/float64(b.N), "publish-cpu-ns/op")
			clock := time.Duration(median(clocks) * int64(b.N))
			clockCPU := median(clocksCPU) * int64(b.N)
			b.ReportMetric(float64(clock.Nanoseconds())/float64(b.N), "clock-ns/op")
			b.ReportMetric(float64(clockCPU)/float64(b.N), "clock-cpu-ns/op")
			// Each share nets the clocks out of both sides (the memory layer's calls are
			// timed in two windows a request).
			b.ReportMetric(100*float64(publish-clock)/float64(calls-2*clock), "publish-%")
			b.ReportMetric(100*float64(publishCPU-clockCPU)/float64(callsCPU-2*clockCPU), "publish-cpu-%")
			if removedEvents == 0 {
				b.Fatal("no evictions: not the scenario")
			}
			b.ReportMetric(float64(removedEvents)/float64(b.N), "removals/op")
			b.ReportMetric(float64(median(storedNs)), "stored-ns")
			if len(removedNs) > 0 {
				b.ReportMetric(float64(median(removedNs)), "removed-ns")
			}
			b.ReportMetric(float64(ctxsw)/float64(b.N), "publish-ctxsw/op")
			b.ReportMetric(float64(hashingCPU-clockCPU)/float64(b.N), "chain-cpu-ns/op")
			b.ReportMetric(100*float64(hashingCPU-clockCPU)/float64(callsCPU-2*clockCPU), "chain-cpu-%")
			st := closeChecked(b, pub)
			b.ReportMetric(float64(st.Batches)/float64(st.Published), "messages/event")
		})
	}
}

// The scenario of BenchmarkPublishCost and BenchmarkPublishShare: requests of
// costPrompt unique tokens on costModel, the prefix cache full within costBudget.
const costPrompt, costBudget = 4096, 512 << 20

var costModel = kv.Qwen25_05B()

// costPublisher returns a publisher at its default settings on an ephemeral loopback
// port, with one subscriber reading all it sends. The caller closes it
// (closeChecked).
func costPublisher(b *testing.B) *kvevents.Publisher {
	pub, err := kvevents.New(kvevents.Options{Endpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		b.Fatal(err)
	}
	sub := subscribe(b, pub, "", 1)
	go func() {
		for {
			if _, err := sub.ReadMsg(); err != nil {
				return
			}
		}
	}()
	return pub
}

// costCache returns the scenario's prefix cache over a cache of its own on host
// memory (2 MiB granules, populated, costBudget), obs its observer when not nil; all
// of it closed when b ends.
func costCache(b *testing.B, obs kv.BlockEvents) *kv.PrefixCache {
	gov := accounting.NewGovernor()
	if err := gov.SetLimit(accounting.HostKey, costBudget); err != nil {
		b.Fatal(err)
	}
	pool, err := host.NewShared(host.SharedOptions{Granularity: 2 << 20, Authority: gov.Authority("kv", accounting.HostKey), Populate: true, Name: "kvevents-bench"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { pool.Close() })
	c, err := kv.New(pool, kv.Config{Model: costModel, MaxTokens: costPrompt})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: obs}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { pc.Close() })
	return pc
}

// closeChecked closes pub and fails b if it dropped anything: the publisher did not
// keep up, and what was timed is not the scenario. It returns pub's last Stats.
func closeChecked(b *testing.B, pub *kvevents.Publisher) kvevents.Stats {
	if err := pub.Close(); err != nil {
		b.Fatal(err)
	}
	st := pub.Stats()
	if st.Dropped != 0 || st.SubscriberDrops != 0 {
		b.Fatalf("%d events and %d messages dropped: the publisher did not keep up", st.Dropped, st.SubscriberDrops)
	}
	if st.Published == 0 {
		b.Fatal("nothing published: not the scenario")
	}
	return st
}

func median(xs []int64) int64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkPublishShare is what publishing costs the cache's calls, measured finely
// enough to tell 1% where BenchmarkPublishCost's events=prefix-cache against
// events=false (separate runs, ±10% apart) can not: its scenario on two caches in the
// same process, one without events and one whose prefix cache's observer is a
// publisher at its default settings, each serving one request an op, in alternating
// order, so that the machine's drift falls on both alike. The memory layer's calls
// (look up, append, insert, close) are timed in the thread's CPU time, the clock's
// reads the same on both sides, and paired op by op.
//
// off-cpu-ns/op and on-cpu-ns/op are the two caches' calls; share-% is the extra CPU
// time of the calls with events as a share of those without (the sums'), and
// share-se-% its standard error from the spread of the ops' pairs: a share about
// twice share-se-% away from 0 is told apart from it. benchstat over counts gives
// share-%'s median and its spread from run to run. events=false is the control: the
// second cache without events too, so that its share-% (0 but for noise and any
// difference between two caches alike) tells what the method can resolve.
func BenchmarkPublishShare(b *testing.B) {
	for _, events := range []bool{false, true} {
		b.Run(fmt.Sprintf("events=%v", events), func(b *testing.B) { publishShare(b, events) })
	}
}

// publishShare is BenchmarkPublishShare with events on the second cache, or, without,
// its control: two caches alike, whose share-% must come out within its error of 0.
func publishShare(b *testing.B, events bool) {
	g := costModel
	data := make([]byte, g.Groups[0].TokenBytes())
	var pub *kvevents.Publisher
	var obs kv.BlockEvents
	if events {
		pub = costPublisher(b)
		obs = pub
	}
	caches := [2]*kv.PrefixCache{costCache(b, nil), costCache(b, obs)}
	ids := make([]int32, costPrompt)
	next := int32(0)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// serve serves a request of unique tokens and returns its calls' CPU time.
	serve := func(pc *kv.PrefixCache) int64 {
		for i := range ids {
			ids[i] = next
			next++
		}
		c0 := testutil.ThreadCPU(b)
		s, _, err := pc.Lookup(ids)
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Append(costPrompt); err != nil {
			b.Fatal(err)
		}
		cpu := testutil.ThreadCPU(b) - c0
		for t := range costPrompt {
			for l := range g.Layers {
				_ = s.WriteToken(l, kv.K, t, data)
				_ = s.WriteToken(l, kv.V, t, data)
			}
		}
		c0 = testutil.ThreadCPU(b)
		if err := pc.Insert(s, ids); err != nil {
			b.Fatal(err)
		}
		s.Close()
		return cpu + testutil.ThreadCPU(b) - c0
	}
	for range 2 * costBudget / (costPrompt * g.BytesPerToken()) {
		for _, pc := range caches {
			serve(pc)
		}
	}
	if caches[0].Stats().EvictedTokens == 0 || caches[1].Stats().EvictedTokens == 0 {
		b.Fatal("no evictions: not the scenario")
	}
	var off, on []int64
	b.SetBytes(int64(2 * costPrompt * g.BytesPerToken()))
	for b.Loop() {
		first := len(off) % 2 // which cache goes first: each in turn
		var cpu [2]int64
		cpu[first] = serve(caches[first])
		cpu[1-first] = serve(caches[1-first])
		off, on = append(off, cpu[0]), append(on, cpu[1])
	}
	if events {
		caches[1].FlushEvents()
		closeChecked(b, pub)
	}
	share, se := pairedShare(off, on)
	b.ReportMetric(float64(sum(off))/float64(len(off)), "off-cpu-ns/op")
	b.ReportMetric(float64(sum(on))/float64(len(on)), "on-cpu-ns/op")
	b.ReportMetric(share, "share-%")
	b.ReportMetric(se, "share-se-%")
}

// pairedShare returns how much on's sum exceeds off's, in % of off's, and the
// standard error of that figure from the spread of the pairs' differences.
func pairedShare(off, on []int64) (share, se float64) {
	n := float64(len(off))
	total := float64(sum(off))
	var mean, m2 float64 // of the differences, Welford's
	for i := range off {
		d := float64(on[i] - off[i])
		delta := d - mean
		mean += delta / float64(i+1)
		m2 += delta * (d - mean)
	}
	if len(off) < 2 || total == 0 {
		return 100 * mean * n / total, math.NaN()
	}
	sd := math.Sqrt(m2 / (n - 1))
	return 100 * mean * n / total, 100 * sd / math.Sqrt(n) * n / total
}

func sum(xs []int64) int64 {
	var t int64
	for _, x := range xs {
		t += x
	}
	return t
}
