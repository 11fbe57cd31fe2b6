package kv_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkTokenRead prices the ways host code reads one layer's K of a sequence
// (Llama-3-8B, 256 tokens: 512 KiB, in cache), summing every element, in ns an
// element: how=at, through View's Tensor.At one element at a time; how=run, kv.Run's
// contiguous runs as []F16; how=read, ReadTokens into a buffer of the caller's, then
// the buffer. Memory is a Private backing of 2 MiB granules (Blocked: 16 tokens a
// block, so a run of K is 16 tokens).
func BenchmarkTokenRead(b *testing.B) {
	const tokens = 256
	g := kv.Llama3_8B()
	per := g.Groups[0].KVHeads * g.Groups[0].HeadDim
	for _, layout := range []kv.Layout{kv.Blocked, kv.PerLayer} {
		c := openEnv(b, onPrivate, withGranule(2<<20), withPrivate(host.PrivateOptions{Populate: true}),
			withConfig(kv.Config{Model: g, MaxTokens: tokens, Layout: layout})).c
		s, err := c.NewSequence()
		require.NoError(b, err)
		require.NoError(b, s.Append(tokens))
		src := make([]byte, tokens*g.Groups[0].TokenBytes())
		for i := range src {
			src[i] = byte(i * 7)
		}
		require.NoError(b, s.WriteTokens(3, kv.K, 0, tokens, src))
		var want uint64
		for i := 0; i < len(src); i += 2 {
			want += uint64(src[i]) | uint64(src[i+1])<<8
		}
		elems := float64(tokens * per)
		report := func(b *testing.B, sum uint64) {
			if sum != want*uint64(b.N) {
				b.Fatalf("sum %d, want %d", sum, want*uint64(b.N))
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/elems, "ns/elem")
		}
		b.Run("layout="+layout.String()+"/how=at", func(b *testing.B) {
			var sum uint64
			for b.Loop() {
				v, err := kv.View[arena.F16](s, 3, kv.K)
				if err != nil {
					b.Fatal(err)
				}
				bt, st := s.BlockTokens(), stridesOf(s, 3)
				for t := range tokens {
					for h := range g.Groups[0].KVHeads {
						for d := range g.Groups[0].HeadDim {
							if bt > 0 {
								sum += uint64(v.At(append(blockIndex(st, t, 0), h, d)...))
							} else {
								sum += uint64(v.At(t, h, d))
							}
						}
					}
				}
			}
			report(b, sum)
		})
		b.Run("layout="+layout.String()+"/how=run", func(b *testing.B) {
			var sum uint64
			for b.Loop() {
				for t := 0; t < tokens; {
					run, err := kv.Run[arena.F16](s, 3, kv.K, t)
					if err != nil {
						b.Fatal(err)
					}
					for _, h := range run {
						sum += uint64(h)
					}
					t += len(run) / per
				}
			}
			report(b, sum)
		})
		b.Run("layout="+layout.String()+"/how=read", func(b *testing.B) {
			var sum uint64
			dst := make([]byte, len(src))
			for b.Loop() {
				if err := s.ReadTokens(3, kv.K, 0, tokens, dst); err != nil {
					b.Fatal(err)
				}
				for i := 0; i < len(dst); i += 2 {
					sum += uint64(dst[i]) | uint64(dst[i+1])<<8
				}
			}
			report(b, sum)
		})
		require.True(b, s.Close().OK())
		require.NoError(b, c.Close())
	}
}

// BenchmarkTokenWrite prices the per-token write a model's forward pass makes (one
// WriteToken per layer, K and V, for each new token), in ns a write, on a sequence
// started on a 64-token prefix (so that Writable is past 0, as on a prefix hit) that
// then writes tokens [64, 256): this cache in the Blocked layout on host.Shared (the
// prefix frozen, and the prefix a PrefixCache's hit), and the paged baseline (16-token
// blocks, the same prefix shared), in the same run. The
// copy of the token's bytes is common to both; the rest is each one's path to it: on
// Llama-3-8B (2 KiB a write) the copy is most of it, on qwen2.5-0.5b (256 bytes, the
// Mooncake replay's model) the path is.
func BenchmarkTokenWrite(b *testing.B) {
	for _, m := range []struct {
		model   kv.Model
		granule int // one whose blocks the 64-token prefix fills: it is mapped
	}{
		{kv.Llama3_8B(), 2 << 20},
		{kv.Qwen25_05B(), 64 << 10},
	} {
		b.Run("model="+m.model.Name, func(b *testing.B) { benchmarkTokenWrite(b, m.model, m.granule) })
	}
}

