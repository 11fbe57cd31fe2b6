//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheTruncatedLookupUnpins: a sequence started by Lookup and then
// truncated to nothing maps none of the cache's granules any more: they are not
// pinned by it, and eviction can give them back.
func TestPrefixCacheTruncatedLookupUnpins(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			_, pc, _ := newHostPrefixCache(t, "kv-pc-rev2", layout)
			a := cacheIDs(t, pc, 300)
			q, m, err := pc.Lookup(append(a[:300:300], 7))
			require.NoError(t, err)
			require.Equal(t, 300, m)
			require.NotZero(t, pc.Stats().PinnedBytes)
			require.NoError(t, q.Truncate(0))
			assert.Zero(t, pc.Stats().PinnedBytes, "q maps nothing of the cache now")
			require.True(t, q.Close().OK())
		})
	}
}

// TestPrefixCacheInsertShorterThanMapped: a sequence started by Lookup on many cached
// granules is inserted under a key that covers fewer of them, then truncated into
// the key's last granule and closed. Insert used to panic there with the cache's
// lock held (slices.Grow by a negative count), which then hung every later call.
func TestPrefixCacheInsertShorterThanMapped(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			_, pc, b := newHostPrefixCache(t, "kv-pc-short", layout)
			a := cacheIDs(t, pc, 400)
			q, m, err := pc.Lookup(a)
			require.NoError(t, err)
			require.Equal(t, 399, m)
			require.NoError(t, pc.Insert(q, append(a[:160:160], 9999)))
			require.NoError(t, q.Truncate(165))
			require.True(t, q.Close().OK())
			assert.Zero(t, pc.Stats().PinnedBytes)
			r, m, err := pc.Lookup(append(a[:160:160], 9999, 1))
			require.NoError(t, err)
			assert.Equal(t, 161, m, "the shorter key is found")
			require.True(t, r.Close().OK())
			require.NoError(t, pc.Close())
			assert.Zero(t, held(b), "every granule given back once the cache closes")
		})
	}
}

// cacheIDs caches the token IDs 0..n-1 in pc through a sequence that wrote them and
// closed, and returns them.
func cacheIDs(t *testing.T, pc *kv.PrefixCache, n int) []int32 {
	t.Helper()
	a := make([]int32, n)
	for i := range a {
		a[i] = int32(i)
	}
	s, _, err := pc.Lookup(a)
	require.NoError(t, err)
	require.NoError(t, s.Append(len(a)))
	require.NoError(t, writeIDs(s, a, 0, len(a)))
	require.NoError(t, pc.Insert(s, a))
	require.True(t, s.Close().OK())
	return a
}
