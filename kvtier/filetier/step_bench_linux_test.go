package filetier_test

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/filetier"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// BenchmarkDecodeStep is the token path with the file tier below the cache, with the
// host tier, with a tier that only sleeps, and without a tier: one op is a decode step
// of a batch of 8 sequences (Append of one token each) on 2 MiB granules (a block of
// Llama-3.2-1B is 64 tokens, 2 MiB). Every 64 steps one sequence ends and a new
// request takes its place: a lookup of its 1,024-token prompt (the first 512 shared
// by every request), its prefill (a write of the new tokens' K and V, as a server's
// prefill writes them) and an insert, which with a tier writes the prompt's 8 new
// blocks through in the background. The admission is timed apart (admit-ns/op, the
// timer stopped); ns/op is the steps', with the stores (copies out, checksums, direct
// writes) running beside them on the same CPUs. grow-ns/op is the part of ns/op spent
// in the steps where a sequence commits its next block (one in 64 of a sequence's
// steps): a tier's memory work (page faults, populating its own pages) holds those in
// the kernel. The step-* figures are the step's thread's own (below). Compare with
// benchstat -col /tier.
func BenchmarkDecodeStep(b *testing.B) {
	for _, tier := range []string{"none", "file", "host", "sleep"} {
		b.Run("tier="+tier, func(b *testing.B) {
			model := kv.Llama32_1B()
			cache := benchCache(b, model)
			opts := kv.PrefixCacheOptions{}
			var ft *filetier.Tier
			var err error
			switch tier {
			case "file":
				ft, err = filetier.New(filetier.Options{Dir: benchDir(b), Budget: 1 << 30, Logger: quiet})
				require.NoError(b, err)
				defer ft.Close()
				opts = kv.PrefixCacheOptions{Tiers: []kv.Tier{ft}, TierWriteThrough: true, TierWait: time.Second}
			case "sleep":
				// A tier that takes 2 ms per store and keeps nothing, with no copy and
				// no I/O: what the cache's write-through machinery costs the step alone.
				opts = kv.PrefixCacheOptions{Tiers: []kv.Tier{sleepTier{}}, TierWriteThrough: true, TierWait: time.Second}
			case "host":
				// The same stores into host memory: what the cache's write-through
				// costs the step whatever the tier.
				ht, err := hosttier.New(hosttier.Options{Budget: 1 << 30})
				require.NoError(b, err)
				defer ht.Close()
				opts = kv.PrefixCacheOptions{Tiers: []kv.Tier{ht}, TierWriteThrough: true, TierWait: time.Second}
			}
			pc, err := kv.NewPrefixCache(cache, opts)
			require.NoError(b, err)
			defer pc.Close()

			kvBytes := make([]byte, 1024*model.Groups[0].TokenBytes())
			for i := range kvBytes {
				kvBytes[i] = byte(i * 7)
			}
			next := 0
			admit := func() *kv.Sequence {
				prompt := make([]int32, 1024)
				for i := range prompt {
					prompt[i] = int32(i)
					if i >= 512 {
						prompt[i] = int32(next<<16 | i)
					}
				}
				next++
				s, cached, err := pc.Lookup(prompt)
				require.NoError(b, err)
				require.NoError(b, s.Append(len(prompt)-cached))
				// The prefill writes the new tokens' K and V, as a server's does
				// before the blocks can be stored: the first touch of that memory is
				// the prefill's, not the stores'.
				from := s.Writable()
				for layer := range model.Layers {
					for _, kind := range []kv.Kind{kv.K, kv.V} {
						require.NoError(b, s.WriteTokens(layer, kind, from, len(prompt), kvBytes[:(len(prompt)-from)*model.Groups[0].TokenBytes()]))
					}
				}
				require.NoError(b, pc.Insert(s, prompt))
				return s
			}
			batch := make([]*kv.Sequence, 8)
			for i := range batch {
				batch[i] = admit()
			}
			// The steps run on one thread, whose own counts say what the step did
			// apart from how long it waited for a CPU: step-cpu-ns/op its CPU time
			// (CLOCK_THREAD_CPUTIME_ID), and per op its page faults, its waits (a
			// sleep on a lock or in the kernel) and the times the kernel gave its CPU
			// to another thread (getrusage RUSAGE_THREAD). They are read at the
			// admissions only, and cover the steps from the first to the last
			// admission: b.Loop's first and last calls stop the world.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var used, u0 threadUsage
			counted := 0 // steps in used
			step := 0
			var admitting time.Duration // admissions' wall time, not in ns/op
			var growing time.Duration   // the steps' that commit a block, in ns/op
			var t0 time.Time
			for b.Loop() {
				if step == 0 {
					u0 = readThreadUsage(b)
				}
				grows := false // a sequence commits its next block in this step
				for _, s := range batch {
					grows = grows || s.Len()%64 == 0
				}
				if grows {
					t0 = time.Now()
				}
				for _, s := range batch {
					if err := s.Append(1); err != nil {
						b.Fatal(err)
					}
				}
				if grows {
					growing += time.Since(t0)
				}
				step++
				if step%64 == 0 {
					i := step / 64 % len(batch)
					used = used.add(readThreadUsage(b).sub(u0))
					counted = step
					b.StopTimer()
					t0 = time.Now()
					batch[i].Close()
					batch[i] = admit()
					admitting += time.Since(t0)
					b.StartTimer() // reads the memory statistics: a stop of the world
					u0 = readThreadUsage(b)
				}
			}
			for _, s := range batch {
				s.Close()
			}
			if ts := pc.Stats().Tiers; len(ts) > 0 {
				b.ReportMetric(float64(ts[0].StoreBytes)/float64(b.N), "stored-B/op")
				b.ReportMetric(float64(ts[0].Drops)/float64(b.N), "dropped/op")
			}
			b.ReportMetric(float64(next)/float64(b.N), "requests/op")
			b.ReportMetric(float64(admitting.Nanoseconds())/float64(b.N), "admit-ns/op")
			b.ReportMetric(float64(growing.Nanoseconds())/float64(b.N), "grow-ns/op")
			if counted > 0 {
				b.ReportMetric(float64(used.cpu.Nanoseconds())/float64(counted), "step-cpu-ns/op")
				b.ReportMetric(float64(used.faults)/float64(counted), "step-faults/op")
				b.ReportMetric(float64(used.waits)/float64(counted), "step-waits/op")
				b.ReportMetric(float64(used.preempted)/float64(counted), "step-preempted/op")
			}
		})
	}
}

