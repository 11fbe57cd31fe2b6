package kv_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// tinyMLA is DeepSeek-V3's shape in small: one MLA group, a latent of 256 f16 values
// (512 bytes) per token and layer, K alone.
var tinyMLA = kv.Model{Name: "tiny-mla", Layers: 3, Groups: []kv.Group{
	{Kind: kv.MLALatent, Layers: []int{0, 1, 2}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
}}

// TestPrefixCacheMLA: on a model of one MLA group, on each sharing backing and
// layout, every lookup is checked against the naive model of
// TestPrefixCacheLongestMatch (the longest common prefix with an inserted prompt,
// short of the last token), every latent of every layer is read back after the hit,
// a fork and a rollback of it, the counts are exact, an eviction of everything gives
// back every cached byte, and the books (pool, ledger, governor) agree throughout.
func TestPrefixCacheMLA(t *testing.T) {
	onEachSharing(t, []envOption{withConfig(kv.Config{Model: tinyMLA, MaxTokens: 256})}, func(t *testing.T, e *env) {
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
		require.NoError(t, err)
		defer func() { assert.NoError(t, pc.Close()) }()
		// The check can fail: a latent written for one ID does not read back as
		// another's.
		probe, err := e.c.NewSequence()
		require.NoError(t, err)
		require.NoError(t, probe.Append(1))
		require.NoError(t, writeIDs(probe, []int32{5}, 0, 1))
		require.Error(t, checkIDs(probe, []int32{6}, 0, 1))
		require.True(t, probe.Close().OK())
		r := rand.New(rand.NewPCG(25, uint64(e.c.Config().Layout)))
		var made [][]int32
		var queries, hits int64
		forks, rollbacks := 0, 0
		for range 40 {
			ids := stream(r, made, 200)
			want := 0
			for _, p := range made {
				want = max(want, min(commonLen(p, ids), len(ids)-1))
			}
			s, m, err := serve(pc, ids)
			require.NoError(t, err)
			require.Equal(t, want, m, "the longest cached prefix of %v", ids)
			queries += int64(len(ids))
			hits += int64(m)
			require.NoError(t, checkIDs(s, ids, 0, len(ids)), "every latent after the hit")
			if m > 0 {
				_, err := kv.View[arena.F16](s, 0, kv.V)
				require.ErrorIs(t, err, kv.ErrRange, "an MLA layer has no V, hit or not")
			}
			if at := r.IntN(len(ids) + 1); r.IntN(2) == 0 {
				f, err := s.ForkAt(at)
				require.NoError(t, err)
				require.NoError(t, checkIDs(f, ids, 0, at), "a fork at %d", at)
				require.True(t, f.Close().OK())
				forks++
			}
			if r.IntN(3) == 0 {
				// A rollback into the cached tokens: the entry keeps its own copy.
				n := r.IntN(len(ids) + 1)
				require.NoError(t, s.Truncate(n))
				require.NoError(t, checkIDs(s, ids, 0, n), "rolled back to %d", n)
				rollbacks++
			}
			require.True(t, s.Close().OK())
			made = append(made, ids)
			e.books(t, "after a request")
		}
		require.Positive(t, forks)
		require.Positive(t, rollbacks)
		st := pc.Stats()
		assert.Equal(t, queries, st.Queries)
		assert.Equal(t, hits, st.Hits)
		assert.Positive(t, st.Hits)
		assert.Positive(t, st.CachedBytes)

		// Every cached prompt reads back whole from a hit of all but its last token.
		for _, ids := range made {
			if len(ids) < 2 {
				continue
			}
			s, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			require.Equal(t, len(ids)-1, m)
			require.NoError(t, checkIDs(s, ids, 0, m))
			require.True(t, s.Close().OK())
		}

		evictsAll(t, pc)
		assert.Zero(t, e.c.Stats().Committed, "every granule is back")
		e.books(t, "after evicting everything")
	})
}

// TestPrefixCacheMLAEvicts: under MaxBytes, a cache of one MLA group evicts, keeps
// the cap, and what it still finds reads back whole; its bad inputs are refused as a
// full-attention cache's are, changing nothing.
func TestPrefixCacheMLAEvicts(t *testing.T) {
	onEachSharing(t, []envOption{withConfig(kv.Config{Model: tinyMLA, MaxTokens: 256})}, func(t *testing.T, e *env) {
		gbytes := int64(e.c.Granularity())
		if e.c.Config().Layout == kv.PerLayer {
			gbytes *= int64(tinyMLA.Layers) // a granule in each layer's range
		}
		limit := 12 * gbytes
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{MaxBytes: limit})
		require.NoError(t, err)
		defer func() { assert.NoError(t, pc.Close()) }()
		r := rand.New(rand.NewPCG(26, uint64(e.c.Config().Layout)))
		var made [][]int32
		var hits int64
		for range 30 {
			ids := stream(r, made, 200)
			for len(ids) < 100 {
				ids = append(ids, int32(r.IntN(1000)))
			}
			s, m, err := serve(pc, ids)
			require.NoError(t, err)
			hits += int64(m)
			require.True(t, s.Close().OK())
			assert.LessOrEqual(t, pc.Stats().CachedBytes, limit)
			made = append(made, ids)
		}
		st := pc.Stats()
		assert.Equal(t, hits, st.Hits)
		assert.Positive(t, st.Evictions, "the cap made it evict")
		assert.Positive(t, st.EvictedBytes)

		// Bad input: more tokens than the sequence holds, and a negative eviction.
		s, _, err := pc.Lookup(made[0])
		require.NoError(t, err)
		require.NoError(t, s.Append(len(made[0])-s.Len()))
		before := pc.Stats()
		assert.ErrorIs(t, pc.Insert(s, append(made[0][:len(made[0]):len(made[0])], 1)), kv.ErrRange)
		assert.Equal(t, before.InsertedTokens, pc.Stats().InsertedTokens, "a refused insert changes nothing")
		_, err = pc.Evict(-1)
		assert.Error(t, err)
		require.True(t, s.Close().OK())
		e.books(t, "after the refusals")
	})
}

