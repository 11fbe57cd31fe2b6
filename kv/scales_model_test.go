package kv_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// fp8Hybrid is a model whose groups keep scales in every way a group can: per KV
// head (a window group whose layers are listed out of order), none (an fp16 group, a
// recurrent one), per tensor (an MLA latent, which has no V, and a chunked group).
var fp8Hybrid = kv.Model{Name: "fp8-hybrid", Layers: 6, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 5, Layers: []int{3, 0}, KVHeads: 2, HeadDim: 16, DType: arena.Float8E4M3, Scales: kv.ScalePerHead},
	{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.MLALatent, Layers: []int{4}, KVHeads: 1, HeadDim: 24, DType: arena.Float8E5M2, Scales: kv.ScalePerTensor},
	{Kind: kv.Recurrent, Layers: []int{5}, StateBytes: 100},
	{Kind: kv.ChunkedLocal, Window: 9, Layers: []int{2}, KVHeads: 4, HeadDim: 16, DType: arena.Float8E4M3, Scales: kv.ScalePerTensor},
}}

// TestScalesOnModel: each FP8 group of a Model keeps scales of its own (per KV head
// or per tensor) in the cache's one scales range, group after group, as a tensor of
// [its layers in its order, its tensors, H] at a stable address a kernel reads;
// SetScales and ReadScales take the model's layer index and refuse, changing
// nothing, a layer of a group without scales, a tensor the layer does not have, and
// a wrong count or value. On the host the tensor's elements are the scales set.
func TestScalesOnModel(t *testing.T) {
	type ref struct {
		group, local int
		per          int
	}
	// Where each layer's scales are: its group, its index there, and H.
	where := map[int]ref{3: {0, 0, 2}, 0: {0, 1, 2}, 4: {2, 0, 1}, 2: {4, 0, 1}}
	want := func(layer int, kind kv.Kind, h int) float32 {
		return float32(layer*10+int(kind)) + float32(h)/8 + 0.5
	}
	for _, kind := range []backingKind{onFake, onShared} {
		t.Run(backingNames[kind], func(t *testing.T) {
			e := openEnv(t, kind, withConfig(kv.Config{Model: fp8Hybrid, MaxTokens: 64}))
			c := e.c
			e.books(t, "scales committed")
			assert.Equal(t, int64(c.Granularity()), e.auth.Stats().Owned, "one granule holds every group's scales")

			_, err := c.Scales()
			assert.ErrorIs(t, err, kv.ErrScale, "a model of many groups has scales per group")
			shapes := map[int][]int{0: {2, 2, 2}, 2: {1, 1, 1}, 4: {1, 2, 1}}
			var ptrs [5]uintptr
			for gi := range fp8Hybrid.Groups {
				v, err := c.GroupScales(gi)
				if shapes[gi] == nil {
					assert.ErrorIs(t, err, kv.ErrScale, "group %d keeps none", gi)
					continue
				}
				require.NoError(t, err, "group %d", gi)
				assert.Equal(t, shapes[gi], v.Shape(), "group %d", gi)
				assert.True(t, v.IsContiguous())
				assert.Equal(t, kind == onShared, v.HostAccessible())
				ptrs[gi] = v.DevicePtr()
			}
			// Group after group, no gap: group 0 has 2×2×2 scales, group 2 one.
			assert.Equal(t, uintptr(8*4), ptrs[2]-ptrs[0])
			assert.Equal(t, uintptr(1*4), ptrs[4]-ptrs[2])
			for _, gi := range []int{-1, len(fp8Hybrid.Groups)} {
				_, err := c.GroupScales(gi)
				assert.ErrorIs(t, err, kv.ErrRange, "group %d", gi)
			}

			got := make([]float32, 2)
			for layer, r := range where {
				for _, kind := range kindsOfGroup(fp8Hybrid.Groups[r.group]) {
					require.NoError(t, c.ReadScales(layer, kind, got[:r.per]))
					for _, s := range got[:r.per] {
						assert.Equal(t, float32(1), s, "a new scale is 1")
					}
				}
			}
			src := make([]float32, 2)
			for layer, r := range where {
				for _, kind := range kindsOfGroup(fp8Hybrid.Groups[r.group]) {
					for h := range r.per {
						src[h] = want(layer, kind, h)
					}
					require.NoError(t, c.SetScales(layer, kind, src[:r.per]))
				}
			}
			for layer, r := range where {
				for ki, kind := range kindsOfGroup(fp8Hybrid.Groups[r.group]) {
					require.NoError(t, c.ReadScales(layer, kind, got[:r.per]))
					v, err := c.GroupScales(r.group)
					require.NoError(t, err)
					assert.Equal(t, ptrs[r.group], v.DevicePtr(), "the address never changes")
					for h := range r.per {
						assert.Equal(t, want(layer, kind, h), got[h], "layer %d %v head %d", layer, kind, h)
						if v.HostAccessible() {
							assert.Equal(t, want(layer, kind, h), v.At(r.local, ki, h), "the kernel's element of layer %d %v head %d", layer, kind, h)
						}
					}
				}
			}

			// Bad inputs change nothing.
			for _, bad := range []struct {
				layer int
				kind  kv.Kind
				src   []float32
				err   error
			}{
				{1, kv.K, []float32{2, 2}, kv.ErrScale}, // an fp16 group
				{5, kv.K, []float32{2}, kv.ErrRange},    // a recurrent layer
				{4, kv.V, []float32{2}, kv.ErrRange},    // an MLA layer has no V
				{6, kv.K, []float32{2}, kv.ErrRange},    // no such layer
				{-1, kv.K, []float32{2}, kv.ErrRange},   // nor this
				{0, kv.K, []float32{2}, kv.ErrScale},    // per head: 2 scales
				{2, kv.V, []float32{2, 2}, kv.ErrScale}, // per tensor: 1
				{0, kv.V, []float32{2, 0}, kv.ErrScale}, // not positive
				{3, kv.K, []float32{float32(math.NaN()), 1}, kv.ErrScale},
				{4, kv.K, []float32{float32(math.Inf(1))}, kv.ErrScale},
			} {
				assert.ErrorIs(t, c.SetScales(bad.layer, bad.kind, bad.src), bad.err, "%+v", bad)
			}
			for layer, r := range where {
				for _, kind := range kindsOfGroup(fp8Hybrid.Groups[r.group]) {
					require.NoError(t, c.ReadScales(layer, kind, got[:r.per]))
					for h := range r.per {
						assert.Equal(t, want(layer, kind, h), got[h], "unchanged: layer %d %v head %d", layer, kind, h)
					}
				}
			}
			assert.ErrorIs(t, c.ReadScales(1, kv.K, got), kv.ErrScale)
			assert.ErrorIs(t, c.ReadScales(4, kv.V, got[:1]), kv.ErrRange)

			e.finish(t)
			_, err = c.GroupScales(0)
			assert.ErrorIs(t, err, kv.ErrClosed)
			assert.ErrorIs(t, c.SetScales(0, kv.K, src), kv.ErrClosed)
		})
	}
}

