//go:build linux || windows

package kv_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// held returns the bytes e's pool owns that are not idle in it.
func (e *env) held() int64 { return e.auth.Stats().Owned - e.pool.PoolStats().Idle }

// TestPrefixCacheInsertIsBookkeeping: Insert maps nothing and commits nothing (the
// entry refers to the sequence's granules); the first hit maps them into the new
// sequence only.
func TestPrefixCacheInsertIsBookkeeping(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-lazy"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			c, pc := e.c, e.pc
			ids := promptIDs(0, 300)
			s := prefilled(t, pc, ids)
			before := c.Stats()
			heldBefore := e.held()
			require.NoError(t, pc.Insert(s, ids))
			after := c.Stats()
			assert.Equal(t, heldBefore, e.held(), "Insert commits nothing")
			assert.Equal(t, before.Mapped, after.Mapped, "Insert maps nothing")
			st := pc.Stats()
			assert.Equal(t, 1, st.Entries)
			assert.Equal(t, int64(300), st.InsertedTokens)
			assert.Equal(t, st.CachedBytes, st.PinnedBytes, "the live origin maps every granule the entry holds")

			q, m, err := pc.Lookup(append(ids[:300:300], 7))
			require.NoError(t, err)
			require.Equal(t, 300, m)
			require.NoError(t, checkIDs(q, ids, 0, 300))
			assert.Equal(t, heldBefore+ownTail(c, 300), e.held(),
				"the hit owns only its copied tail")
			require.True(t, q.Close().OK())
			require.True(t, s.Close().OK())
			st = pc.Stats()
			assert.Equal(t, 1, st.Entries, "the entry took over the origin's ranges")
			assert.Zero(t, st.PinnedBytes)
			assert.Equal(t, st.CachedBytes, e.held(), "with no live sequence, the pool holds just the cache")
			r, m, err := pc.Lookup(append(ids[:300:300], 8))
			require.NoError(t, err)
			defer r.Close()
			require.Equal(t, 300, m)
			require.NoError(t, checkIDs(r, ids, 0, 300))
		})
	}
}

// ownTail returns the bytes of the granules a sequence started on n cached tokens
// commits of its own: the one per range holding the tokens past the last whole one.
func ownTail(c *kv.Cache, n int) int64 {
	g := c.Granularity()
	ranges, row := 1, tiny8.BytesPerToken()
	if c.Config().Layout == kv.PerLayer {
		ranges, row = 2*tiny8.Layers, tiny8.Groups[0].TokenBytes()
	}
	if n*row%g == 0 {
		return 0
	}
	return int64(ranges * g)
}

// TestPrefixCacheHitProtectsOrigin: until a lookup maps an inserted sequence's
// granules, the origin's own mapping of them stays writable (the window the package
// doc describes); the first hit makes it read-only, so that a stray store through
// the origin's View faults rather than reach the sequence started on it, while the
// origin's tail stays writable.
func TestPrefixCacheHitProtectsOrigin(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-protect"), withConfig(kv.Config{MaxTokens: 1024, Layout: layout, BlockTokens: oldBlock(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			pc := e.pc
			ids := promptIDs(1000, 300)
			s, _, err := serve(pc, ids)
			require.NoError(t, err)
			w := s.Writable()
			require.Positive(t, w)
			v, err := kv.View[arena.F16](s, 0, kv.K)
			require.NoError(t, err)
			// NB: storing what is there already changes nothing the cache holds.
			same := v.At(viewIndex(s, 0, 1, 2)...)
			assert.NoError(t, testutil.Fault(func() { v.Set(same, viewIndex(s, 0, 1, 2)...) }), "no hit yet: the origin's mapping is still writable")

			q, m, err := pc.Lookup(append(ids[:300:300], -1))
			require.NoError(t, err)
			require.Equal(t, 300, m)
			for _, seq := range []*kv.Sequence{s, q} {
				qv, err := kv.View[arena.F16](seq, 0, kv.K)
				require.NoError(t, err)
				assert.Error(t, testutil.Fault(func() { qv.Set(arena.F16FromFloat32(9), viewIndex(seq, w-1, 0, 0)...) }), "a store below Writable faults")
				assert.Error(t, testutil.Fault(func() { qv.Set(arena.F16FromFloat32(9), viewIndex(seq, 0, 1, 2)...) }), "a store below Writable faults")
			}
			require.NoError(t, checkIDs(s, ids, 0, 300))
			require.NoError(t, checkIDs(q, ids, 0, 300))
			tail, err := kv.View[arena.F16](s, tiny8.Layers-1, kv.V)
			require.NoError(t, err)
			assert.NoError(t, testutil.Fault(func() { tail.Set(arena.F16FromFloat32(9), viewIndex(s, 299, 0, 0)...) }), "the origin's tail stays writable")
			// A second hit protects nothing more and maps the same.
			r, m, err := pc.Lookup(append(ids[:300:300], -2))
			require.NoError(t, err)
			require.Equal(t, 300, m)
			require.NoError(t, checkIDs(r, ids, 0, 299))
			for _, seq := range []*kv.Sequence{r, q, s} {
				assert.True(t, seq.Close().OK())
			}
		})
	}
}

