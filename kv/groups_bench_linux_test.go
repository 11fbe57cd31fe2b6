package kv_test

import (
	"testing"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkDecodeStepGroups measures a decode step of a batch of 8 gpt-oss-20b
// sequences of about 2,048 tokens on a cache of groups: append one token to each
// (AppendBatch: the sliding-window group gives back the blocks its window left),
// write its K and V in every layer, then load every live token's K and V of every
// layer run by run (Run): a window layer's last 128 tokens, a full layer's all. The
// controls are the same step on a one-group cache of full-attention layers of the
// same shape holding as many live bytes: model=full, 24 layers of about (n + 128) / 2
// tokens (its blocks hold 128 tokens in 3 granules), and model=full12, the full
// group's 12 layers alone of n + 128 tokens (256 tokens in 3 granules, as the
// groups' full group; their window group's blocks hold 64 tokens in one granule).
// model=groups-one-token-blocks is the groups' step on the blocks the default chose
// before (BlockTokens 1), and model=groups-runs16 on the default blocks cut into
// runs of 16 tokens (RunTokens 16), whose reads are shorter runs and whose writes lie
// a run apart rather than a block's run. Memory is populated on commit (2 MiB granules, 4 KiB pages).
// b.SetBytes is the bytes a step loads, so that benchstat compares time per byte (the
// issue's target: groups at most 1.05x the full step's).
func BenchmarkDecodeStepGroups(b *testing.B) {
	const (
		seqs    = 8
		tokens  = 2048
		room    = 512
		granule = 2 << 20
	)
	m := kv.GPTOSS20B()
	window := m.Groups[0].Window
	shape := kv.Uniform("gpt-oss-20b-full", m.Layers, 8, 64, arena.BFloat16)
	// The full group's shape alone: its blocks hold as many tokens. A model of its
	// own, since a copy of shape with fewer Layers would keep shape's group, which
	// lists all 24 layers.
	half := kv.Uniform("gpt-oss-20b-full12", m.Layers/2, 8, 64, arena.BFloat16)
	elems := shape.Groups[0].KVHeads * shape.Groups[0].HeadDim
	token := make([]byte, shape.Groups[0].TokenBytes())
	for i := range token {
		token[i] = byte(i)
	}
	cases := []struct {
		name  string
		cfg   kv.Config
		start func(k int) int // sequence k's first length
		from  func(layer, n int) int
	}{
		{"groups", kv.Config{Model: m}, func(k int) int { return tokens + 1 + 2*k }, func(layer, n int) int {
			if layer%2 == 0 { // gpt-oss's window layers
				return max(0, n-window)
			}
			return 0
		}},
		// The blocks the default chose before blocks were chosen per group (the
		// fewest granules that hold one token: 85 tokens, 8 KiB dead, in both groups).
		{"groups-one-token-blocks", kv.Config{Model: m, BlockTokens: 1}, func(k int) int { return tokens + 1 + 2*k }, func(layer, n int) int {
			if layer%2 == 0 {
				return max(0, n-window)
			}
			return 0
		}},
		// The default blocks, cut into runs of 16 tokens of every layer.
		{"groups-runs16", kv.Config{Model: m, RunTokens: 16}, func(k int) int { return tokens + 1 + 2*k }, func(layer, n int) int {
			if layer%2 == 0 {
				return max(0, n-window)
			}
			return 0
		}},
		{"full", kv.Config{Model: shape}, func(k int) int { return (tokens + 1 + 2*k + window) / 2 }, func(int, int) int { return 0 }},
		{"full12", kv.Config{Model: half}, func(k int) int { return tokens + 1 + 2*k + window }, func(int, int) int { return 0 }},
	}
	for _, tc := range cases {
		b.Run("model="+tc.name, func(b *testing.B) {
			cfg := tc.cfg
			layers := m.Layers
			if cfg.Model.Layers > 0 {
				layers = cfg.Model.Layers
			}
			cfg.MaxTokens = tokens + room
			c := openEnv(b, onPrivate, withGranule(granule), withPrivate(host.PrivateOptions{Populate: true, NoHugePages: true}), withConfig(cfg)).c
			qs := benchSequences(b, c, seqs, func(k int) int { return tc.start(k) - 1 })
			batch := make([]kv.Growth, 0, seqs)
			for _, q := range qs {
				batch = append(batch, kv.Growth{Seq: q, Tokens: 1})
			}
			// The bytes a step loads, at the first step (they grow by the full
			// layers' share of a token a step).
			var step int64
			for _, q := range qs {
				for l := range layers {
					step += int64(2 * (q.Len() + 1 - tc.from(l, q.Len()+1)) * len(token))
				}
			}
			b.SetBytes(step)
			for b.Loop() {
				if qs[0].Len() == tokens+room {
					b.Fatalf("more steps than the %d tokens of room", room)
				}
				if err := c.AppendBatch(batch); err != nil {
					b.Fatal(err)
				}
				for _, q := range qs {
					t := q.Len() - 1
					for l := range layers {
						for _, kind := range []kv.Kind{kv.K, kv.V} {
							if err := q.WriteToken(l, kind, t, token); err != nil {
								b.Fatal(err)
							}
						}
					}
				}
				for l := range layers {
					for _, q := range qs {
						n := q.Len()
						at := 0
						for t := tc.from(l, n); t < n; {
							rk, err := kv.Run[arena.BF16](q, l, kv.K, t)
							if err != nil {
								b.Fatal(err)
							}
							rv, err := kv.Run[arena.BF16](q, l, kv.V, t)
							if err != nil {
								b.Fatal(err)
							}
							at += load(rk) + load(rv)
							t += len(rk) / elems
						}
						if want := 2 * (n - tc.from(l, n)) * len(token); at != want {
							b.Fatalf("layer %d loaded %d bytes, want %d", l, at, want)
						}
					}
				}
			}
			b.ReportMetric(float64(c.Stats().Committed)/(1<<20), "MiB-committed")
		})
	}
}
