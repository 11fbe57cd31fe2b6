package kv_test

import (
	"math"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// TestQ8_0TokensThroughViews quantizes every head of every token into a Q8_0 cache
// through the typed views, in the layout that has them (PerLayer: Blocked's blocks of
// granules hold no whole number of 34-byte blocks), and reads each token back as bytes
// and dequantized, across a fork.
func TestQ8_0TokensThroughViews(t *testing.T) {
	g := q8Tiny
	for _, layout := range []kv.Layout{kv.PerLayer} {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, onShared, withGranule(64<<10), withName("kv-q8-test"), withConfig(kv.Config{Model: g, MaxTokens: 512, Layout: layout}))
			c := e.c
			s, err := c.NewSequence()
			require.NoError(t, err)
			const n = 120
			require.NoError(t, s.Append(n))

			value := func(layer int, kind kv.Kind, tok, h, d int) float32 {
				return float32(math.Sin(float64(layer*7919+int(kind)*613+tok*31+h*7+d))) * float32(1+tok%5)
			}
			head := make([]float32, g.Groups[0].HeadDim)
			blocks := make([]arena.BlockQ8_0, g.Groups[0].HeadDim/arena.Q8_0BlockValues)
			for layer := range g.Layers {
				for _, kind := range kv.KindsOf(g) {
					v, err := kv.View[arena.BlockQ8_0](s, layer, kind)
					require.NoError(t, err)
					for tok := range n {
						for h := range g.Groups[0].KVHeads {
							for d := range head {
								head[d] = value(layer, kind, tok, h, d)
							}
							_, err := arena.QuantizeQ8_0(blocks, head)
							require.NoError(t, err)
							for j, blk := range blocks {
								v.Set(blk, tok, h, j)
							}
						}
					}
				}
			}
			f, err := s.ForkAt(n - 7)
			require.NoError(t, err)
			defer f.Close()

			tok := make([]byte, g.Groups[0].TokenBytes())
			got := make([]float32, g.Groups[0].HeadDim)
			for _, q := range []*kv.Sequence{s, f} {
				for layer := range g.Layers {
					for _, kind := range kv.KindsOf(g) {
						for tk := range q.Len() {
							require.NoError(t, q.ReadToken(layer, kind, tk, tok))
							// The token's bytes are KVHeads heads of HeadDim/32 blocks.
							bs := unsafe.Slice((*arena.BlockQ8_0)(unsafe.Pointer(&tok[0])), len(tok)/34)
							for h := range g.Groups[0].KVHeads {
								for d := range head {
									head[d] = value(layer, kind, tk, h, d)
								}
								_, err := arena.QuantizeQ8_0(blocks, head)
								require.NoError(t, err)
								hb := bs[h*len(blocks) : (h+1)*len(blocks)]
								require.Equal(t, blocks, hb, "seq %d layer %d %v token %d head %d", q.ID(), layer, kind, tk, h)
								_, err = arena.DequantizeQ8_0(got, hb)
								require.NoError(t, err)
								for d := range head {
									require.InDelta(t, head[d], got[d], float64(1+tk%5)/127, "within a step of the block")
								}
							}
						}
					}
				}
			}
			assert.True(t, s.Close().OK())
		})
	}
}

// TestFP8TokensThroughViews writes E4M3 values through the default layout's view and
// reads them back as the token's bytes.
func TestFP8TokensThroughViews(t *testing.T) {
	g := fp8Tiny
	e := openEnv(t, onShared, withGranule(64<<10), withName("kv-fp8-test"), withConfig(kv.Config{Model: g, MaxTokens: 512}))
	c := e.c
	s, err := c.NewSequence()
	require.NoError(t, err)
	const n = 100
	require.NoError(t, s.Append(n))
	st := stridesOf(s, 0)
	val := func(layer, tok, h, d int) arena.F8E4M3 {
		return arena.F8E4M3FromFloat32Sat(float32(layer*1000+tok*10+h) / float32(1+d))
	}
	for layer := range g.Layers {
		v, err := kv.View[arena.F8E4M3](s, layer, kv.V)
		require.NoError(t, err)
		for tok := range n {
			for h := range g.Groups[0].KVHeads {
				for d := range g.Groups[0].HeadDim {
					v.Set(val(layer, tok, h, d), append(blockIndex(st, tok, 0), h, d)...)
				}
			}
		}
	}
	tb := make([]byte, g.Groups[0].TokenBytes())
	for layer := range g.Layers {
		for tok := range n {
			require.NoError(t, s.ReadToken(layer, kv.V, tok, tb))
			for h := range g.Groups[0].KVHeads {
				for d := range g.Groups[0].HeadDim {
					require.Equal(t, uint8(val(layer, tok, h, d)), tb[h*g.Groups[0].HeadDim+d], "layer %d token %d [%d,%d]", layer, tok, h, d)
				}
			}
		}
	}
	assert.True(t, s.Close().OK())
}

// TestScalesOnHost: on host memory the scales tensor's elements are the scales, and
// the ledger holds their granule until Close.
func TestScalesOnHost(t *testing.T) {
	g := withScales(fp8Tiny, kv.ScalePerHead)
	e := openEnv(t, onShared, withGranule(64<<10), withName("kv-scales-test"), withConfig(kv.Config{Model: g, MaxTokens: 64}))
	c, pool := e.c, e.auth
	v, err := c.Scales()
	require.NoError(t, err)
	require.True(t, v.HostAccessible())
	assert.Equal(t, float32(1), v.At(2, 1, 3))
	require.NoError(t, c.SetScales(2, kv.V, []float32{0.25, 0.5, 1, 2}))
	assert.Equal(t, float32(2), v.At(2, 1, 3))
	assert.Equal(t, float32(0.25), v.At(2, 1, 0))
	assert.Equal(t, float32(1), v.At(2, 0, 3), "K is untouched")
	flat, err := v.Slice()
	require.NoError(t, err)
	assert.Equal(t, float32(0.5), flat[(2*2+1)*4+1], "row-major [layer][K, V][head]")
	assert.Equal(t, int64(64<<10), pool.Stats().Owned) // the cleanup closes c and checks the ledger
}