// TestPrefixCacheLazyConcurrent: lookups map from a live origin's ranges while its
// owner keeps appending, writing, truncating into what it cached and closing; every
// hit sees the K/V that were inserted (-race checks the ranges' lock).
func TestPrefixCacheLazyConcurrent(t *testing.T) {
	e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-lazy-conc"), withConfig(kv.Config{MaxTokens: 1024, Layout: kv.PerLayer, BlockTokens: oldBlock(kv.PerLayer)}), withPrefixCache(kv.PrefixCacheOptions{}))
	pc := e.pc
	for round := range 20 {
		ids := promptIDs(round*1000, 200)
		s, _, err := serve(pc, ids)
		require.NoError(t, err)
		wait := goWorkers(4, func(w int) error {
			for k := range 5 {
				q, m, err := pc.Lookup(append(ids[:200:200], int32(-1-w*10-k)))
				if err != nil {
					return err
				}
				err = checkIDs(q, ids, 0, m)
				q.Close()
				if err != nil {
					return err
				}
			}
			return nil
		})
		r := rand.New(rand.NewPCG(uint64(round), 3))
		for range 5 {
			require.NoError(t, s.Append(40))
			more := make([]int32, s.Len())
			copy(more, ids)
			require.NoError(t, writeIDs(s, more, 200, s.Len()))
			if r.IntN(2) == 0 {
				// Into the cached tokens: the entry gets ranges of its own first.
				require.NoError(t, s.Truncate(r.IntN(200)))
				require.NoError(t, s.Append(200-s.Len()))
				require.NoError(t, writeIDs(s, ids, s.Writable(), 200))
			}
		}
		require.True(t, s.Close().OK())
		wait(t)
	}
	st := pc.Stats()
	assert.Positive(t, st.Hits)
	assert.Zero(t, st.PinnedBytes)
	assert.Equal(t, st.CachedBytes, e.held(), "with no live sequence, the pool holds just the cache")
}

// TestPrefixCacheInsertTwiceDiverging: a sequence inserted under two token strings
// that part after a few tokens is found under both while it lives; when it closes
// the longer entry takes its ranges over and the other leaves the index, with the
// ledger exact.
func TestPrefixCacheInsertTwiceDiverging(t *testing.T) {
	e := openEnv(t, onShared, withGranule(64<<10), withName("kv-pc-twice"), withConfig(kv.Config{MaxTokens: 1024, Layout: kv.PerLayer, BlockTokens: oldBlock(kv.PerLayer)}), withPrefixCache(kv.PrefixCacheOptions{}))
	pc := e.pc
	a := promptIDs(0, 100)
	s, _, err := serve(pc, a)
	require.NoError(t, err)
	other := append([]int32(nil), a[:80]...)
	for i := 10; i < len(other); i++ {
		other[i] = int32(5000 + i) // only the IDs differ: s holds the same K/V
	}
	require.NoError(t, pc.Insert(s, other))
	assert.Equal(t, 2, pc.Stats().Entries)
	for _, ids := range [][]int32{a, other} {
		q, m, err := pc.Lookup(append(ids[:len(ids):len(ids)], -1))
		require.NoError(t, err)
		assert.Equal(t, len(ids), m)
		require.NoError(t, checkIDs(q, a, 0, m), "both entries map s's K/V")
		require.True(t, q.Close().OK())
	}
	require.True(t, s.Close().OK())
	st := pc.Stats()
	assert.Equal(t, 1, st.Entries, "the longer entry took s's ranges over")
	assert.Equal(t, st.CachedBytes, e.held(), "with no live sequence, the pool holds just the cache")
	q, m, err := pc.Lookup(append(a[:100:100], -2))
	require.NoError(t, err)
	defer q.Close()
	assert.Equal(t, 100, m)
	require.NoError(t, checkIDs(q, a, 0, 100))
	r, m, err := pc.Lookup(append(other[:80:80], -3))
	require.NoError(t, err)
	defer r.Close()
	assert.Equal(t, 10, m, "only the shared first tokens of the other are left")
}
