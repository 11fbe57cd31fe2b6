package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// q8Tiny and fp8Tiny are tiny8's shape in Q8_0 (two 34-byte blocks a head) and E4M3.
var (
	q8Tiny  = kv.Uniform("tiny8-q8_0", 3, 4, 64, arena.Q8_0)
	fp8Tiny = kv.Uniform("tiny8-e4m3", 3, 4, 64, arena.Float8E4M3)
)

// TestUniformElementTypes: a token's bytes are counted by the element type, scales
// included, and a head that is not a whole number of blocks is refused.
func TestUniformElementTypes(t *testing.T) {
	q := kv.Uniform("q8", 32, 8, 128, arena.Q8_0)
	require.NoError(t, q.Validate(0))
	assert.Equal(t, 8*4*34, q.Groups[0].TokenBytes(), "8 heads of 4 blocks of 34 bytes")
	assert.Equal(t, 2*32*8*4*34, q.BytesPerToken())
	f := cloned(q)
	f.Groups[0].DType = arena.Float8E4M3
	require.NoError(t, f.Validate(0))
	assert.Equal(t, kv.Llama3_8B().Groups[0].TokenBytes()/2, f.Groups[0].TokenBytes(), "FP8 is half of fp16")
	f.Groups[0].DType = arena.Float8E5M2
	assert.Equal(t, 1024, f.Groups[0].TokenBytes())
	assert.Equal(t, 4*2*34, q8Tiny.Groups[0].TokenBytes())

	for _, hd := range []int{16, 48, 100, 1} {
		b := cloned(q)
		b.Groups[0].HeadDim = hd
		err := b.Validate(0)
		assert.ErrorIs(t, err, kv.ErrModel, "head dim %d", hd)
		assert.ErrorIs(t, err, arena.ErrPartialBlock, "head dim %d", hd)
		assert.Contains(t, err.Error(), "blocks of 32")
		assert.Zero(t, b.Groups[0].TokenBytes())
		_, err = kv.Config{Model: b, Layout: kv.Blocked, MaxTokens: 100}.Size(2<<20, 10)
		assert.ErrorIs(t, err, kv.ErrModel)
		// Nothing is reserved or committed for a model that is refused.
		e := openEnv(t, noCache, withLimit(1<<30))
		_, err = kv.New(e.fake, kv.Config{Model: b, MaxTokens: 64})
		assert.ErrorIs(t, err, kv.ErrModel)
	}
	// 4 heads of 8 values hold a whole block between them, but not per head.
	assert.ErrorIs(t, kv.Uniform("", 1, 4, 8, arena.Q8_0).Validate(0), arena.ErrPartialBlock)
	big := kv.Uniform("", 1<<20, 1<<10, 1<<10, arena.Q8_0)
	assert.ErrorIs(t, big.Validate(0), kv.ErrModel, "a token too large")

	// Size counts the scales: Q8_0 takes 34/64 of fp16's bytes.
	s16, err := kv.Config{Model: kv.Llama3_8B(), Layout: kv.PerLayer, MaxTokens: 2048}.Size(64<<10, 1000)
	require.NoError(t, err)
	sq, err := kv.Config{Model: q, Layout: kv.PerLayer, MaxTokens: 2048}.Size(64<<10, 1000)
	require.NoError(t, err)
	assert.Equal(t, s16.Used*34/64, sq.Used)
	assert.Equal(t, int64(1000*2*32*1088), sq.Used)
}

// TestViewBlockTypes: a Q8_0 view counts blocks in its last dimension; the Blocked
// layout, whose blocks of granules hold no whole number of 34-byte blocks, has none.
func TestViewBlockTypes(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	for _, tt := range []struct {
		layout  kv.Layout
		strides []int
	}{
		{kv.PerLayer, []int{4 * 2, 2, 1}},
	} {
		t.Run(tt.layout.String(), func(t *testing.T) {
			c := e.cache(t, kv.Config{Model: q8Tiny, MaxTokens: 256, Layout: tt.layout})
			s, err := c.NewSequence()
			require.NoError(t, err)
			defer s.Close()
			require.NoError(t, s.Append(5))
			v, err := kv.View[arena.BlockQ8_0](s, 2, kv.V)
			require.NoError(t, err)
			assert.Equal(t, []int{5, 4, 2}, v.Shape())
			assert.Equal(t, tt.strides, v.Strides())
			assert.Equal(t, 5*4*2*34, v.NumBytes())
			assert.Equal(t, s.Base(2, kv.V), v.DevicePtr())
			assert.Equal(t, 34*tt.strides[0], s.TokenStride())
			_, err = kv.View[arena.F16](s, 0, kv.K)
			assert.ErrorIs(t, err, kv.ErrElemType)
		})
	}
	// NB: blocks of one granule (BlockTokens 1: 2 tokens, 16 bytes dead); the default
	// block, 128 tokens in 51 granules, holds a whole number of 34-byte blocks.
	c, err := e.tryCache(kv.Config{Model: q8Tiny, MaxTokens: 256, BlockTokens: 1})
	require.NoError(t, err)
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(3))
	_, err = kv.View[arena.BlockQ8_0](s, 0, kv.K)
	assert.ErrorIs(t, err, kv.ErrLayout)
	// The kernel's addressing still holds: token t is at its block and row.
	assert.Equal(t, q8Tiny.Groups[0].TokenBytes(), s.TokenStride())
	require.True(t, s.Close().OK())
	require.NoError(t, c.Close())

	// FP8 elements are one byte: every layout has a view, strided in bytes.
	c, err = e.tryCache(kv.Config{Model: fp8Tiny, MaxTokens: 256, BlockTokens: 4})
	require.NoError(t, err)
	defer func() { assert.NoError(t, c.Close()) }()
	s, err = c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, s.Append(9))
	v, err := kv.View[arena.F8E4M3](s, 1, kv.K)
	require.NoError(t, err)
	assert.Equal(t, []int{(9 + s.BlockTokens() - 1) / s.BlockTokens(), s.BlockTokens(), 4, 64}, v.Shape())
	assert.Equal(t, []int{s.BlockStride(), fp8Tiny.Groups[0].TokenBytes(), 64, 1}, v.Strides())
}
