//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

type hostSeq = kv.Sequence

// fillViews writes a distinct F16 bit pattern to every (writer, layer, K/V, token,
// head, dim) of tokens [from, to) through the typed views.
func fillViews(t *testing.T, s *hostSeq, w uint64, from, to int) {
	t.Helper()
	eachElem(t, s, from, to, func(v arena.Tensor[arena.F16], layer int, kind kv.Kind, tok, h, d int) {
		v.Set(viewValue(w, layer, kind, tok, h, d), viewIndex(s, tok, h, d)...)
	})
}

func viewValue(w uint64, layer int, kind kv.Kind, tok, h, d int) arena.F16 {
	return arena.F16(w*7919 + uint64(layer)*613 + uint64(kind)*307 + uint64(tok)*257 + uint64(h)*64 + uint64(d))
}

// checkViews checks, through the typed views, that tokens [from, to) hold fillViews's
// pattern of writer w, and the views' shape.
func checkViews(t *testing.T, s *hostSeq, w uint64, from, to int) {
	t.Helper()
	eachElem(t, s, from, to, func(v arena.Tensor[arena.F16], layer int, kind kv.Kind, tok, h, d int) {
		if got, want := v.At(viewIndex(s, tok, h, d)...), viewValue(w, layer, kind, tok, h, d); got != want {
			t.Fatalf("seq %d layer %d %v [%d,%d,%d]: got %#x, want %#x", s.ID(), layer, kind, tok, h, d, got, want)
		}
	})
}

// eachElem calls f on every element (head h, dim d) of tokens [from, to) of every
// tensor of s, through the tensor's F16 view, whose shape it checks first.
func eachElem(t *testing.T, s *hostSeq, from, to int, f func(v arena.Tensor[arena.F16], layer int, kind kv.Kind, tok, h, d int)) {
	t.Helper()
	for layer := range tiny8.Layers {
		for _, kind := range kv.KindsOf(tiny8) {
			v, err := kv.View[arena.F16](s, layer, kind)
			require.NoError(t, err)
			require.Equal(t, viewShape(s), v.Shape())
			for tok := from; tok < to; tok++ {
				for h := range tiny8.Groups[0].KVHeads {
					for d := range tiny8.Groups[0].HeadDim {
						f(v, layer, kind, tok, h, d)
					}
				}
			}
		}
	}
}

// TestTypedViewsIntegrity writes and reads every element through typed F16 views after
// growth, prefix sharing, fork and truncation, in both layouts.
func TestTypedViewsIntegrity(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, onShared, withGranule(64<<10), withName("kv-view-test"), withConfig(kv.Config{MaxTokens: 512, Layout: layout}))
			c := e.c
			shareForkTruncate(t, c, fillViews, checkViews)
			s, err := c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(1))
			_, err = kv.View[float32](s, 0, kv.K)
			assert.ErrorIs(t, err, kv.ErrElemType)
			_, err = kv.View[arena.F16](s, tiny8.Layers, kv.K)
			assert.ErrorIs(t, err, kv.ErrRange)
			assert.True(t, s.Close().OK())
		})
	}
}
