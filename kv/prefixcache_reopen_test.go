package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheReopened: a server may close its prefix cache and make another on
// the same cache while sequences live. A sequence that maps the first one's granules
// (a hit, or one inserted there), or a fork of it, is refused by the second one's
// Insert with ErrConfig, and nothing changes: it stays usable, the second cache's
// books hold none of the first's, and everything is given back at the end.
func TestPrefixCacheReopened(t *testing.T) {
	const p = 40
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			fx := newFixture(t, 1<<30)
			c := fx.cache(t, layout, 256)
			pc1, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			a := promptIDs(0, p)
			s, _, err := serve(pc1, a)
			require.NoError(t, err)
			hit, m, err := pc1.Lookup(append(a[:p:p], -1))
			require.NoError(t, err)
			require.Equal(t, p, m)
			fork, err := hit.Fork()
			require.NoError(t, err)
			require.NoError(t, pc1.Close())

			pc2, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			for _, q := range []*kv.Sequence{s, hit, fork} {
				err := pc2.Insert(q, a)
				require.ErrorIs(t, err, kv.ErrConfig)
				assert.Contains(t, err.Error(), "earlier prefix cache")
				require.NoError(t, checkIDs(q, a, 0, p), "refused, it keeps its tokens")
				require.NoError(t, q.Append(1), "and stays usable")
			}
			assert.Zero(t, pc2.Stats().Entries)
			assert.Zero(t, pc2.Stats().CachedBytes)

			// A sequence new to the second one is cached as usual.
			b := promptIDs(1000, p)
			q, _, err := serve(pc2, b)
			require.NoError(t, err)
			require.True(t, q.Close().OK())
			r, m, err := pc2.Lookup(append(b[:p:p], -1))
			require.NoError(t, err)
			assert.Equal(t, p, m)
			require.NoError(t, checkIDs(r, b, 0, p))
			for _, q := range []*kv.Sequence{s, hit, fork, r} {
				require.True(t, q.Close().OK())
			}
			require.NoError(t, pc2.Close())
		})
	}
}
