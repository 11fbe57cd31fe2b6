package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil/promtest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/metrics"
)

// TestCollectCheckpoints reads a prefix cache of a small recurrent hybrid (Qwen3-Next's
// pattern: recurrent layers beside a full-attention one) as a prefill records its
// states and inserts its prompt: the checkpoint series equal the cache's own stats at
// each step, pending while only the sequence holds them, cached once an entry does.
func TestCollectCheckpoints(t *testing.T) {
	model := kv.Model{Name: "tiny-next", Layers: 4, Groups: []kv.Group{
		{Kind: kv.Recurrent, Layers: []int{0, 1, 2}, StateBytes: 700},
		{Kind: kv.FullAttention, Layers: []int{3}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
	}}
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 64<<20))
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: gov.Authority("kv", accounting.HostKey), Name: "vmarena-metrics-test"})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pool.Close()) })
	cache, err := kv.New(pool, kv.Config{Model: model, MaxTokens: 4096})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, cache.Close()) })
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pc.Close()) })

	c, err := metrics.New(metrics.Options{
		Governor:     gov,
		Caches:       []metrics.Cache{metrics.CacheOf("next", cache, pc)},
		PrefixCaches: []metrics.PrefixCache{{Name: "next", Source: metrics.PrefixCacheOf(pc)}},
	})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	check := func(what string) kv.PrefixCacheStats {
		got := promtest.Gather(t, reg)
		st := pc.Stats()
		assert.Equal(t, float64(st.Checkpoints), got["vmarena_prefix_cache_checkpoints{cache=next}"], what)
		assert.Equal(t, float64(st.CheckpointBytes), got["vmarena_prefix_cache_checkpoint_bytes{cache=next}"], what)
		assert.Equal(t, float64(st.PendingCheckpointBytes), got["vmarena_prefix_cache_pending_checkpoint_bytes{cache=next}"], what)
		assert.Equal(t, float64(st.CachedBytes), got["vmarena_prefix_cache_cached_bytes{cache=next}"], what)
		assert.LessOrEqual(t, got["vmarena_prefix_cache_checkpoint_bytes{cache=next}"], got["vmarena_prefix_cache_cached_bytes{cache=next}"], what)
		return st
	}

	st := check("empty")
	assert.Zero(t, st.Checkpoints)
	prompt := make([]int32, 300)
	for i := range prompt {
		prompt[i] = int32(100 + i)
	}
	s, cached, err := pc.Lookup(prompt)
	require.NoError(t, err)
	require.Zero(t, cached)
	require.NoError(t, s.Append(len(prompt)))
	require.NoError(t, s.Checkpoint(128))
	require.NoError(t, s.Checkpoint(256))
	st = check("two checkpoints recorded, none inserted")
	assert.Zero(t, st.Checkpoints)
	assert.Positive(t, st.PendingCheckpointBytes)
	pending := st.PendingCheckpointBytes

	require.NoError(t, pc.Insert(s, prompt))
	st = check("inserted")
	assert.Equal(t, 2, st.Checkpoints)
	assert.Equal(t, pending, st.CheckpointBytes, "the entry holds what the sequence recorded")
	assert.Zero(t, st.PendingCheckpointBytes)

	require.True(t, s.Close().OK())
	st = check("the sequence closed")
	assert.Equal(t, 2, st.Checkpoints, "the entry keeps them")

	// The next turn starts on the latest checkpoint and records one of its own.
	next := append(append([]int32{}, prompt...), 1, 2, 3)
	s, cached, err = pc.Lookup(next)
	require.NoError(t, err)
	require.Equal(t, 256, cached)
	require.NoError(t, s.Append(len(next)-cached))
	require.NoError(t, s.Checkpoint(len(next)))
	st = check("the next turn recorded one")
	assert.Equal(t, 2, st.Checkpoints)
	assert.Positive(t, st.PendingCheckpointBytes)
	require.True(t, s.Close().OK())
	st = check("the next turn closed uninserted")
	assert.Zero(t, st.PendingCheckpointBytes)

	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
}
