package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheCloseAfterRewriteKeepsEntry: an entry got ranges of its own (the
// inserted sequence truncated below it), then the sequence rewrote those tokens and
// shared its ranges again (a fork) before it closed. Its ranges no longer hold what
// the entry's token IDs say, so the entry must not take them over: a later hit reads
// the tokens that were inserted.
func TestPrefixCacheCloseAfterRewriteKeepsEntry(t *testing.T) {
	const n = 22 // whole sharing units and a partly filled one, in every layout
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			_, _, pc := newPrefixCache(t, 1<<30, layout, 256, kv.PrefixCacheOptions{})
			ids := promptIDs(0, n+1)
			s, _, err := pc.Lookup(ids[:n])
			require.NoError(t, err)
			require.NoError(t, s.Append(n))
			require.NoError(t, writeIDs(s, ids, 0, n))
			require.NoError(t, pc.Insert(s, ids[:n]))

			require.NoError(t, s.Truncate(1)) // the entry copies what it holds first
			other := promptIDs(500, n)
			require.NoError(t, s.Append(n-1))
			require.NoError(t, writeIDs(s, other, 0, n), "all of s is its own again")
			f, err := s.ForkAt(n)
			require.NoError(t, err)
			require.True(t, f.Close().OK())
			require.True(t, s.Close().OK())

			q, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			assert.Equal(t, n, m)
			assert.NoError(t, checkIDs(q, ids, 0, m), "the entry holds the tokens it was inserted with")
			require.True(t, q.Close().OK())
		})
	}
}