func benchmarkTokenWrite(b *testing.B, g kv.Model, granule int) {
	const prefix, tokens = 64, 256
	src := make([]byte, g.Groups[0].TokenBytes())
	for i := range src {
		src[i] = byte(i)
	}
	writes := float64((tokens - prefix) * g.Layers * 2)
	run := func(b *testing.B, write func(layer int, v baseline.Kind, t int, src []byte) error) {
		for b.Loop() {
			for t := prefix; t < tokens; t++ {
				for l := range g.Layers {
					for _, v := range []baseline.Kind{baseline.K, baseline.V} {
						if err := write(l, v, t, src); err != nil {
							b.Fatal(err)
						}
					}
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/writes, "ns/write")
	}
	b.Run("impl=vmarena", func(b *testing.B) {
		c := openEnv(b, onShared, withGranule(granule), withConfig(kv.Config{Model: g, MaxTokens: tokens})).c
		first, err := c.NewSequence()
		require.NoError(b, err)
		require.NoError(b, first.Append(prefix))
		p, err := first.Freeze(prefix)
		require.NoError(b, err)
		require.True(b, first.Close().OK())
		s, err := c.NewSequenceFrom(p)
		require.NoError(b, err)
		p.Release()
		require.NoError(b, s.Append(tokens-prefix))
		require.Equal(b, prefix, s.Writable())
		run(b, func(l int, v baseline.Kind, t int, src []byte) error { return s.WriteToken(l, kv.Kind(v), t, src) })
		require.True(b, s.Close().OK())
	})
	b.Run("impl=vmarena+prefix-cache", func(b *testing.B) {
		// The same, the prefix a prefix cache's hit: a sequence a PrefixCache made
		// carries the cache's write hook (its lazily mapped tokens).
		c := openEnv(b, onShared, withGranule(granule), withConfig(kv.Config{Model: g, MaxTokens: tokens})).c
		pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
		require.NoError(b, err)
		ids := make([]int32, prefix+1)
		for i := range ids {
			ids[i] = int32(i)
		}
		first, m, err := pc.Lookup(ids)
		require.NoError(b, err)
		require.Zero(b, m)
		require.NoError(b, first.Append(prefix))
		require.NoError(b, pc.Insert(first, ids[:prefix]))
		require.True(b, first.Close().OK())
		s, m, err := pc.Lookup(ids)
		require.NoError(b, err)
		require.Equal(b, prefix, m)
		require.NoError(b, s.Append(tokens-prefix))
		run(b, func(l int, v baseline.Kind, t int, src []byte) error { return s.WriteToken(l, kv.Kind(v), t, src) })
		require.True(b, s.Close().OK())
		require.NoError(b, pc.Close())
	})
	b.Run("impl=paged", func(b *testing.B) {
		st, err := baseline.NewPaged(baseline.Shape{Layers: g.Layers, TokenBytes: g.Groups[0].TokenBytes(), MaxTokens: tokens}, baseline.PagedOptions{})
		require.NoError(b, err)
		defer st.Close()
		first, err := st.NewSequence()
		require.NoError(b, err)
		require.NoError(b, first.Append(prefix))
		p, err := first.Freeze(prefix)
		require.NoError(b, err)
		require.NoError(b, first.Close())
		s, err := st.NewSequenceFrom(p)
		require.NoError(b, err)
		p.Release()
		require.NoError(b, s.Append(tokens-prefix))
		run(b, s.WriteToken)
		require.NoError(b, s.Close())
	})
}