// TestPrefixCacheGroupsRefused: a model of window groups beside full ones has no
// tiers in the PerLayer layout (as one group has not), nor one of recurrent groups
// beside them (a prefix cache of checkpoints): each is refused with ErrConfig, saying
// what is needed, and the cache stays usable.
func TestPrefixCacheGroupsRefused(t *testing.T) {
	hybrid := kv.Model{Name: "tiny-gpt-oss", Layers: 2, Groups: []kv.Group{
		{Kind: kv.SlidingWindow, Window: 16, Layers: []int{0}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
		{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
	}}
	recurrent := kv.Model{Name: "tiny-next", Layers: 2, Groups: []kv.Group{
		{Kind: kv.Recurrent, Layers: []int{0}, StateBytes: 4096},
		{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
	}}
	for _, tt := range []struct {
		name   string
		m      kv.Model
		layout kv.Layout
		opts   kv.PrefixCacheOptions
		says   string
	}{
		{"tiers beside windows, per layer", hybrid, kv.PerLayer, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}}, "only the Blocked layout"},
		{"tiers beside recurrent groups, per layer", recurrent, kv.PerLayer, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}}, "only the Blocked layout"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := openEnv(t, onShared, withConfig(kv.Config{Model: tt.m, MaxTokens: 256, Layout: tt.layout}))
			_, err := kv.NewPrefixCache(e.c, tt.opts)
			require.ErrorIs(t, err, kv.ErrConfig)
			assert.ErrorContains(t, err, tt.says)
			s, err := e.c.NewSequence()
			require.NoError(t, err, "the cache stays usable")
			require.NoError(t, s.Append(40))
			require.True(t, s.Close().OK())
		})
	}
}

// evictsAll evicts every cached byte of pc, with no live sequence left, and checks
// that all of it came back and the index is empty.
func evictsAll(t *testing.T, pc *kv.PrefixCache) {
	t.Helper()
	cached := pc.Stats().CachedBytes
	freed, err := pc.Evict(cached)
	require.NoError(t, err)
	st := pc.Stats()
	assert.Equal(t, cached, freed, "no live sequence maps a cached granule")
	assert.Zero(t, st.CachedBytes)
	assert.Zero(t, st.Entries)
	assert.Equal(t, st.InsertedTokens, st.EvictedTokens)
}
