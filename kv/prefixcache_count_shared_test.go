//go:build linux || windows

package kv_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPrefixCacheTwoKeysTruncatedCount: a sequence inserted under two token strings
// that part after a few tokens, then truncated into the last granule of the shorter
// one's tokens (the copy path: that granule is replaced by one of the sequence's
// own), and closed. CachedBytes must then be what the pool holds: each physical
// granule once, none left out. (It used to count one granule too many or too few:
// the two entries stood for one granule by two references, or for two by one.)
func TestPrefixCacheTwoKeysTruncatedCount(t *testing.T) {
	for _, layout := range layouts {
		for _, shortFirst := range []bool{false, true} {
			for _, cut := range []int{150, 190, 200, 230} {
				t.Run(fmt.Sprintf("%v/short-first=%v/cut=%d", layout, shortFirst, cut), func(t *testing.T) {
					_, pc, b := newHostPrefixCache(t, "kv-pc-count", layout)
					long := make([]int32, 300)
					for i := range long {
						long[i] = int32(i)
					}
					short := append([]int32(nil), long[:200]...)
					for i := 10; i < len(short); i++ {
						short[i] = int32(5000 + i) // only the IDs differ
					}
					s, _, err := pc.Lookup(long)
					require.NoError(t, err)
					require.NoError(t, s.Append(len(long)))
					require.NoError(t, writeIDs(s, long, 0, len(long)))
					keys := [][]int32{long, short}
					if shortFirst {
						keys[0], keys[1] = keys[1], keys[0]
					}
					for _, k := range keys {
						require.NoError(t, pc.Insert(s, k))
					}
					require.NoError(t, s.Truncate(cut))
					require.True(t, s.Close().OK())
					st := pc.Stats()
					assert.Equal(t, held(b), st.CachedBytes, "with no live sequence, the pool holds just the cache")
					assert.Zero(t, st.PinnedBytes)
				})
			}
		}
	}
}
