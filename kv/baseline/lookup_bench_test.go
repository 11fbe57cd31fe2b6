package baseline

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/vmarena/vmarena/kv/internal/radix"
)

// BenchmarkPrefixLookup compares the two ways to index cached prefixes by token IDs:
// kv's radix tree (kv/internal/radix) and this package's vLLM-style chain of block
// hashes (16-token blocks). The index holds 64 cached prompts of 8,192 tokens; the
// query is an 8,192-token prompt that shares the first 90% with one of them.
func BenchmarkPrefixLookup(b *testing.B) {
	const prompt, others = 8192, 64
	for _, pct := range []int{90, 0} {
		match := prompt * pct / 100
		r := rand.New(rand.NewPCG(1, 2))
		cached := make([][]int32, others)
		for i := range cached {
			cached[i] = make([]int32, prompt)
			for j := range cached[i] {
				cached[i][j] = int32(r.IntN(128000))
			}
		}
		query := make([]int32, prompt)
		copy(query, cached[others/2][:match])
		for j := match; j < prompt; j++ {
			query[j] = -1 - int32(j) // never in the vocabulary: the match ends here
		}

		tree := radix.New[int]()
		for i, s := range cached {
			tree.Insert(s, i)
		}
		b.Run(fmt.Sprintf("index=radix/match=%d%%", pct), func(b *testing.B) {
			var m int
			for b.Loop() {
				m, _ = tree.Match(query)
			}
			if m != match {
				b.Fatalf("matched %d tokens, want %d", m, match)
			}
			b.ReportMetric(float64(prompt), "tokens/op")
		})

		bt := DefaultBlockTokens
		pc := newPagedCache(bt)
		pc.grow(others * prompt / bt)
		for i, s := range cached {
			var h uint64
			for k := range prompt / bt {
				id := int32(i*prompt/bt + k)
				blk := s[k*bt : (k+1)*bt]
				nh := chain(h, blk)
				pc.byHash[nh] = id
				pc.hash[id], pc.parent[id], pc.has[id] = nh, h, true
				copy(pc.blockTokens(id), blk)
				h = nh
			}
		}
		b.Run(fmt.Sprintf("index=block-hash-chain/match=%d%%", pct), func(b *testing.B) {
			var ids []int32
			for b.Loop() {
				ids = pc.match(query)
			}
			if want := match / bt * bt; len(ids)*bt != want {
				b.Fatalf("matched %d tokens, want %d", len(ids)*bt, want)
			}
			b.ReportMetric(float64(prompt), "tokens/op")
		})
	}
}
