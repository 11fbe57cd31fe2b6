package kv_test

import (
	"fmt"
	"testing"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// The serving scenario of the KV benchmarks: Llama-3-8B in fp16, 16 sequences on a
// shared 256-token prefix, each decoding to 1,024 tokens one token per step, with
// room for 2,048 tokens per sequence. Every token's K and V is written.
const (
	benchSeqs      = 16
	benchPrefix    = 256
	benchFinal     = 1024
	benchMaxTokens = 2048
)

// benchModel is the scenario's model, made once: a preset is a function that builds a
// fresh Model, which the token loops must not pay for.
var (
	benchModel = kv.Llama3_8B()
	benchKinds = kv.KindsOf(benchModel)
)

// benchNeed is the exact memory the scenario needs at its peak, the prefix counted
// once.
var benchNeed = int64(benchPrefix+benchSeqs*(benchFinal-benchPrefix)) * int64(benchModel.BytesPerToken())

// benchAppended is the tokens one run appends: the prefix's prefill and every decode.
const benchAppended = benchPrefix + benchSeqs*(benchFinal-benchPrefix)

func reportScenario(b *testing.B, peak int64) {
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/benchAppended, "ns/token")
	b.ReportMetric(float64(peak), "peak-B")
	b.ReportMetric(float64(peak)/float64(benchSeqs*benchFinal), "B/live-token")
	b.ReportMetric(100*float64(peak-benchNeed)/float64(peak), "waste%")
	b.ReportMetric(float64(peak)/float64(benchNeed), "peak/need")
}

// tokenData is one token of one tensor's K or V.
var tokenData = func() []byte {
	b := make([]byte, benchModel.Groups[0].TokenBytes())
	for i := range b {
		b[i] = byte(i * 7)
	}
	return b
}()

type hostCache = kv.Cache

