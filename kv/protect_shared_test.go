//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// After Fork, ForkAt and Freeze the origin's own mapping of the shared granules is
// read-only on host.Shared, as the sharers' are: a stray store through its View
// faults (a Go panic under debug.SetPanicOnFault) and writes nothing, while its own
// tail stays writable.
func TestOriginWriteFaultsOnShared(t *testing.T) {
	for _, layout := range layouts {
		for _, op := range []string{"Fork", "ForkAt", "Freeze"} {
			t.Run(layout.String()+"/"+op, func(t *testing.T) {
				c := openEnv(t, onShared, withGranule(64<<10), withName("kv-protect"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout})).c
				s, err := c.NewSequence()
				require.NoError(t, err)
				require.NoError(t, s.Append(300))
				writeTokens(t, s, 1, 0, 300)
				var sharer *kv.Sequence
				switch op {
				case "Fork":
					sharer, err = s.Fork()
				case "ForkAt":
					sharer, err = s.ForkAt(200)
				case "Freeze":
					var p *kv.Prefix
					p, err = s.Freeze(200)
					if err == nil {
						sharer, err = c.NewSequenceFrom(p)
						p.Release()
					}
				}
				require.NoError(t, err)
				w := s.Writable()
				require.Positive(t, w)
				// NB: layer 0's K of token w-1 lies in a shared granule in every layout.
				for _, q := range []*kv.Sequence{s, sharer} {
					v, err := kv.View[arena.F16](q, 0, kv.K)
					require.NoError(t, err)
					assert.Error(t, testutil.Fault(func() { v.Set(arena.F16FromFloat32(9), viewIndex(q, w-1, 0, 0)...) }), "a store below Writable faults")
					assert.Error(t, testutil.Fault(func() { v.Set(arena.F16FromFloat32(9), viewIndex(q, 0, 1, 2)...) }), "a store below Writable faults")
				}
				checkTokens(t, s, 1, 0, 300)
				checkTokens(t, sharer, 1, 0, sharer.Len())
				v, err := kv.View[arena.F16](s, tiny8.Layers-1, kv.V)
				require.NoError(t, err)
				assert.NoError(t, testutil.Fault(func() { v.Set(arena.F16FromFloat32(9), viewIndex(s, 299, 0, 0)...) }), "the origin's tail stays writable")
				assert.True(t, sharer.Close().OK())
				assert.True(t, s.Close().OK())
			})
		}
	}
}
