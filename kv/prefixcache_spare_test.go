package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// promptIDs returns n token IDs from first on.
func promptIDs(first, n int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32(first + i)
	}
	return ids
}

// committedOf returns the bytes s commits, from the cache's SequenceStats.
func committedOf(t *testing.T, c *kv.Cache, s *kv.Sequence) int64 {
	t.Helper()
	for _, st := range c.SequenceStats() {
		if st.ID == s.ID() {
			return st.Committed
		}
	}
	require.FailNow(t, "sequence not listed")
	return 0
}

// TestPrefixCacheMissTakesOverLRUEntry: a miss whose prompt the budget can not hold
// evicts the least recently used entry whole and starts the new sequence on its
// ranges with their granules committed, so that its prefill commits nothing; the
// ledger stays exact. It does not when the budget holds the prompt, when that entry
// holds more than the prompt needs, or when its ranges have read-only bytes (a hit
// protected them while it was live): those go through the eviction a growth makes.
func TestPrefixCacheMissTakesOverLRUEntry(t *testing.T) {
	const p = 64 // tokens per prompt
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			// One prompt's granules, measured on a cache of its own.
			_, _, probe := newPrefixCache(t, 1<<30, layout, 256, kv.PrefixCacheOptions{})
			s, _, err := serve(probe, promptIDs(0, p))
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			x := probe.Stats().CachedBytes
			require.Positive(t, x)

			fx, c, pc := newPrefixCache(t, 2*x+x/2, layout, 256, kv.PrefixCacheOptions{})
			a, b, cc := promptIDs(0, p), promptIDs(1000, p), promptIDs(2000, p)
			for _, ids := range [][]int32{a, b} {
				s, _, err := pc.Lookup(ids)
				require.NoError(t, err)
				assert.Zero(t, committedOf(t, c, s), "the budget holds the prompt: nothing taken over")
				require.NoError(t, s.Append(p))
				require.NoError(t, writeIDs(s, ids, 0, p))
				require.NoError(t, pc.Insert(s, ids))
				require.True(t, s.Close().OK())
			}
			require.Equal(t, 2*x, fx.pool.Stats().Owned)

			s, m, err := pc.Lookup(cc)
			require.NoError(t, err)
			assert.Zero(t, m)
			assert.Zero(t, s.Len())
			assert.Equal(t, x, committedOf(t, c, s), "the new sequence holds a's granules")
			st := pc.Stats()
			assert.Equal(t, 1, st.Entries)
			assert.Equal(t, int64(p), st.EvictedTokens)
			assert.Equal(t, x, st.EvictedBytes)
			assert.Equal(t, x, st.CachedBytes)
			assert.Equal(t, int64(p), st.CachedTokens, "b is left")
			require.NoError(t, s.Append(p))
			assert.Equal(t, 2*x, fx.pool.Stats().Owned, "the prefill committed nothing new")
			require.NoError(t, writeIDs(s, cc, 0, p))
			require.NoError(t, checkIDs(s, cc, 0, p))
			require.NoError(t, pc.Insert(s, cc))
			require.True(t, s.Close().OK())

			q, m, err := pc.Lookup(append(b[:p:p], -1))
			require.NoError(t, err)
			assert.Equal(t, p, m, "b is still cached")
			require.NoError(t, checkIDs(q, b, 0, p))
			require.True(t, q.Close().OK())

			// An entry larger than the prompt is not taken over: the prompt's growth
			// evicts what it needs.
			short := promptIDs(3000, p/4)
			s, _, err = pc.Lookup(short)
			require.NoError(t, err)
			assert.Zero(t, committedOf(t, c, s))
			require.NoError(t, s.Append(len(short)))
			require.True(t, s.Close().OK())
			assert.Equal(t, 2, pc.Stats().Entries)
		})
	}
}

// TestPrefixCacheMissSkipsGuardedEntry: an entry whose ranges a hit made read-only in
// part (while the inserted sequence was live) is never handed to a new sequence,
// which would write there; the miss's growth evicts it instead.
func TestPrefixCacheMissSkipsGuardedEntry(t *testing.T) {
	const p = 64
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			_, _, probe := newPrefixCache(t, 1<<30, layout, 256, kv.PrefixCacheOptions{})
			s, _, err := serve(probe, promptIDs(0, p))
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			x := probe.Stats().CachedBytes

			fx, c, pc := newPrefixCache(t, 2*x+x/2, layout, 256, kv.PrefixCacheOptions{})
			a := promptIDs(0, p)
			s, _, err = serve(pc, a)
			require.NoError(t, err)
			q, m, err := pc.Lookup(append(a[:p:p], -1))
			require.NoError(t, err)
			require.Equal(t, p, m)
			require.True(t, q.Close().OK())
			require.True(t, s.Close().OK())
			s, _, err = serve(pc, promptIDs(1000, p))
			require.NoError(t, err)
			require.True(t, s.Close().OK())

			cc := promptIDs(2000, p)
			s, _, err = pc.Lookup(cc)
			require.NoError(t, err)
			assert.Zero(t, committedOf(t, c, s), "a's ranges are read-only in part: not taken over")
			require.NoError(t, s.Append(p), "the growth evicts instead")
			require.NoError(t, writeIDs(s, cc, 0, p))
			require.NoError(t, checkIDs(s, cc, 0, p))
			assert.LessOrEqual(t, fx.pool.Stats().Owned, 2*x+x/2)
			require.True(t, s.Close().OK())
		})
	}
}