// benchCache returns a cache of model on host.Shared memory of 2 MiB granules, of
// 4,096 tokens a sequence, closed (with its pool) when b ends.
func benchCache(b *testing.B, model kv.Model) *kv.Cache {
	pool, err := host.NewShared(host.SharedOptions{Granularity: 2 << 20,
		Authority: accounting.NewGovernor().Authority("kv", accounting.HostKey)})
	require.NoError(b, err)
	b.Cleanup(func() { pool.Close() })
	cache, err := kv.New(pool, kv.Config{Model: model, MaxTokens: 4096})
	require.NoError(b, err)
	b.Cleanup(func() { cache.Close() })
	return cache
}

// threadUsage is what the calling thread has used: its CPU time (user and system),
// its page faults, its waits (voluntary context switches: a sleep on a lock or in
// the kernel) and the times the kernel took its CPU away (involuntary ones).
type threadUsage struct {
	cpu                      time.Duration
	faults, waits, preempted int64
}

func readThreadUsage(b *testing.B) threadUsage {
	var ru unix.Rusage
	require.NoError(b, unix.Getrusage(unix.RUSAGE_THREAD, &ru))
	var ts unix.Timespec
	require.NoError(b, unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts))
	return threadUsage{cpu: time.Duration(ts.Nano()),
		faults: ru.Minflt + ru.Majflt, waits: ru.Nvcsw, preempted: ru.Nivcsw}
}

func (u threadUsage) add(v threadUsage) threadUsage {
	return threadUsage{u.cpu + v.cpu, u.faults + v.faults, u.waits + v.waits, u.preempted + v.preempted}
}

func (u threadUsage) sub(v threadUsage) threadUsage {
	return threadUsage{u.cpu - v.cpu, u.faults - v.faults, u.waits - v.waits, u.preempted - v.preempted}
}

// sleepTier takes 2 ms per store and refuses it, without calling fill: a tier with no
// cost of its own on the CPUs.
type sleepTier struct{}

var errSlept = errors.New("sleepTier: dropped")

func (sleepTier) Name() string { return "sleep" }
func (sleepTier) Store(context.Context, tierval.Key, int, func([]byte) error) error {
	time.Sleep(2 * time.Millisecond)
	return errSlept
}
func (sleepTier) Load(context.Context, tierval.Key, func([]byte) error) error { return kv.ErrTierMiss }
func (sleepTier) Contains(context.Context, []tierval.Key) (int, error)        { return 0, nil }
func (sleepTier) Delete(context.Context, tierval.Key) error                   { return nil }
