package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/baseline"
)

// TestCacheAdapter drives the kv cache through the baseline interface on both host
// backings: data written reads back through a prefix, misuse is refused, and Close
// gives everything back.
func TestCacheAdapter(t *testing.T) {
	bks := []string{"private"}
	if defaultBacking == "shared" {
		bks = append(bks, "shared") // Linux only: it needs memfd_create
	}
	for _, bk := range bks {
		t.Run(bk, func(t *testing.T) {
			s := testSetup(0)
			s.backing = bk
			b, err := build(nameCache, s)
			require.NoError(t, err)
			st := b.st
			assert.Equal(t, nameCache, st.Name())
			tb := testModel.Groups[0].TokenBytes()
			token := func(v byte) []byte { return bytes.Repeat([]byte{v}, tb) }

			root, err := st.NewSequence()
			require.NoError(t, err)
			require.NoError(t, root.Append(testSystem))
			for tok := range testSystem {
				for l := range testModel.Layers {
					require.NoError(t, root.WriteToken(l, baseline.V, tok, token(byte(tok))))
				}
			}
			p, err := root.Freeze(testSystem)
			require.NoError(t, err)
			assert.Equal(t, testSystem, p.Len())
			require.NoError(t, root.Close())

			q, err := st.NewSequenceFrom(p)
			require.NoError(t, err)
			assert.Equal(t, testSystem, q.Len())
			require.NoError(t, q.Append(3))
			require.NoError(t, q.WriteToken(1, baseline.K, testSystem+2, token(0xEE)))
			dst := make([]byte, tb)
			r := q.(baseline.Reader)
			for _, tok := range []int{0, 37, testSystem - 1} {
				require.NoError(t, r.ReadToken(testModel.Layers-1, baseline.V, tok, dst))
				assert.Equal(t, token(byte(tok)), dst, "prefix token %d", tok)
			}
			require.NoError(t, r.ReadToken(1, baseline.K, testSystem+2, dst))
			assert.Equal(t, token(0xEE), dst)

			stats := st.Stats()
			assert.Equal(t, 1, stats.Sequences)
			assert.Equal(t, 1, stats.Prefixes)
			assert.Equal(t, int64(testSystem+3), stats.Tokens)
			assert.Positive(t, stats.Physical)
			assert.GreaterOrEqual(t, stats.PeakPhysical, stats.Physical)
			if bk == "shared" {
				assert.Positive(t, stats.Saved, "whole granules of the prefix are mapped")
				assert.Error(t, q.WriteToken(0, baseline.K, 0, token(1)), "shared memory is read-only")
			} else {
				assert.Zero(t, stats.Saved, "private memory can not be shared: the prefix is copied")
				assert.NoError(t, q.WriteToken(0, baseline.K, 0, token(1)), "a copy is the sequence's own")
			}

			// A prefix from elsewhere is refused; a live sequence keeps Close from
			// closing.
			other, err := baseline.NewAppend(baseline.Shape{Layers: 1, TokenBytes: 1, MaxTokens: 1}, baseline.AppendOptions{})
			require.NoError(t, err)
			oq, err := other.NewSequence()
			require.NoError(t, err)
			op, err := oq.Freeze(0)
			require.NoError(t, err)
			_, err = st.NewSequenceFrom(op)
			assert.ErrorIs(t, err, baseline.ErrForeign)
			op.Release()
			require.NoError(t, oq.Close())

			assert.Error(t, st.Close())
			require.NoError(t, q.Close())
			assert.Error(t, st.Close(), "the prefix is still held")
			p.Release()
			assert.Panics(t, p.Release)
			require.NoError(t, st.Close())
			require.ErrorIs(t, st.Close(), baseline.ErrClosed, "a second Close changes nothing")
			assert.Zero(t, b.gov.Stats(b.dev).Used, "governor at zero")
			if bk == "shared" {
				ps := b.pool()
				require.NotNil(t, ps)
				assert.Zero(t, ps.Mapped)
				assert.Equal(t, ps.Owned, ps.Idle)
			}
		})
	}
}
