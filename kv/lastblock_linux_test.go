package kv_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// newLastBlockCache returns a cache of cfg on host.Private granules of granule bytes
// (address space committed, never touched), closed when the test ends.
func newLastBlockCache(t *testing.T, cfg kv.Config, granule int) *kv.Cache {
	t.Helper()
	return openEnv(t, onPrivate, withGranule(granule),
		withPrivate(host.PrivateOptions{NoHugePages: true}), withConfig(cfg)).c
}

// TestLastBlockGranulesReached: which granules of a partly filled last block hold
// its tokens, by the Strides doc's formula. Where a block is one run (a layer's K and
// V, or latent, as a run of BlockTokens tokens, one run after another), its tokens lie
// in every granule of it, so committing only "the granules its tokens reach" would
// commit the whole block: DeepSeek-V3 at 8,192 tokens on 2 MiB granules (137 of a
// block's 179 tokens, which no run of 16 divides; 1.5 granules past need plus one,
// docs/benchmarks/sizing.md), and gpt-oss-20b at 2,050 tokens (2 of its full group's
// 256-token, three-granule block). Where a block is cut into runs
// (Config.RunTokens), they lie in the runs they reach: gpt-oss-20b's 2 tokens in runs
// of 16 reach its first granule only, where a partial commit of the last block would
// pay (not made: a block is committed whole).
func TestLastBlockGranulesReached(t *testing.T) {
	const granule = 2 << 20
	for _, tt := range []struct {
		preset  string
		n, runs int
		reached []int // per group that has tokens, the granules of its last block reached
	}{
		{"deepseek-v3", 8 << 10, 0, []int{6}},
		{"deepseek-v3", 8 << 10, 16, []int{6}}, // 179 tokens a block: runs of 16 do not cut it
		{"gpt-oss-20b", 2050, 0, []int{1, 3}},
		{"gpt-oss-20b", 2050, 16, []int{1, 1}},
	} {
		t.Run(fmt.Sprintf("%s/n=%d/RunTokens=%d", tt.preset, tt.n, tt.runs), func(t *testing.T) {
			m, err := kv.Preset(tt.preset)
			require.NoError(t, err)
			c := newLastBlockCache(t, kv.Config{Model: m, MaxTokens: tt.n, RunTokens: tt.runs}, granule)
			s, err := c.NewSequence()
			require.NoError(t, err)
			defer s.Close()
			require.NoError(t, s.Append(tt.n))
			var got []int
			for _, g := range m.Groups {
				if g.Kind == kv.Recurrent {
					continue
				}
				st, err := c.LayerStrides(g.Layers[0])
				require.NoError(t, err)
				last := (tt.n - 1) / st.BlockTokens // the last block
				// The block's first byte: the group's range starts with its first
				// layer's K.
				start := s.Base(g.Layers[0], kv.K) + uintptr(last*st.BlockStride)
				reached := make([]bool, st.BlockStride/granule)
				for _, layer := range g.Layers {
					kinds := []kv.Kind{kv.K, kv.V}
					if g.Kind == kv.MLALatent {
						kinds = kinds[:1]
					}
					for _, k := range kinds {
						for tok := last * st.BlockTokens; tok < tt.n; tok++ {
							lo := int(s.Base(layer, k)+uintptr(tokenOffset(st, tok))-start) / granule
							hi := int(s.Base(layer, k)+uintptr(tokenOffset(st, tok)+st.TokenBytes-1)-start) / granule
							for i := lo; i <= hi; i++ {
								reached[i] = true
							}
						}
					}
				}
				k := 0
				for k < len(reached) && reached[k] {
					k++
				}
				for i := k; i < len(reached); i++ {
					require.False(t, reached[i], "granule %d reached past granule %d, which is not", i, k)
				}
				got = append(got, k)
			}
			assert.Equal(t, tt.reached, got, "granules of each group's last block that its tokens reach")
		})
	}
}