// writeLast writes the K and V of s's last token in every layer.
func writeLast(b *testing.B, s *kv.Sequence) {
	t := s.Len() - 1
	for layer := range benchModel.Layers {
		for _, kind := range benchKinds {
			if err := s.WriteToken(layer, kind, t, tokenData); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// runCache runs the scenario once on c.
func runCache(b *testing.B, c *hostCache) {
	sys, err := c.NewSequence()
	if err != nil {
		b.Fatal(err)
	}
	for range benchPrefix {
		if err := sys.Append(1); err != nil {
			b.Fatal(err)
		}
		writeLast(b, sys)
	}
	p, err := sys.Freeze(benchPrefix)
	if err != nil {
		b.Fatal(err)
	}
	sys.Close()
	seqs := make([]*kv.Sequence, benchSeqs)
	for i := range seqs {
		if seqs[i], err = c.NewSequenceFrom(p); err != nil {
			b.Fatal(err)
		}
	}
	p.Release()
	for range benchFinal - benchPrefix {
		for _, s := range seqs {
			if err := s.Append(1); err != nil {
				b.Fatal(err)
			}
			writeLast(b, s)
		}
	}
	for _, s := range seqs {
		if out := s.Close(); !out.OK() {
			b.Fatal(out)
		}
	}
}

// runStrategy runs the scenario once on a baseline strategy.
func runStrategy(b *testing.B, st baseline.Strategy) {
	write := func(s baseline.Sequence) {
		t := s.Len() - 1
		for layer := range benchModel.Layers {
			for _, kind := range []baseline.Kind{baseline.K, baseline.V} {
				if err := s.WriteToken(layer, kind, t, tokenData); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	sys, err := st.NewSequence()
	if err != nil {
		b.Fatal(err)
	}
	for range benchPrefix {
		if err := sys.Append(1); err != nil {
			b.Fatal(err)
		}
		write(sys)
	}
	p, err := sys.Freeze(benchPrefix)
	if err != nil {
		b.Fatal(err)
	}
	if err := sys.Close(); err != nil {
		b.Fatal(err)
	}
	seqs := make([]baseline.Sequence, benchSeqs)
	for i := range seqs {
		if seqs[i], err = st.NewSequenceFrom(p); err != nil {
			b.Fatal(err)
		}
	}
	p.Release()
	for range benchFinal - benchPrefix {
		for _, s := range seqs {
			if err := s.Append(1); err != nil {
				b.Fatal(err)
			}
			write(s)
		}
	}
	for _, s := range seqs {
		if err := s.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkServe runs the serving scenario on this cache (in both layouts, at 64 KiB
// and 2 MiB granules) and on what a server would do instead: eager preallocation of
// MaxTokens per sequence, a paged block table of 16-token blocks, Go append. Memory
// kept for reuse counts: each strategy is warm, as a server is after its first
// requests, so the timed runs measure the token path.
func BenchmarkServe(b *testing.B) {
	shape := baseline.Shape{Layers: benchModel.Layers, TokenBytes: benchModel.Groups[0].TokenBytes(), MaxTokens: benchMaxTokens}
	for _, cfg := range []struct {
		layout  kv.Layout
		granule int
	}{
		{kv.PerLayer, 64 << 10},
		{kv.PerLayer, 2 << 20},
		{kv.Blocked, 64 << 10},
		{kv.Blocked, 2 << 20},
	} {
		b.Run(fmt.Sprintf("impl=vmarena/layout=%v/granule=%dKiB", cfg.layout, cfg.granule>>10), func(b *testing.B) {
			// A pool that keeps the whole working set, as a warm server does.
			e := openEnv(b, onShared, withGranule(cfg.granule), withShared(host.SharedOptions{High: int(2*benchNeed) / cfg.granule}),
				withConfig(kv.Config{Model: kv.Llama3_8B(), MaxTokens: benchMaxTokens, Layout: cfg.layout}))
			c, gov := e.c, e.gov
			runCache(b, c) // warm the pool
			gov.ResetPeak(accounting.HostKey)
			for b.Loop() {
				runCache(b, c)
			}
			reportScenario(b, gov.Stats(accounting.HostKey).Peak)
		})
	}
	strategies := []struct {
		name string
		make func() (baseline.Strategy, error)
	}{
		{"eager", func() (baseline.Strategy, error) {
			return baseline.NewEager(shape, baseline.EagerOptions{Slots: benchSeqs + 1})
		}},
		{"paged", func() (baseline.Strategy, error) { return baseline.NewPaged(shape, baseline.PagedOptions{}) }},
		{"append", func() (baseline.Strategy, error) { return baseline.NewAppend(shape, baseline.AppendOptions{}) }},
	}
	for _, s := range strategies {
		b.Run("impl="+s.name, func(b *testing.B) {
			st, err := s.make()
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			runStrategy(b, st) // warm: slots cleared, pools grown
			for b.Loop() {
				runStrategy(b, st)
			}
			reportScenario(b, st.Stats().PeakPhysical)
		})
	}
}

// BenchmarkStep compares a batch step of 32 sequences that commits nothing with a
// single Append that commits nothing: the step should cost at most 32 appends. The
// sequences are rolled back (untimed) before a step would cross a granule. The same
// steps on the paged baseline (impl=paged: one sequence's Append, and 32 sequences'
// Appends one after another, as a paged server's step grows each) are what a step
// costs with a block table and no memory given back: its sequences start again
// (untimed) before they would take a second block, so that its steps take no block
// either.
func BenchmarkStep(b *testing.B) {
	const batchSeqs = 32
	for _, n := range []int{1, batchSeqs} {
		name := "op=append"
		if n > 1 {
			name = fmt.Sprintf("op=batch/seqs=%d", n)
		}
		b.Run("impl=paged/"+name, func(b *testing.B) {
			shape := baseline.Shape{Layers: benchModel.Layers, TokenBytes: benchModel.Groups[0].TokenBytes(), MaxTokens: benchMaxTokens}
			st, err := baseline.NewPaged(shape, baseline.PagedOptions{Blocks: 2 * n})
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			seqs := make([]baseline.Sequence, n)
			start := func() {
				for i := range seqs {
					if seqs[i] != nil {
						if err := seqs[i].Close(); err != nil {
							b.Fatal(err)
						}
					}
					if seqs[i], err = st.NewSequence(); err != nil {
						b.Fatal(err)
					}
					if err := seqs[i].Append(1); err != nil { // the first block
						b.Fatal(err)
					}
				}
			}
			start()
			pool := st.Stats().PeakPhysical
			defer func() {
				for _, s := range seqs {
					if err := s.Close(); err != nil {
						b.Fatal(err)
					}
				}
			}()
			for b.Loop() {
				if seqs[0].Len() == baseline.DefaultBlockTokens {
					b.StopTimer()
					start()
					b.StartTimer()
				}
				for _, s := range seqs {
					if err := s.Append(1); err != nil {
						b.Fatal(err)
					}
				}
			}
			if got := st.Stats().PeakPhysical; got != pool {
				b.Fatalf("the paged steps grew the pool: %d bytes at the peak, %d before", got, pool)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/seq")
		})
	}
	for _, layout := range []kv.Layout{kv.PerLayer, kv.Blocked} {
		for _, n := range []int{1, batchSeqs} {
			name := "op=append"
			if n > 1 {
				name = fmt.Sprintf("op=batch/seqs=%d", n)
			}
			b.Run(fmt.Sprintf("layout=%v/%s", layout, name), func(b *testing.B) {
				c := openEnv(b, onShared, withGranule(2<<20), withConfig(kv.Config{Model: kv.Llama3_8B(), MaxTokens: benchMaxTokens, Layout: layout})).c
				row := benchModel.BytesPerToken() // Blocked: a 2 MiB block holds 16 tokens
				if layout == kv.PerLayer {
					row = benchModel.Groups[0].TokenBytes()
				}
				perGranule := (2 << 20) / row
				batch := make([]kv.Growth, n)
				for i := range batch {
					s, err := c.NewSequence()
					if err != nil {
						b.Fatal(err)
					}
					defer s.Close()
					if err := s.Append(1); err != nil { // the first granule
						b.Fatal(err)
					}
					batch[i] = kv.Growth{Seq: s, Tokens: 1}
				}
				s := batch[0].Seq
				for b.Loop() {
					if s.Len() == perGranule {
						b.StopTimer()
						for _, g := range batch {
							if err := g.Seq.Truncate(1); err != nil {
								b.Fatal(err)
							}
						}
						b.StartTimer()
					}
					var err error
					if n == 1 {
						err = s.Append(1)
					} else {
						err = c.AppendBatch(batch)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/seq")
			})
		}
	}
}
