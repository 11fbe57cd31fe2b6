//go:build linux || windows

package kv_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheCloseKeepsSharedTail: an entry got ranges of its own (a write into
// the tokens it holds), and the inserted sequence then froze a prefix whose whole
// blocks cover the entry's partly filled one. When the sequence closes, the entry must
// not copy its tail into the sequence's ranges to take them over: that block is the
// frozen prefix's too (read-only in the sequence on host.Shared, so the copy faulted),
// and the prefix's tokens there are not the entry's.
func TestPrefixCacheCloseKeepsSharedTail(t *testing.T) {
	c := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-adopt-tail"), withConfig(kv.Config{MaxTokens: 256})).c
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pc.Close()) })
	const n = 10
	ids := promptIDs(0, n+1)
	s, err := c.NewSequence()
	require.NoError(t, err)
	tpb := s.BlockTokens()
	require.Greater(t, tpb, n, "the entry holds a partly filled block only")
	require.NoError(t, s.Append(n))
	require.NoError(t, writeIDs(s, ids, 0, n))
	require.NoError(t, pc.Insert(s, ids[:n]))

	other := promptIDs(500, tpb)
	require.NoError(t, s.Append(tpb-n))
	require.NoError(t, writeIDs(s, other, n-1, tpb), "the entry copies its tokens first")
	pr, err := s.Freeze(tpb)
	require.NoError(t, err)
	defer pr.Release()
	require.NoError(t, testutil.Fault(func() { require.True(t, s.Close().OK()) }), "Close wrote into a read-only block")

	f, err := c.NewSequenceFrom(pr)
	require.NoError(t, err)
	assert.NoError(t, checkIDs(f, ids, 0, n-1))
	assert.NoError(t, checkIDs(f, other, n-1, tpb), "the frozen prefix keeps its own tokens")
	require.True(t, f.Close().OK())
	q, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	assert.Equal(t, n, m)
	assert.NoError(t, checkIDs(q, ids, 0, m), "the entry holds the tokens it was inserted with")
	require.True(t, q.Close().OK())
}

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
					e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-count"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
					pc := e.pc
					long := promptIDs(0, 300)
					short := append([]int32(nil), long[:200]...)
					for i := 10; i < len(short); i++ {
						short[i] = int32(5000 + i) // only the IDs differ
					}
					s := prefilled(t, pc, long)
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
					assert.Equal(t, e.held(), st.CachedBytes, "with no live sequence, the pool holds just the cache")
					assert.Zero(t, st.PinnedBytes)
				})
			}
		}
	}
}

// TestPrefixCacheInsertAfterForkHost is TestPrefixCacheInsertAfterFork on a
// host.Shared pool, whose granules are reference-counted by their mappings: a granule
// the holder maps stays owned when the entry unmaps it.
func TestPrefixCacheInsertAfterForkHost(t *testing.T) {
	const p = 300
	for _, layout := range layouts {
		for _, how := range []string{"fork", "forkat", "freeze", "child"} {
			t.Run(layout.String()+"/"+how, func(t *testing.T) {
				e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-forkins"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
				c, pc := e.c, e.pc
				gov, auth, b := e.gov, e.auth, e.shared
				pool := forkInsertPool{
					held: e.held,
					limit: func(t *testing.T) {
						_, err := b.Trim(0) // idle granules would cover the growth
						require.NoError(t, err)
						require.NoError(t, gov.SetLimit(accounting.HostKey, auth.Stats().Owned))
					},
				}
				forkThenInsert(t, c, pc, pool, how, p)
			})
		}
	}
}

// TestPrefixCacheMissTakesOverHost is TestPrefixCacheMissTakesOverLRUEntry on a
// host.Shared pool, where read-only memory faults: the new sequence writes the
// taken-over granules in place, and an entry that a hit protected while its sequence
// lived (a real mprotect) is left to the growth's eviction rather than handed over.
func TestPrefixCacheMissTakesOverHost(t *testing.T) {
	const p = 300
	for _, layout := range layouts {
		for _, guarded := range []bool{false, true} {
			name := layout.String() + map[bool]string{false: "/plain", true: "/guarded"}[guarded]
			t.Run(name, func(t *testing.T) {
				e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-spare"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
				c, pc := e.c, e.pc
				gov, auth, b := e.gov, e.auth, e.shared
				a, bb, cc := promptIDs(0, p), promptIDs(1000, p), promptIDs(2000, p)
				s, _, err := serve(pc, a)
				require.NoError(t, err)
				if guarded {
					q, m, err := pc.Lookup(append(a[:p:p], -1))
					require.NoError(t, err)
					require.Equal(t, p, m)
					require.True(t, q.Close().OK())
				}
				require.True(t, s.Close().OK())
				x := pc.Stats().CachedBytes
				s, _, err = serve(pc, bb)
				require.NoError(t, err)
				require.True(t, s.Close().OK())
				_, err = b.Trim(0) // idle granules would cover the miss's growth
				require.NoError(t, err)
				require.Equal(t, 2*x, e.held())
				require.NoError(t, gov.SetLimit(accounting.HostKey, auth.Stats().Owned+x/2))

				s, m, err := pc.Lookup(cc)
				require.NoError(t, err)
				require.Zero(t, m)
				if guarded {
					assert.Zero(t, committedOf(t, c, s), "a's ranges are read-only in part: not taken over")
				} else {
					assert.Equal(t, x, committedOf(t, c, s), "the new sequence holds a's granules")
				}
				require.NoError(t, s.Append(p))
				require.NoError(t, writeIDs(s, cc, 0, p), "the granules are writable")
				require.NoError(t, checkIDs(s, cc, 0, p))
				require.NoError(t, pc.Insert(s, cc))
				require.True(t, s.Close().OK())
				st := pc.Stats()
				if guarded {
					assert.Equal(t, 3, st.Entries, "the growth took only the shortfall, from a's tail")
				} else {
					assert.Equal(t, 2, st.Entries, "a went whole")
				}
				assert.Equal(t, st.CachedBytes, e.held(), "with no live sequence, the pool holds just the cache")
				// A hit may need budget of its own (a granule of small private pages
				// moves into the memfd when first shared): lift the limit.
				require.NoError(t, gov.SetLimit(accounting.HostKey, accounting.Unlimited))
				q, m, err := pc.Lookup(append(bb[:p:p], -1))
				require.NoError(t, err)
				assert.Equal(t, p, m)
				require.NoError(t, checkIDs(q, bb, 0, p))
				require.True(t, q.Close().OK())
			})
		}
	}
}

// TestPrefixCacheTruncatedLookupUnpins: a sequence started by Lookup and then
// truncated to nothing maps none of the cache's granules any more: they are not
// pinned by it, and eviction can give them back.
func TestPrefixCacheTruncatedLookupUnpins(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-rev2"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			pc := e.pc
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
			e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-short"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			pc := e.pc
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
			assert.Zero(t, e.held(), "every granule given back once the cache closes")
		})
	}
}

// cacheIDs caches the token IDs 0..n-1 in pc through a sequence that wrote them and
// closed, and returns them.
func cacheIDs(t *testing.T, pc *kv.PrefixCache, n int) []int32 {
	t.Helper()
	a := promptIDs(0, n)
	s := prefilled(t, pc, a)
	require.NoError(t, pc.Insert(s, a))
	require.True(t, s.Close().OK())
	return a
}
