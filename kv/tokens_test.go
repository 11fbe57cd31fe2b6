package kv_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// seqOn returns a sequence of n tokens on a cache on backing kind in layout, closed
// and checked at cleanup; it skips the test where the backing does not exist.
func seqOn(t *testing.T, kind backingKind, layout kv.Layout, n int) *kv.Sequence {
	t.Helper()
	e := openEnv(t, kind, pooled, withConfig(kv.Config{MaxTokens: 64, Layout: layout, BlockTokens: blockTokensFor(layout)}))
	t.Cleanup(func() { e.finish(t) })
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	require.NoError(t, s.Append(n))
	return s
}

// tokenBytes returns writer w's pattern for tokens [from, to) of one tensor, packed.
func tokenBytes(w uint64, layer int, kind kv.Kind, from, to, tb int) []byte {
	out := make([]byte, (to-from)*tb)
	for tok := from; tok < to; tok++ {
		for i := range tb {
			out[(tok-from)*tb+i] = testutil.TokenByte(w, layer, kind, tok, i)
		}
	}
	return out
}

// TestReadWriteTokens: a bulk write of a range that crosses blocks and granules reads
// back the same in every chunking, on every sharing backing (host.Shared by copy, the
// CUDA fake and backingtest.Fake through their copies) and layout; on the host the
// bytes are where a View says they are.
func TestReadWriteTokens(t *testing.T) {
	const n = 45
	for kind := range sharingBackings {
		for _, layout := range layouts {
			t.Run(fmt.Sprintf("%s/%v", sharingNames[kind], layout), func(t *testing.T) {
				s := seqOn(t, kind, layout, n)
				tb := tiny8.Groups[0].TokenBytes()
				for layer := range tiny8.Layers {
					for _, k := range kv.KindsOf(tiny8) {
						require.NoError(t, s.WriteTokens(layer, k, 0, n, tokenBytes(7, layer, k, 0, n, tb)))
					}
				}
				for _, chunk := range []int{1, 3, 4, 5, 16, n} {
					for layer := range tiny8.Layers {
						for _, k := range kv.KindsOf(tiny8) {
							for from := 0; from < n; from += chunk {
								to := min(from+chunk, n)
								got := make([]byte, (to-from)*tb)
								require.NoError(t, s.ReadTokens(layer, k, from, to, got))
								require.Equal(t, tokenBytes(7, layer, k, from, to, tb), got, "layer %d %v [%d, %d)", layer, k, from, to)
							}
						}
					}
				}
				v, err := kv.View[arena.F16](s, 2, kv.V)
				require.NoError(t, err)
				if v.HostAccessible() {
					want := tokenBytes(7, 2, kv.V, 0, n, tb)
					for tok := range n {
						h := v.At(viewIndex(s, tok, 1, 3)...)
						off := tok*tb + (1*tiny8.Groups[0].HeadDim+3)*2
						assert.Equal(t, arena.F16(uint16(want[off])|uint16(want[off+1])<<8), h, "token %d", tok)
					}
				}
			})
		}
	}
}

// TestReadWriteTokensBadInput: every bad argument fails with its sentinel and changes
// nothing; a write below Writable is refused whole.
func TestReadWriteTokensBadInput(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}))
	c := e.c
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(10))
	tb := tiny8.Groups[0].TokenBytes()
	buf := make([]byte, 2*tb)
	for _, tt := range []struct {
		name            string
		layer           int
		kind            kv.Kind
		from, to, bytes int
	}{
		{"negative layer", -1, kv.K, 0, 2, 2 * tb},
		{"layer past the last", tiny8.Layers, kv.K, 0, 2, 2 * tb},
		{"no such kind", 0, kv.V + 1, 0, 2, 2 * tb},
		{"negative from", 0, kv.K, -1, 1, 2 * tb},
		{"to below from", 0, kv.K, 3, 2, 0},
		{"past Len", 0, kv.K, 9, 11, 2 * tb},
		{"short buffer", 0, kv.K, 0, 2, 2*tb - 1},
		{"long buffer", 0, kv.K, 0, 2, 2*tb + 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := make([]byte, tt.bytes)
			assert.ErrorIs(t, s.ReadTokens(tt.layer, tt.kind, tt.from, tt.to, b), kv.ErrRange)
			assert.ErrorIs(t, s.WriteTokens(tt.layer, tt.kind, tt.from, tt.to, b), kv.ErrRange)
		})
	}
	require.NoError(t, s.ReadTokens(0, kv.K, 10, 10, nil), "an empty range at Len")
	require.NoError(t, s.WriteTokens(0, kv.K, 4, 6, tokenBytes(1, 0, kv.K, 4, 6, tb)))
	f, err := s.ForkAt(10)
	require.NoError(t, err)
	require.Equal(t, 8, f.Writable())
	assert.ErrorIs(t, f.WriteTokens(0, kv.K, 7, 9, buf), kv.ErrReadOnly)
	require.NoError(t, f.WriteTokens(0, kv.K, 8, 10, buf))
	require.NoError(t, s.ReadTokens(0, kv.K, 4, 6, buf))
	assert.Equal(t, tokenBytes(1, 0, kv.K, 4, 6, tb), buf, "the refused write changed nothing")
	require.True(t, f.Close().OK())
	require.True(t, s.Close().OK())
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _ = s.ReadTokens(0, kv.K, 0, 0, nil) })
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _ = s.WriteTokens(0, kv.K, 0, 0, nil) })
}

