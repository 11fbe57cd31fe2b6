package kv_test

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkPrefixCacheMiss is the cost of prefix caching when nothing is ever reused:
// requests of 4,096 unique tokens (Qwen2.5-0.5B, 2 MiB granules, a 512 MiB budget)
// are served with the prefix cache on (look up, prefill, insert, close; the cache
// holds the budget, and each miss takes over the ranges of the least recently used
// entry) and off (prefill, close; the pool keeps the granules idle for the next). Every token's K and V is
// written. Both are warmed up first to that steady state. calls-ns/op is the time in
// the memory layer's calls (start, append, insert, close), the K/V writes (the same
// in both) left out; calls-cpu-ns/op is the CPU time of those calls (the thread's,
// kernel included), which other processes sharing the machine do not inflate as they
// do the wall time. vLLM's bar for prefix caching on by default: at a 0% hit rate, at
// most 1% slower.
func BenchmarkPrefixCacheMiss(b *testing.B) {
	const prompt, budget = 4096, 512 << 20
	g := kv.Qwen25_05B()
	data := make([]byte, g.Groups[0].TokenBytes())
	for _, on := range []bool{false, true} {
		b.Run(fmt.Sprintf("prefix-cache=%v", on), func(b *testing.B) {
			c := openEnv(b, onShared, withGranule(2<<20), withLimit(budget), withShared(host.SharedOptions{Populate: true}), withName("kv-bench-pc"),
				withConfig(kv.Config{Model: g, MaxTokens: prompt})).c
			var pc *kv.PrefixCache
			var err error
			if on {
				if pc, err = kv.NewPrefixCache(c, kv.PrefixCacheOptions{}); err != nil {
					b.Fatal(err)
				}
				defer pc.Close()
			}
			ids := make([]int32, prompt)
			next := int32(0)
			var calls time.Duration // in the memory layer's calls, K/V writes left out
			var cpu int64           // the same calls' CPU time
			// NB: the thread's CPU clock counts only while the goroutine stays on it.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			thread := func() int64 { return testutil.ThreadCPU(b) }
			serve := func() {
				for i := range ids {
					ids[i] = next // never seen before: a 0% hit rate
					next++
				}
				c0, t0 := thread(), time.Now()
				var s *kv.Sequence
				if on {
					s, _, err = pc.Lookup(ids)
				} else {
					s, err = c.NewSequence()
				}
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Append(prompt); err != nil {
					b.Fatal(err)
				}
				calls += time.Since(t0)
				cpu += thread() - c0
				for t := range prompt {
					for l := range g.Layers {
						_ = s.WriteToken(l, kv.K, t, data)
						_ = s.WriteToken(l, kv.V, t, data)
					}
				}
				c0, t0 = thread(), time.Now()
				if on {
					if err := pc.Insert(s, ids); err != nil {
						b.Fatal(err)
					}
				}
				s.Close()
				calls += time.Since(t0)
				cpu += thread() - c0
			}
			for range 2 * budget / (prompt * g.BytesPerToken()) {
				serve()
			}
			b.SetBytes(int64(prompt * g.BytesPerToken()))
			calls, cpu = 0, 0
			for b.Loop() {
				serve()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/prompt, "ns/token")
			b.ReportMetric(float64(calls.Nanoseconds())/float64(b.N), "calls-ns/op")
			b.ReportMetric(float64(cpu)/float64(b.N), "calls-cpu-ns/op")
			if on {
				st := pc.Stats()
				if st.Hits != 0 || st.EvictedBytes == 0 {
					b.Fatalf("%d hits, %d bytes evicted: not the scenario", st.Hits, st.EvictedBytes)
				}
				// What the cache keeps at the end, in requests: the price of evicting
				// whole entries is keeping up to one fewer than the budget holds.
				b.ReportMetric(float64(st.CachedBytes)/float64(prompt*g.BytesPerToken()), "cached-requests")
			}
		})
	}
}
