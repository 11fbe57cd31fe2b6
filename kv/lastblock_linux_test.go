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

// TestLastBlockReachesEveryGranule: in the Blocked layout a block holds each layer's
// K and V (or latent) as a run of BlockTokens tokens, one run after another, so the
// tokens of a partly filled last block lie in every granule of it: committing only
// "the granules its tokens reach" would commit the whole block. This is why the two
// cases left by the per-group blocks are not helped by a partial commit of the last
// block (docs/benchmarks/sizing.md): DeepSeek-V3 at 8,192 tokens on 2 MiB granules
// (137 of a block's 179 tokens, 1.5 granules past need plus one) and gpt-oss-20b at
// 2,050 tokens (2 of 256 tokens of its full group's three-granule block). If a layout
// ever puts the last block's tokens in a prefix of its granules, this fails, and a
// partial commit pays.
func TestLastBlockReachesEveryGranule(t *testing.T) {
	const granule = 2 << 20
	for _, tt := range []struct {
		preset string
		n      int
	}{
		{"deepseek-v3", 8 << 10},
		{"gpt-oss-20b", 2050},
	} {
		t.Run(fmt.Sprintf("%s/n=%d", tt.preset, tt.n), func(t *testing.T) {
			m, err := kv.Preset(tt.preset)
			require.NoError(t, err)
			c := newLastBlockCache(t, kv.Config{Model: m, MaxTokens: tt.n}, granule)
			s, err := c.NewSequence()
			require.NoError(t, err)
			defer s.Close()
			require.NoError(t, s.Append(tt.n))
			for gi, g := range m.Groups {
				if g.Kind == kv.Recurrent {
					continue
				}
				st, err := c.LayerStrides(g.Layers[0])
				require.NoError(t, err)
				last := (tt.n - 1) / st.BlockTokens // the last block
				r := tt.n - last*st.BlockTokens     // its tokens
				if r == st.BlockTokens {
					continue // full: nothing to save
				}
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
						lo := int(s.Base(layer, k) + uintptr(last*st.BlockStride) - start)
						hi := lo + (r-1)*st.TokenStride + st.TokenBytes // past the run's last token
						for i := lo / granule; i <= (hi-1)/granule; i++ {
							reached[i] = true
						}
					}
				}
				for i, ok := range reached {
					assert.True(t, ok, "group %d: granule %d of the last block (%d of %d tokens) holds a token", gi, i, r, st.BlockTokens)
				}
			}
		})
	}
}
