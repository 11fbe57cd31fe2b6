package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil/promtest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/metrics"
)

// TestCollectRealCache reads a real cache on a memfd pool: three sequences, two of
// them started on a shared prefix.
func TestCollectRealCache(t *testing.T) {
	const gran = 64 << 10
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 64<<20))
	auth := gov.Authority("kv", accounting.HostKey)
	pool, err := host.NewShared(host.SharedOptions{Granularity: gran, Authority: auth, Name: "vmarena-metrics-test"})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pool.Close()) })
	cache, err := kv.New(pool, kv.Config{Model: kv.Tiny(), MaxTokens: 4096})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, cache.Close()) })
	bpt := kv.Tiny().BytesPerToken() // 256: a 64 KiB granule holds 256 tokens

	origin, err := cache.NewSequence()
	require.NoError(t, err)
	require.NoError(t, origin.Append(600)) // 3 granules
	p, err := origin.Freeze(512)           // 2 full granules shared
	require.NoError(t, err)
	a, err := cache.NewSequenceFrom(p)
	require.NoError(t, err)
	b, err := cache.NewSequenceFrom(p)
	require.NoError(t, err)
	require.NoError(t, a.Append(10))
	p.Release()
	defer func() {
		for _, s := range []*kv.Sequence{origin, a, b} {
			require.True(t, s.Close().OK())
		}
	}()

	c, err := metrics.New(metrics.Options{
		Governor: gov,
		Pools:    []metrics.Pool{{Name: "kv", Pool: pool}},
		Caches:   []metrics.Cache{{Name: "tiny", Cache: cache, Device: accounting.HostKey, Pool: pool}},
	})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	got := promtest.Gather(t, reg)

	tokens := 600 + 522 + 512
	assert.Equal(t, float64(3), got["vmarena_kv_sequences{cache=tiny}"])
	assert.Equal(t, float64(1), got["vmarena_kv_prefixes{cache=tiny}"], "a and b still hold the prefix")
	assert.Equal(t, float64(tokens), got["vmarena_kv_tokens{cache=tiny}"])
	assert.Equal(t, float64(tokens*bpt), got["vmarena_kv_used_bytes{cache=tiny}"])
	// a and b each map the prefix's 2 full granules; the origin's own are its own.
	assert.Equal(t, float64(2*2*gran), got["vmarena_kv_saved_by_sharing_bytes{cache=tiny}"])
	// Committed: origin 3 granules, a 2 shared + 1 own (522 tokens), b 2 shared.
	assert.Equal(t, float64(3*gran+3*gran+2*gran), got["vmarena_kv_committed_bytes{cache=tiny}"])

	ps := pool.PoolStats()
	as := auth.Stats()
	assert.Equal(t, float64(ps.Owned), got["vmarena_pool_owned_bytes{device=host:0,pool=kv}"])
	assert.Equal(t, float64(ps.Idle), got["vmarena_pool_idle_bytes{device=host:0,pool=kv}"])
	assert.Equal(t, float64(ps.Mapped), got["vmarena_pool_mapped_bytes{device=host:0,pool=kv}"])
	assert.Equal(t, float64(ps.Created), got["vmarena_pool_granules_created_total{device=host:0,pool=kv}"])
	assert.Equal(t, float64(as.Owned), got["vmarena_governor_owned_bytes{authority=kv,device=host:0}"])
	assert.Equal(t, float64(as.Mapped), got["vmarena_governor_mapped_bytes{authority=kv,device=host:0}"])
	assert.Equal(t, float64(64<<20), got["vmarena_governor_limit_bytes{device=host:0}"])
	assert.InDelta(t, float64(as.Owned-ps.Idle)/float64(64<<20), got["vmarena_kv_cache_usage_perc{cache=tiny}"], 1e-12)
	assert.Greater(t, got["vmarena_kv_cache_usage_perc{cache=tiny}"], 0.0)

	// A growth the cache refuses before committing counts in both refusal counters.
	require.NoError(t, gov.SetLimit(accounting.HostKey, gov.Stats(accounting.HostKey).Used))
	big, err := cache.NewSequence()
	require.NoError(t, err)
	require.ErrorIs(t, big.Append(4096), accounting.ErrBudgetExceeded)
	require.True(t, big.Close().OK())
	got = promtest.Gather(t, reg)
	assert.Equal(t, float64(1), got["vmarena_kv_refusals_total{cache=tiny}"])
	assert.Equal(t, float64(1), got["vmarena_governor_refusals_total{device=host:0}"], "the governor counts the cache's refusal")

	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
}

