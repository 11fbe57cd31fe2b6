package filetier_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/filetier"
)

// BenchmarkLookupAsync is a scheduler that admits a request whose prompt the file tier
// holds while it runs decode steps for a batch of 8 other sequences, one goroutine as a
// server's scheduler loop is: one op is one admission of a 513-token prompt (eight 2
// MiB blocks of Llama-3.2-1B, read with direct I/O) and the steps the batch takes
// until the request's sequence is ready. With mode=sync the scheduler calls Lookup,
// which reads the blocks in its goroutine, and steps once it returns; with mode=async
// it calls LookupAsync and steps until Done. held-ns/op is the longest the memory
// layer held the scheduler during the admission (the lookup's call, or a step's
// appends), stall-ns/op the longest time between two steps' ends (what every running
// request's next token waits, the device's wait included), ready-ns/op the admission's time until its sequence is ready, steps/op the
// batch's steps meanwhile. The batch's sequences go back to 512 tokens when they reach
// 1,024, in both modes. With step=device each step then waits 1 ms, as a scheduler
// waits for a GPU's decode step of a small batch (its CPU idle meanwhile); with
// step=cpu it takes the next step at once, as a server whose steps run on the CPUs
// does, so that the loads share them with the steps. Compare with benchstat -col
// /mode.
func BenchmarkLookupAsync(b *testing.B) {
	for _, bc := range []struct {
		step string
		wait time.Duration
	}{{"device", time.Millisecond}, {"cpu", 0}} {
		for _, mode := range []string{"sync", "async"} {
			b.Run("step="+bc.step+"/mode="+mode, func(b *testing.B) {
				benchLookupAsync(b, mode, bc.wait)
			})
		}
	}
}

func benchLookupAsync(b *testing.B, mode string, wait time.Duration) {
	model := kv.Llama32_1B()
	cache := benchCache(b, model)
	ft, err := filetier.New(filetier.Options{Dir: benchDir(b), Budget: 1 << 30, Logger: quiet})
	require.NoError(b, err)
	defer ft.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{Tiers: []kv.Tier{ft}, TierWait: 10 * time.Second})
	require.NoError(b, err)
	defer pc.Close()

	prompt := make([]int32, 8*64+1)
	for i := range prompt {
		prompt[i] = int32(i)
	}
	s, cached, err := pc.Lookup(prompt)
	require.NoError(b, err)
	require.Zero(b, cached)
	require.NoError(b, s.Append(len(prompt)))
	row := make([]byte, len(prompt)*model.Groups[0].TokenBytes())
	for i := range row {
		row[i] = byte(i * 7)
	}
	for layer := range model.Layers {
		for _, kind := range []kv.Kind{kv.K, kv.V} {
			require.NoError(b, s.WriteTokens(layer, kind, 0, len(prompt), row))
		}
	}
	require.NoError(b, pc.Insert(s, prompt))
	s.Close()
	_, err = pc.Evict(1 << 40) // its blocks go down into the file tier
	require.NoError(b, err)
	require.EqualValues(b, 8, ft.Stats().Blocks)

	batch := make([]*kv.Sequence, 8)
	for i := range batch {
		batch[i], err = cache.NewSequence()
		require.NoError(b, err)
		require.NoError(b, batch[i].Append(512))
		defer batch[i].Close()
	}
	var last time.Time // the last step's end
	var stall, held time.Duration
	steps := 0
	stepBatch := func() {
		t := time.Now()
		for _, s := range batch {
			if s.Len() == 1024 {
				if err := s.Truncate(512); err != nil {
					b.Fatal(err)
				}
			}
			if err := s.Append(1); err != nil {
				b.Fatal(err)
			}
		}
		held = max(held, time.Since(t))
		if wait > 0 {
			time.Sleep(wait) // the device computes the step
		}
		now := time.Now()
		stall = max(stall, now.Sub(last))
		last = now
		steps++
	}
	var stalls, helds, ready time.Duration
	for b.Loop() {
		stall, held = 0, 0
		t0 := time.Now()
		last = t0
		var q *kv.Sequence
		var m int
		if mode == "sync" {
			q, m, err = pc.Lookup(prompt)
			if err != nil {
				b.Fatal(err)
			}
			held = time.Since(t0)
		} else {
			p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, prompt)
			if err != nil {
				b.Fatal(err)
			}
			held = time.Since(t0)
		loop:
			for {
				select {
				case <-p.Done():
					break loop
				default:
					stepBatch()
				}
			}
			q, m = p.Wait()
		}
		ready += time.Since(t0)
		stepBatch() // the scheduler's next step, after the admission
		stalls += stall
		helds += held
		if m != 8*64 {
			b.Fatalf("loaded %d tokens, not the 512 the tier holds", m)
		}
		q.Close()
	}
	b.ReportMetric(float64(helds.Nanoseconds())/float64(b.N), "held-ns/op")
	b.ReportMetric(float64(stalls.Nanoseconds())/float64(b.N), "stall-ns/op")
	b.ReportMetric(float64(ready.Nanoseconds())/float64(b.N), "ready-ns/op")
	b.ReportMetric(float64(steps)/float64(b.N), "steps/op")
	if st := pc.Stats().Tiers[0]; st.Drops != 0 {
		b.Fatalf("%d drops", st.Drops)
	}
}