// TestScalesOnOneGroupModel: a Model of one FP8 group keeps its scales, and Scales
// gives them.
func TestScalesOnOneGroupModel(t *testing.T) {
	g := withScales(fp8Tiny, kv.ScalePerHead)
	e := openEnv(t, onFake, withConfig(kv.Config{Model: g, MaxTokens: 64}))
	v, err := e.c.Scales()
	require.NoError(t, err)
	assert.Equal(t, []int{g.Layers, 2, g.Groups[0].KVHeads}, v.Shape())
	w, err := e.c.GroupScales(0)
	require.NoError(t, err)
	assert.Equal(t, v.DevicePtr(), w.DevicePtr())
	src := fill(g.Groups[0].KVHeads, 3)
	require.NoError(t, e.c.SetScales(g.Layers-1, kv.V, src))
	got := make([]float32, g.Groups[0].KVHeads)
	require.NoError(t, e.c.ReadScales(g.Layers-1, kv.V, got))
	assert.Equal(t, src, got)
}

// kindsOfGroup returns the tensors each of g's layers has: K and V, or the latent
// alone (K) for an MLA group.
func kindsOfGroup(g kv.Group) []kv.Kind {
	if g.Kind == kv.MLALatent {
		return []kv.Kind{kv.K}
	}
	return []kv.Kind{kv.K, kv.V}
}
