package kv_test

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// TestScalesOnDevice: a cache on memory the CPU must not touch (the fake backing)
// keeps its scales in a range of that backing, at a stable address a kernel reads,
// starting at 1, written and read through the backing's copier; the ledger holds it
// until Close.
func TestScalesOnDevice(t *testing.T) {
	for _, tt := range []struct {
		mode kv.ScaleMode
		per  int
	}{
		{kv.ScalePerTensor, 1},
		{kv.ScalePerHead, fp8Tiny.Groups[0].KVHeads},
	} {
		t.Run(tt.mode.String(), func(t *testing.T) {
			e := openEnv(t, noCache, withLimit(1<<30))
			g := withScales(fp8Tiny, tt.mode)
			c, err := e.tryCache(kv.Config{Model: g, MaxTokens: 64})
			require.NoError(t, err)
			assert.Equal(t, int64(fakeGranule), e.auth.Stats().Owned, "one granule holds the scales")
			v, err := c.Scales()
			require.NoError(t, err)
			assert.Equal(t, []int{g.Layers, 2, tt.per}, v.Shape())
			assert.True(t, v.IsContiguous())
			assert.False(t, v.HostAccessible())
			assert.NotZero(t, v.DevicePtr())

			got := make([]float32, tt.per)
			for layer := range g.Layers {
				for _, kind := range kv.KindsOf(g) {
					require.NoError(t, c.ReadScales(layer, kind, got))
					for _, s := range got {
						assert.Equal(t, float32(1), s, "a new scale is 1")
					}
				}
			}
			want := func(layer int, kind kv.Kind, h int) float32 {
				return float32(layer*10+int(kind)) + float32(h)/8 + 0.5
			}
			src := make([]float32, tt.per)
			for layer := range g.Layers {
				for _, kind := range kv.KindsOf(g) {
					for h := range src {
						src[h] = want(layer, kind, h)
					}
					require.NoError(t, c.SetScales(layer, kind, src))
				}
			}
			for layer := range g.Layers {
				for _, kind := range kv.KindsOf(g) {
					require.NoError(t, c.ReadScales(layer, kind, got))
					for h, s := range got {
						assert.Equal(t, want(layer, kind, h), s, "layer %d %v head %d", layer, kind, h)
					}
				}
			}
			v2, err := c.Scales()
			require.NoError(t, err)
			assert.Equal(t, v.DevicePtr(), v2.DevicePtr(), "the address never changes")

			// Bad inputs change nothing.
			for _, bad := range []struct {
				layer int
				kind  kv.Kind
				src   []float32
				err   error
			}{
				{0, kv.K, make([]float32, tt.per+1), kv.ErrScale},
				{0, kv.K, nil, kv.ErrScale},
				{-1, kv.K, src, kv.ErrRange},
				{g.Layers, kv.V, src, kv.ErrRange},
				{0, kv.V + 1, src, kv.ErrRange},
				{0, kv.K, fill(tt.per, 0), kv.ErrScale},
				{0, kv.K, fill(tt.per, -1), kv.ErrScale},
				{0, kv.K, fill(tt.per, float32(math.Inf(1))), kv.ErrScale},
				{0, kv.K, fill(tt.per, float32(math.NaN())), kv.ErrScale},
			} {
				assert.ErrorIs(t, c.SetScales(bad.layer, bad.kind, bad.src), bad.err, "%+v", bad)
				if bad.err == kv.ErrRange || len(bad.src) != tt.per {
					assert.ErrorIs(t, c.ReadScales(bad.layer, bad.kind, bad.src), bad.err, "%+v", bad)
				}
			}
			require.NoError(t, c.ReadScales(0, kv.K, got))
			assert.Equal(t, want(0, kv.K, 0), got[0], "unchanged")

			require.NoError(t, c.Close())
			assert.Zero(t, e.auth.Stats().Owned, "Close gives the scales back")
			_, err = c.Scales()
			assert.ErrorIs(t, err, kv.ErrClosed)
			assert.ErrorIs(t, c.SetScales(0, kv.K, src), kv.ErrClosed)
			assert.ErrorIs(t, c.ReadScales(0, kv.K, got), kv.ErrClosed)
		})
	}
}

func fill(n int, v float32) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = v
	}
	return s
}

func TestScalesRefused(t *testing.T) {
	// Scales are for FP8 element types only, and the mode must be one of the three.
	for _, g := range []kv.Model{
		withScales(kv.Uniform("", 1, 1, 32, arena.Float16), kv.ScalePerTensor),
		withScales(kv.Uniform("", 1, 1, 32, arena.Q8_0), kv.ScalePerHead),
		withScales(kv.Uniform("", 1, 1, 32, arena.Float8E4M3), kv.ScalePerHead+1),
	} {
		err := g.Validate(0)
		assert.ErrorIs(t, err, kv.ErrModel, "%+v", g)
		e := openEnv(t, noCache, withLimit(1<<30))
		_, err = kv.New(e.fake, kv.Config{Model: g, MaxTokens: 8})
		assert.ErrorIs(t, err, kv.ErrModel)
	}
	g := withScales(fp8Tiny, kv.ScalePerTensor)
	require.NoError(t, g.Validate(0))
	g.Groups[0].DType = arena.Float8E5M2
	require.NoError(t, g.Validate(0))
	assert.Equal(t, "ScaleMode(3)", kv.ScaleMode(3).String())
	assert.Equal(t, "none", kv.NoScales.String())

	// A cache without scales has none to give.
	e := openEnv(t, noCache, withLimit(1<<30))
	c, err := e.tryCache(kv.Config{Model: fp8Tiny, MaxTokens: 8})
	require.NoError(t, err)
	assert.Zero(t, e.auth.Stats().Owned, "no scales, no memory")
	_, err = c.Scales()
	assert.ErrorIs(t, err, kv.ErrScale)
	assert.ErrorIs(t, c.SetScales(0, kv.K, []float32{1}), kv.ErrScale)
	assert.ErrorIs(t, c.ReadScales(0, kv.K, []float32{1}), kv.ErrScale)
	require.NoError(t, c.Close())

	// A backing that fails to write the first scales: New fails and holds nothing.
	e = openEnv(t, noCache, withLimit(1<<30), withFaults)
	boom := errors.New("boom")
	e.faults.FailOp(backingtest.OpCopyIn, 1, boom)
	_, err = e.tryCache(kv.Config{Model: g, MaxTokens: 8})
	assert.ErrorIs(t, err, boom)
	assert.Zero(t, e.auth.Stats().Owned)
	assert.Zero(t, e.fake.LiveReservations())
	// And one that can not commit them.
	e = openEnv(t, noCache, withLimit(1<<12-1))
	_, err = e.tryCache(kv.Config{Model: g, MaxTokens: 8})
	assert.Error(t, err)
	assert.Zero(t, e.fake.LiveReservations())
}
