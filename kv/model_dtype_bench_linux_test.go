package kv_test

import (
	"testing"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkDecodeStepDType measures the memory layer's part of a decode step with
// FP8 against fp16 elements at the same batch (issue 25's FP8 target): append one
// token to each of 8 sequences of about 1,024 tokens (Llama-3-8B's shape), write its
// K and V in every layer (WriteToken), then load every layer's K and V of every
// sequence run by run (Run, in the Blocked layout, 2 MiB granules populated on
// commit, 4 KiB pages). The FP8 step moves half the bytes; ns/token is the step's
// time per token appended. Compare dtype=f16 and dtype=f8e4m3 with benchstat.
func BenchmarkDecodeStepDType(b *testing.B) {
	b.Run("dtype=f16", func(b *testing.B) { decodeStepDType[arena.F16](b, arena.Float16) })
	b.Run("dtype=f8e4m3", func(b *testing.B) { decodeStepDType[arena.F8E4M3](b, arena.Float8E4M3) })
}

func decodeStepDType[T arena.Elem](b *testing.B, dt arena.DType) {
	const (
		seqs, tokens, room = 8, 1024, 256
		granule            = 2 << 20
	)
	g := kv.Llama3_8B()
	g.Groups[0].DType = dt
	c := openEnv(b, onPrivate, withGranule(granule), withPrivate(host.PrivateOptions{Populate: true, NoHugePages: true}),
		withConfig(kv.Config{Model: g, MaxTokens: tokens + room, Layout: kv.Blocked})).c
	var err error
	qs := make([]*kv.Sequence, seqs)
	b.Cleanup(func() {
		for _, q := range qs {
			if q != nil && !q.Close().OK() {
				b.Error("a sequence did not close cleanly")
			}
		}
		if err := c.Close(); err != nil {
			b.Error(err)
		}
	})
	for k := range qs {
		if qs[k], err = c.NewSequence(); err != nil {
			b.Fatal(err)
		}
		if err := qs[k].Append(tokens + 1 + 2*k); err != nil {
			b.Fatal(err)
		}
	}
	tb := g.Groups[0].TokenBytes()
	token := make([]byte, tb)
	for i := range token {
		token[i] = byte(i % 7) // finite in both formats
	}
	// runs[layer][sequence][kind] are the contiguous runs of a tensor, redone from the
	// block a step appended to.
	runs := make([][][2][][]T, g.Layers)
	walk := func(q *kv.Sequence, layer int, kind kv.Kind, from int) [][]T {
		var out [][]T
		for t := from; t < q.Len(); {
			r, err := kv.Run[T](q, layer, kind, t)
			if err != nil {
				b.Fatal(err)
			}
			r = r[:min(len(r), (q.Len()-t)*g.Groups[0].KVHeads*g.Groups[0].HeadDim)]
			out = append(out, r)
			t += len(r) / (g.Groups[0].KVHeads * g.Groups[0].HeadDim)
		}
		return out
	}
	for l := range runs {
		runs[l] = make([][2][][]T, seqs)
		for k, q := range qs {
			for _, kind := range kv.KindsOf(g) {
				runs[l][k][kind] = walk(q, l, kind, 0)
			}
		}
	}
	total := 0
	for _, q := range qs {
		total += q.Len()
	}
	b.SetBytes(int64(2 * g.Layers * total * tb))
	for b.Loop() {
		decodeAppend(b, qs, g, tokens+room, token)
		for l := range runs {
			read := 0
			for k, q := range qs {
				bt := q.BlockTokens()
				from := (q.Len() - 1) / bt * bt
				r := &runs[l][k]
				for _, kind := range kv.KindsOf(g) {
					r[kind] = append(r[kind][:from/bt], walk(q, l, kind, from)...)
					for _, run := range r[kind] {
						read += load(run)
					}
				}
			}
			want := 0
			for _, q := range qs {
				want += 2 * q.Len() * tb
			}
			if read != want {
				b.Fatalf("a layer's read loaded %d bytes, want %d", read, want)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*seqs), "ns/token")
}