// TestRun: a tensor's runs are a block's tokens (Blocked) or all of them (PerLayer);
// walked run by run they are the tensor's bytes, and they cost no
// allocation, nor does a View.
func TestRun(t *testing.T) {
	const n = 21
	// A block holds s.BlockTokens() tokens: the backing's granule decides it (64 KiB
	// views on Windows hold more tokens than Linux's 4 KiB granules).
	wantRun := map[kv.Layout]func(s *kv.Sequence, tok int) int{
		kv.Blocked: func(s *kv.Sequence, tok int) int {
			rt := stridesOf(s, 0).RunTokens
			return min(rt-tok%s.BlockTokens()%rt, n-tok)
		},
		kv.PerLayer: func(_ *kv.Sequence, tok int) int { return n - tok },
	}
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			s := seqOn(t, onShared, layout, n)
			writeTokens(t, s, 3, 0, n)
			tb, per := tiny8.Groups[0].TokenBytes(), tiny8.Groups[0].KVHeads*tiny8.Groups[0].HeadDim
			for layer := range tiny8.Layers {
				for _, k := range kv.KindsOf(tiny8) {
					var got []byte
					for tok := 0; tok < n; {
						run, err := kv.Run[arena.F16](s, layer, k, tok)
						require.NoError(t, err)
						require.Equal(t, wantRun[layout](s, tok)*per, len(run), "token %d", tok)
						for _, h := range run {
							got = append(got, byte(h), byte(h>>8))
						}
						tok += len(run) / per
					}
					assert.Equal(t, tokenBytes(3, layer, k, 0, n, tb), got, "layer %d %v", layer, k)
				}
			}
			var sink int
			assert.Zero(t, testing.AllocsPerRun(100, func() {
				run, _ := kv.Run[arena.F16](s, 1, kv.V, 5)
				sink += len(run)
			}), "Run")
			assert.Zero(t, testing.AllocsPerRun(100, func() {
				v, _ := kv.View[arena.F16](s, 1, kv.V)
				sink += v.NumElems()
			}), "View")
			dst := make([]byte, n*tb)
			assert.Zero(t, testing.AllocsPerRun(100, func() {
				_ = s.ReadTokens(1, kv.V, 0, n, dst)
			}), "ReadTokens on the host")
			assert.Positive(t, sink)

			_, err := kv.Run[arena.F16](s, 0, kv.K, n)
			assert.ErrorIs(t, err, kv.ErrRange)
			_, err = kv.Run[arena.F16](s, tiny8.Layers, kv.K, 0)
			assert.ErrorIs(t, err, kv.ErrRange)
			_, err = kv.Run[arena.BF16](s, 0, kv.K, 0)
			assert.ErrorIs(t, err, kv.ErrElemType)
		})
	}
}

// TestRunOnDevice: device memory has no runs the CPU may read: ErrLayout.
func TestRunOnDevice(t *testing.T) {
	e := openEnv(t, onCUDA, pooled, withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked}))
	defer e.finish(t)
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(3))
	_, err = kv.Run[arena.F16](s, 0, kv.K, 0)
	assert.ErrorIs(t, err, kv.ErrLayout)
	require.True(t, s.Close().OK())
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _, _ = kv.Run[arena.F16](s, 0, kv.K, 0) })
}

// viewIndex returns the index of element [tok, h, d] of a layer's view of s: in the
// Blocked layout, token tok is token tok % BlockTokens of block tok / BlockTokens.
func viewIndex(s *kv.Sequence, tok, h, d int) []int {
	if s.BlockTokens() > 0 {
		return append(blockIndex(stridesOf(s, 0), tok, 0), h, d)
	}
	return []int{tok, h, d}
}
