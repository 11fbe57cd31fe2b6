package kv_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// TestConfigBadInputsEveryEntry: a Config whose field is out of its domain is refused
// with kv's sentinel, naming the field's value, by every public call that takes a
// Config (New, Config.Size, TierNamespace), and none of them panics or allocates by
// it. The first rows are the inputs that once panicked (makeslice in Uniform
// and Model.Validate, before anything validated the layers).
func TestConfigBadInputsEveryEntry(t *testing.T) {
	fp16 := func(layers, heads, dim int) kv.Model {
		return kv.Uniform("g", layers, heads, dim, arena.Float16)
	}
	full := func(layers ...int) kv.Group {
		return kv.Group{Kind: kv.FullAttention, Layers: layers, KVHeads: 1, HeadDim: 16, DType: arena.Float16}
	}
	tests := []struct {
		name  string
		cfg   kv.Config
		want  error
		words string
		// namespace is whether TierNamespace, which takes no MaxTokens, accepts it.
		namespace bool
	}{
		{"Uniform.Layers MaxInt", kv.Config{Model: fp16(math.MaxInt, 1, 16), MaxTokens: 8}, kv.ErrModel, "more than MaxLayers", false},
		{"Uniform.Layers MaxLayers+1", kv.Config{Model: fp16(kv.MaxLayers+1, 1, 16), MaxTokens: 8}, kv.ErrModel, "more than MaxLayers", false},
		{"Uniform.Layers MinInt", kv.Config{Model: fp16(math.MinInt, 1, 16), MaxTokens: 8}, kv.ErrModel, "must be positive", false},
		{"Uniform.KVHeads MaxInt", kv.Config{Model: fp16(2, math.MaxInt, 16), MaxTokens: 8}, kv.ErrModel, "too large", false},
		{"Uniform.HeadDim MaxInt", kv.Config{Model: fp16(2, 1, math.MaxInt), MaxTokens: 8}, kv.ErrModel, "head dim", false},
		{"Uniform.DType unknown", kv.Config{Model: kv.Uniform("", 2, 1, 16, 200), MaxTokens: 8}, kv.ErrModel, "element type", false},
		{"Uniform.Scales unknown", kv.Config{Model: withScales(kv.Uniform("", 2, 1, 16, arena.Float8E4M3), 9), MaxTokens: 8}, kv.ErrModel, "scale mode", false},
		{"Model.Layers MaxInt", kv.Config{Model: kv.Model{Name: "m", Layers: math.MaxInt, Groups: []kv.Group{full(0)}}, MaxTokens: 8}, kv.ErrModel, "more than MaxLayers", false},
		{"Model.Layers MaxLayers+1", kv.Config{Model: kv.Model{Name: "m", Layers: kv.MaxLayers + 1, Groups: []kv.Group{full(0)}}, MaxTokens: 8}, kv.ErrModel, "more than MaxLayers", false},
		{"Group.Layers MaxInt", kv.Config{Model: kv.Model{Name: "m", Layers: 1, Groups: []kv.Group{full(math.MaxInt)}}, MaxTokens: 8}, kv.ErrModel, "lists layer", false},
		{"Group.Window MaxInt", kv.Config{Model: kv.Model{Name: "m", Layers: 1, Groups: []kv.Group{
			{Kind: kv.SlidingWindow, Window: math.MaxInt, Layers: []int{0}, KVHeads: 1, HeadDim: 16, DType: arena.Float16}}}, MaxTokens: 8}, kv.ErrModel, "larger than MaxTokens", false},
		{"Group.StateBytes MaxInt", kv.Config{Model: kv.Model{Name: "m", Layers: 1, Groups: []kv.Group{
			{Kind: kv.Recurrent, Layers: []int{0}, StateBytes: math.MaxInt}}}, MaxTokens: 8}, kv.ErrModel, "too large", false},
		{"Group.KVHeads MaxInt", kv.Config{Model: kv.Model{Name: "m", Layers: 1, Groups: []kv.Group{
			{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: math.MaxInt, HeadDim: 16, DType: arena.Float16}}}, MaxTokens: 8}, kv.ErrModel, "too large", false},
		{"MaxTokens MaxInt", kv.Config{Model: fp16(2, 1, 16), MaxTokens: math.MaxInt}, kv.ErrConfig, "overflow", true},
		{"MaxTokens MaxInt PerLayer", kv.Config{Model: fp16(2, 1, 16), MaxTokens: math.MaxInt, Layout: kv.PerLayer}, kv.ErrConfig, "overflow", true},
		{"BlockTokens MaxInt", kv.Config{Model: fp16(2, 1, 16), MaxTokens: 8, BlockTokens: math.MaxInt}, kv.ErrConfig, "overflow", false},
		{"BlockTokens negative", kv.Config{Model: fp16(2, 1, 16), MaxTokens: 8, BlockTokens: math.MinInt}, kv.ErrConfig, "BlockTokens", false},
		{"Layout unknown", kv.Config{Model: fp16(2, 1, 16), MaxTokens: 8, Layout: 77}, kv.ErrConfig, "layout", false},
		{"RunTokens negative", kv.Config{Model: fp16(2, 1, 16), MaxTokens: 8, RunTokens: -16}, kv.ErrConfig, "RunTokens -16", false},
		{"RunTokens no power of two", kv.Config{Model: fp16(2, 1, 16), MaxTokens: 8, RunTokens: 12}, kv.ErrConfig, "RunTokens 12", false},
		{"RunTokens PerLayer", kv.Config{Model: fp16(2, 1, 16), MaxTokens: 8, Layout: kv.PerLayer, RunTokens: 16}, kv.ErrConfig, "RunTokens 16", false},
		// Each group's ranges fit an int64; the two groups' together do not.
		{"MaxTokens over two groups", kv.Config{Model: kv.Model{Name: "m", Layers: 2, Groups: []kv.Group{
			{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 1, HeadDim: 1024, DType: arena.Float16},
			{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 1, HeadDim: 1024, DType: arena.Float16}}},
			MaxTokens: 1 << 50}, kv.ErrConfig, "overflow a sequence's address space", true},
	}
	e := openEnv(t, noCache, withLimit(1<<30))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := kv.New(e.fake, tt.cfg)
			require.ErrorIs(t, err, tt.want, "New")
			assert.ErrorContains(t, err, tt.words, "New")
			_, err = tt.cfg.Size(fakeGranule, 1)
			require.ErrorIs(t, err, tt.want, "Size")
			assert.ErrorContains(t, err, tt.words, "Size")
			_, err = kv.TierNamespace(tt.cfg, fakeGranule, "p")
			if tt.namespace {
				assert.NoError(t, err, "TierNamespace")
			} else {
				require.ErrorIs(t, err, tt.want, "TierNamespace")
				assert.ErrorContains(t, err, tt.words, "TierNamespace")
			}
			assert.Zero(t, e.fake.LiveReservations(), "a refused config reserves nothing")
		})
	}
}

