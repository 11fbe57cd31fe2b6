package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestInsertDisplacingIsNoEviction: an insert that extends a cached entry (43 tokens:
// a partly filled last unit in every layout) replaces
// it (the new entry holds its tokens) and evicts nothing: EvictedBytes stays 0, as do
// Evictions and EvictedTokens, though the old entry's copied tail goes back.
func TestInsertDisplacingIsNoEviction(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			_, _, pc := newPrefixCache(t, 1<<30, layout, 256, kv.PrefixCacheOptions{})
			ids := promptIDs(0, 60)
			s, err := serveN(pc, ids[:43])
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			s, m, err := serve(pc, ids)
			require.NoError(t, err)
			require.Equal(t, 43, m)
			require.True(t, s.Close().OK())
			st := pc.Stats()
			assert.Equal(t, 1, st.Entries)
			assert.Zero(t, st.Evictions)
			assert.Zero(t, st.EvictedTokens)
			assert.Zero(t, st.EvictedBytes, "a displaced entry is not evicted")
		})
	}
}