// TestCollectRealPrefixCache reads a kv prefix cache: vLLM's token counters, and a
// usage that counts what the prefix cache could evict as free.
func TestCollectRealPrefixCache(t *testing.T) {
	const limit = 64 << 20
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, limit))
	auth := gov.Authority("kv", accounting.HostKey)
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: auth, Name: "vmarena-metrics-test"})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pool.Close()) })
	cache, err := kv.New(pool, kv.Config{Model: kv.Tiny(), MaxTokens: 4096})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, cache.Close()) })
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pc.Close()) })

	src := metrics.PrefixCacheOf(pc)
	wiring := metrics.CacheOf("tiny", cache, pc)
	assert.Equal(t, accounting.HostKey, wiring.Device)
	assert.Equal(t, backing.Pool(pool), wiring.Pool, "the cache's pool")
	require.NotNil(t, wiring.PrefixCache)
	c, err := metrics.New(metrics.Options{
		Governor:     gov,
		Caches:       []metrics.Cache{wiring},
		PrefixCaches: []metrics.PrefixCache{{Name: "tiny", Source: src}},
	})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))

	system := make([]int32, 1000)
	for i := range system {
		system[i] = int32(1000 + i)
	}
	var live []*kv.Sequence
	for _, question := range [][]int32{{7, 8, 9}, {4, 5}} {
		prompt := append(append([]int32{}, system...), question...)
		s, cached, err := pc.Lookup(prompt)
		require.NoError(t, err)
		require.NoError(t, s.Append(len(prompt)-cached))
		require.NoError(t, pc.Insert(s, prompt))
		live = append(live, s)
	}
	check := func(what string) map[string]float64 {
		got := promtest.Gather(t, reg)
		st := pc.Stats()
		assert.Equal(t, float64(st.Queries), got["vmarena_prefix_cache_queries_total{cache=tiny}"], what)
		assert.Equal(t, float64(st.Hits), got["vmarena_prefix_cache_hits_total{cache=tiny}"], what)
		assert.Equal(t, float64(st.CachedBytes), got["vmarena_prefix_cache_cached_bytes{cache=tiny}"], what)
		assert.Equal(t, float64(st.PinnedBytes), got["vmarena_prefix_cache_pinned_bytes{cache=tiny}"], what)
		assert.Equal(t, float64(st.Evictions), got["vmarena_prefix_cache_evictions_total{cache=tiny}"], what)
		ks, ps := cache.Stats(), pool.PoolStats()
		want := float64(ks.Owned-ps.Idle-(st.CachedBytes-st.PinnedBytes)) / limit
		assert.InDelta(t, want, got["vmarena_kv_cache_usage_perc{cache=tiny}"], 1e-12, what)
		return got
	}
	got := check("two live sequences")
	assert.Equal(t, float64(2005), got["vmarena_prefix_cache_queries_total{cache=tiny}"])
	assert.Equal(t, float64(1000), got["vmarena_prefix_cache_hits_total{cache=tiny}"])
	assert.Positive(t, got["vmarena_kv_cache_usage_perc{cache=tiny}"])
	for _, s := range live {
		require.True(t, s.Close().OK())
	}
	got = check("no live sequence")
	assert.Positive(t, got["vmarena_prefix_cache_cached_bytes{cache=tiny}"])
	assert.Zero(t, got["vmarena_kv_cache_usage_perc{cache=tiny}"], "all the cache holds could be evicted: none of it is in use")

	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
}