// TestUniformOutOfRange: Uniform of too many or too few layers answers a model that
// Validate refuses, without making a slice of its layers.
func TestUniformOutOfRange(t *testing.T) {
	for _, layers := range []int{math.MaxInt, kv.MaxLayers + 1, 0, -1, math.MinInt} {
		m := kv.Uniform("", layers, 1, 16, arena.Float16)
		require.Len(t, m.Groups, 1)
		assert.Empty(t, m.Groups[0].Layers, "layers %d", layers)
		assert.ErrorIs(t, m.Validate(0), kv.ErrModel, "layers %d", layers)
	}
	m := kv.Uniform("", kv.MaxLayers, 1, 16, arena.Float16)
	assert.Len(t, m.Groups[0].Layers, kv.MaxLayers)
	assert.NoError(t, m.Validate(0), "MaxLayers itself is a model")
}

// TestPrefixCacheEventsBlockPastMaxTokens: events in blocks longer than the cache's
// MaxTokens are refused with ErrConfig (no sequence could hold one whole), as is a
// size whose key would not fit in memory; a block of MaxTokens is accepted.
func TestPrefixCacheEventsBlockPastMaxTokens(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 32, Layout: kv.Blocked, BlockTokens: testBlockTokens}))
	c := e.c
	for _, bs := range []int{33, 1 << 40, 1 << 62, math.MaxInt} {
		_, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: nopEvents{}, Hash: blockhash.Options{BlockSize: bs}}})
		require.ErrorIs(t, err, kv.ErrConfig, "block size %d", bs)
		assert.ErrorContains(t, err, "longer than MaxTokens 32")
	}
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: nopEvents{}, Hash: blockhash.Options{BlockSize: 32}}})
	require.NoError(t, err)
	require.NoError(t, pc.Close())
}
