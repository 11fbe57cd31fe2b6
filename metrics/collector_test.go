package metrics_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/metrics"
)

// statPool is a backing.Pool that reports fixed figures, so that the collector's
// mapping of each field can be checked exactly.
type statPool struct {
	s   backing.PoolStats
	dev accounting.DeviceKey
}

func (p *statPool) Prefill(int) error            { return nil }
func (p *statPool) Trim(int) (int64, error)      { return 0, nil }
func (p *statPool) PoolStats() backing.PoolStats { return p.s }
func (p *statPool) Device() accounting.DeviceKey { return p.dev }

// statCache is a CacheSource that reports fixed figures.
type statCache struct{ s kv.Stats }

func (c *statCache) Stats() kv.Stats { return c.s }

func TestCollectPoolsCachesPrefixCaches(t *testing.T) {
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.GPU(0), 64<<20))
	pool := &statPool{dev: accounting.GPU(0), s: backing.PoolStats{
		Granule: 2 << 20, Owned: 20 << 20, Idle: 4 << 20, Mapped: 24 << 20, Resident: 2 << 20,
		Created: 15, GivenBack: 5,
	}}
	cache := &statCache{s: kv.Stats{
		Sequences: 3, Prefixes: 1, Tokens: 1500, Used: 1500 << 10, Committed: 24 << 20,
		Shared: 8 << 20, Owned: 20 << 20, Mapped: 24 << 20, Waits: 7, Refusals: 5, Unreleased: 2 << 20, Ahead: 2 << 20,
	}}
	pc := metrics.PrefixCacheFunc(func() kv.PrefixCacheStats {
		return kv.PrefixCacheStats{Queries: 9000, Hits: 6000, Evictions: 4, EvictedBytes: 6 << 20, CachedBytes: 10 << 20, PinnedBytes: 2 << 20}
	})
	c, err := metrics.New(metrics.Options{
		Governor:     gov,
		Pools:        []metrics.Pool{{Name: "kv", Pool: pool}},
		Caches:       []metrics.Cache{{Name: "llama", Cache: cache, Device: accounting.GPU(0), Pool: pool}},
		PrefixCaches: []metrics.PrefixCache{{Name: "llama", Source: pc}},
	})
	require.NoError(t, err)

	// Usage: (owned 20 MiB - idle 4 MiB - 2 MiB ahead) / limit 64 MiB = 0.21875.
	const want = `
# HELP vmarena_kv_ahead_bytes Bytes that map-ahead holds outside every sequence: committed ahead into growing sequences' ranges and taken by no step yet, and granules that windows left behind for the worker to give back. Owned, and taken back by any growth that needs the budget.
# TYPE vmarena_kv_ahead_bytes gauge
vmarena_kv_ahead_bytes{cache="llama"} 2.097152e+06
# HELP vmarena_kv_cache_usage_perc Fraction of the KV budget held by live sequences and prefixes, 0 to 1 (1 means 100 percent).
# TYPE vmarena_kv_cache_usage_perc gauge
vmarena_kv_cache_usage_perc{cache="llama"} 0.21875
# HELP vmarena_kv_committed_bytes Bytes of granules committed in live sequences' ranges, shared mappings included.
# TYPE vmarena_kv_committed_bytes gauge
vmarena_kv_committed_bytes{cache="llama"} 2.5165824e+07
# HELP vmarena_kv_prefixes Live prefixes.
# TYPE vmarena_kv_prefixes gauge
vmarena_kv_prefixes{cache="llama"} 1
# HELP vmarena_kv_saved_by_sharing_bytes Bytes live sequences map from a prefix or a parent instead of holding their own.
# TYPE vmarena_kv_saved_by_sharing_bytes gauge
vmarena_kv_saved_by_sharing_bytes{cache="llama"} 8.388608e+06
# HELP vmarena_kv_sequences Live sequences.
# TYPE vmarena_kv_sequences gauge
vmarena_kv_sequences{cache="llama"} 3
# HELP vmarena_kv_tokens Tokens held by live sequences.
# TYPE vmarena_kv_tokens gauge
vmarena_kv_tokens{cache="llama"} 1500
# HELP vmarena_kv_used_bytes Bytes of the tokens live sequences hold.
# TYPE vmarena_kv_used_bytes gauge
vmarena_kv_used_bytes{cache="llama"} 1.536e+06
# HELP vmarena_kv_waits_total Appends that had to wait for memory.
# TYPE vmarena_kv_waits_total counter
vmarena_kv_waits_total{cache="llama"} 7
# HELP vmarena_kv_refusals_total Operations (growths, forks, starts on a prefix, lookups) refused because the memory could not be had (a scheduler's cue to preempt).
# TYPE vmarena_kv_refusals_total counter
vmarena_kv_refusals_total{cache="llama"} 5
# HELP vmarena_kv_unreleased_bytes Bytes failed releases left held: kept for the cache's Close to retry, or quarantined.
# TYPE vmarena_kv_unreleased_bytes gauge
vmarena_kv_unreleased_bytes{cache="llama"} 2.097152e+06
# HELP vmarena_pool_granules_created_total Granules the pool has taken on (charged to its ledger).
# TYPE vmarena_pool_granules_created_total counter
vmarena_pool_granules_created_total{device="device:0",pool="kv"} 15
# HELP vmarena_pool_granules_given_back_total Granules the pool has given back.
# TYPE vmarena_pool_granules_given_back_total counter
vmarena_pool_granules_given_back_total{device="device:0",pool="kv"} 5
# HELP vmarena_pool_idle_bytes Pooled bytes mapped nowhere.
# TYPE vmarena_pool_idle_bytes gauge
vmarena_pool_idle_bytes{device="device:0",pool="kv"} 4.194304e+06
# HELP vmarena_pool_mapped_bytes Bytes of the pool's mappings (a granule mapped twice counts twice).
# TYPE vmarena_pool_mapped_bytes gauge
vmarena_pool_mapped_bytes{device="device:0",pool="kv"} 2.5165824e+07
# HELP vmarena_pool_owned_bytes Physical bytes the pool holds, mapped or idle.
# TYPE vmarena_pool_owned_bytes gauge
vmarena_pool_owned_bytes{device="device:0",pool="kv"} 2.097152e+07
# HELP vmarena_pool_resident_bytes Idle bytes known to be populated (no fault on first touch).
# TYPE vmarena_pool_resident_bytes gauge
vmarena_pool_resident_bytes{device="device:0",pool="kv"} 2.097152e+06
# HELP vmarena_prefix_cache_cached_bytes Bytes the prefix cache holds, pinned or not.
# TYPE vmarena_prefix_cache_cached_bytes gauge
vmarena_prefix_cache_cached_bytes{cache="llama"} 1.048576e+07
# HELP vmarena_prefix_cache_evicted_bytes_total Physical bytes evictions from the prefix cache gave back.
# TYPE vmarena_prefix_cache_evicted_bytes_total counter
vmarena_prefix_cache_evicted_bytes_total{cache="llama"} 6.291456e+06
# HELP vmarena_prefix_cache_evictions_total Evictions from the prefix cache.
# TYPE vmarena_prefix_cache_evictions_total counter
vmarena_prefix_cache_evictions_total{cache="llama"} 4
# HELP vmarena_prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE vmarena_prefix_cache_hits_total counter
vmarena_prefix_cache_hits_total{cache="llama"} 6000
# HELP vmarena_prefix_cache_pinned_bytes Bytes the prefix cache holds pinned (never evicted).
# TYPE vmarena_prefix_cache_pinned_bytes gauge
vmarena_prefix_cache_pinned_bytes{cache="llama"} 2.097152e+06
# HELP vmarena_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vmarena_prefix_cache_queries_total counter
vmarena_prefix_cache_queries_total{cache="llama"} 9000
`
	names := []string{
		"vmarena_kv_ahead_bytes", "vmarena_kv_cache_usage_perc", "vmarena_kv_committed_bytes", "vmarena_kv_prefixes",
		"vmarena_kv_saved_by_sharing_bytes", "vmarena_kv_sequences", "vmarena_kv_tokens",
		"vmarena_kv_used_bytes", "vmarena_kv_waits_total", "vmarena_kv_refusals_total", "vmarena_kv_unreleased_bytes",
		"vmarena_pool_granules_created_total", "vmarena_pool_granules_given_back_total",
		"vmarena_pool_idle_bytes", "vmarena_pool_mapped_bytes", "vmarena_pool_owned_bytes",
		"vmarena_pool_resident_bytes",
		"vmarena_prefix_cache_cached_bytes", "vmarena_prefix_cache_evictions_total", "vmarena_prefix_cache_evicted_bytes_total",
		"vmarena_prefix_cache_hits_total", "vmarena_prefix_cache_pinned_bytes",
		"vmarena_prefix_cache_queries_total",
	}
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want), names...))

	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems, "client_golang's metric lint")
}

// TestCollectPrefixCacheTiers: a prefix cache's counts per tier are series labelled
// with the cache and the tier, one set a tier, and none without tiers.
func TestCollectPrefixCacheTiers(t *testing.T) {
	stats := kv.PrefixCacheStats{Tiers: []kv.TierStats{
		{Name: "host", Hits: 640, Misses: 3, LoadBytes: 40 << 20, StoreBytes: 64 << 20, Drops: 1},
		{Name: "redis", Hits: 128, Misses: 7, LoadBytes: 8 << 20, StoreBytes: 64 << 20, Drops: 5, Invalid: 2, Unfit: 3},
	}}
	c, err := metrics.New(metrics.Options{PrefixCaches: []metrics.PrefixCache{
		{Name: "llama", Source: metrics.PrefixCacheFunc(func() kv.PrefixCacheStats { return stats })},
		{Name: "none", Source: metrics.PrefixCacheFunc(func() kv.PrefixCacheStats { return kv.PrefixCacheStats{} })},
	}})
	require.NoError(t, err)
	const want = `
# HELP vmarena_prefix_cache_tier_hits_total Prompt tokens the prefix cache loaded from a tier below the device (they count in prefix_cache_hits_total too).
# TYPE vmarena_prefix_cache_tier_hits_total counter
vmarena_prefix_cache_tier_hits_total{cache="llama",tier="host"} 640
vmarena_prefix_cache_tier_hits_total{cache="llama",tier="redis"} 128
# HELP vmarena_prefix_cache_tier_misses_total Lookups that asked a tier and loaded nothing from it.
# TYPE vmarena_prefix_cache_tier_misses_total counter
vmarena_prefix_cache_tier_misses_total{cache="llama",tier="host"} 3
vmarena_prefix_cache_tier_misses_total{cache="llama",tier="redis"} 7
# HELP vmarena_prefix_cache_tier_load_bytes_total Bytes of the values the prefix cache loaded from a tier, each checked.
# TYPE vmarena_prefix_cache_tier_load_bytes_total counter
vmarena_prefix_cache_tier_load_bytes_total{cache="llama",tier="host"} 4.194304e+07
vmarena_prefix_cache_tier_load_bytes_total{cache="llama",tier="redis"} 8.388608e+06
# HELP vmarena_prefix_cache_tier_store_bytes_total Bytes of the values the prefix cache wrote down into a tier.
# TYPE vmarena_prefix_cache_tier_store_bytes_total counter
vmarena_prefix_cache_tier_store_bytes_total{cache="llama",tier="host"} 6.7108864e+07
vmarena_prefix_cache_tier_store_bytes_total{cache="llama",tier="redis"} 6.7108864e+07
# HELP vmarena_prefix_cache_tier_dropped_total Blocks not stored into a tier, and loads that failed other than by a value's check: misses, never errors.
# TYPE vmarena_prefix_cache_tier_dropped_total counter
vmarena_prefix_cache_tier_dropped_total{cache="llama",tier="host"} 1
vmarena_prefix_cache_tier_dropped_total{cache="llama",tier="redis"} 5
# HELP vmarena_prefix_cache_tier_invalid_total Values from a tier that failed their check (damaged, another namespace, other tokens): misses, never mapped.
# TYPE vmarena_prefix_cache_tier_invalid_total counter
vmarena_prefix_cache_tier_invalid_total{cache="llama",tier="host"} 0
vmarena_prefix_cache_tier_invalid_total{cache="llama",tier="redis"} 2
# HELP vmarena_prefix_cache_tier_unfit_total Blocks a tier held for a lookup that the device's budget could not take even after eviction: the lookup loaded those before them.
# TYPE vmarena_prefix_cache_tier_unfit_total counter
vmarena_prefix_cache_tier_unfit_total{cache="llama",tier="host"} 0
vmarena_prefix_cache_tier_unfit_total{cache="llama",tier="redis"} 3
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"vmarena_prefix_cache_tier_hits_total", "vmarena_prefix_cache_tier_misses_total",
		"vmarena_prefix_cache_tier_load_bytes_total", "vmarena_prefix_cache_tier_store_bytes_total",
		"vmarena_prefix_cache_tier_dropped_total", "vmarena_prefix_cache_tier_invalid_total",
		"vmarena_prefix_cache_tier_unfit_total"))
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems, "client_golang's metric lint")
}

func TestCollectGovernor(t *testing.T) {
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 100))
	a := gov.Authority("kv", accounting.HostKey)
	a2 := gov.Authority("kv", accounting.HostKey) // names need not be unique: summed
	b := gov.Authority("other", accounting.HostKey)
	gpu := gov.Authority("pool", accounting.GPU(1)) // unlimited: no limit series
	require.NoError(t, a.TryAcquire(30))
	require.NoError(t, a2.TryAcquire(20))
	require.NoError(t, b.TryAcquire(10))
	require.NoError(t, gpu.TryAcquire(1<<30))
	a.Map(30)
	a2.Map(40)
	b.Release(10)
	assert.Error(t, b.TryAcquire(51))                     // refusal 1
	assert.Error(t, b.Acquire(context.Background(), 101)) // refusal 2: over the limit
	b.Quarantine(7, errors.New("munmap: EINVAL"))         // 1 quarantine of 7 bytes
	done := make(chan error)
	go func() { done <- b.Acquire(context.Background(), 60) }() // waits for 10 bytes
	require.Eventually(t, func() bool { return gov.Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	a2.Release(20)
	require.NoError(t, <-done)

	c, err := metrics.New(metrics.Options{Governor: gov})
	require.NoError(t, err)
	const want = `
# HELP vmarena_governor_limit_bytes Byte budget of the device; absent while it has none.
# TYPE vmarena_governor_limit_bytes gauge
vmarena_governor_limit_bytes{device="host:0"} 100
# HELP vmarena_governor_mapped_bytes Bytes a ledger has mapped (attribution only: a granule mapped twice counts twice).
# TYPE vmarena_governor_mapped_bytes gauge
vmarena_governor_mapped_bytes{authority="kv",device="host:0"} 70
vmarena_governor_mapped_bytes{authority="other",device="host:0"} 0
vmarena_governor_mapped_bytes{authority="pool",device="device:1"} 0
# HELP vmarena_governor_owned_bytes Physical bytes a ledger holds (they consume budget).
# TYPE vmarena_governor_owned_bytes gauge
vmarena_governor_owned_bytes{authority="kv",device="host:0"} 30
vmarena_governor_owned_bytes{authority="other",device="host:0"} 60
vmarena_governor_owned_bytes{authority="pool",device="device:1"} 1.073741824e+09
# HELP vmarena_governor_peak_bytes Highest used bytes seen on the device since the last peak reset.
# TYPE vmarena_governor_peak_bytes gauge
vmarena_governor_peak_bytes{device="device:1"} 1.073741824e+09
vmarena_governor_peak_bytes{device="host:0"} 90
# HELP vmarena_governor_quarantined_bytes_total Bytes left behind by releases that failed midway.
# TYPE vmarena_governor_quarantined_bytes_total counter
vmarena_governor_quarantined_bytes_total{device="device:1"} 0
vmarena_governor_quarantined_bytes_total{device="host:0"} 7
# HELP vmarena_governor_quarantines_total Releases that failed midway and left memory behind.
# TYPE vmarena_governor_quarantines_total counter
vmarena_governor_quarantines_total{device="device:1"} 0
vmarena_governor_quarantines_total{device="host:0"} 1
# HELP vmarena_governor_refusals_total Requests refused because the budget could not cover them: by the governor, and by takers that check the budget first (a KV cache's growths).
# TYPE vmarena_governor_refusals_total counter
vmarena_governor_refusals_total{device="device:1"} 0
vmarena_governor_refusals_total{device="host:0"} 2
# HELP vmarena_governor_used_bytes Bytes owned by all ledgers on the device.
# TYPE vmarena_governor_used_bytes gauge
vmarena_governor_used_bytes{device="device:1"} 1.073741824e+09
vmarena_governor_used_bytes{device="host:0"} 90
# HELP vmarena_governor_waiters Requests queued for budget on the device now.
# TYPE vmarena_governor_waiters gauge
vmarena_governor_waiters{device="device:1"} 0
vmarena_governor_waiters{device="host:0"} 0
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"vmarena_governor_limit_bytes", "vmarena_governor_mapped_bytes", "vmarena_governor_owned_bytes",
		"vmarena_governor_peak_bytes", "vmarena_governor_quarantined_bytes_total",
		"vmarena_governor_quarantines_total", "vmarena_governor_refusals_total",
		"vmarena_governor_used_bytes", "vmarena_governor_waiters"))

	// The wait histogram holds exactly the governor's counters.
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	k := gov.Stats(accounting.HostKey).Counters
	require.Equal(t, int64(1), k.Waits)
	var found bool
	for _, mf := range mfs {
		if mf.GetName() != "vmarena_governor_wait_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() != "host:0" {
				assert.Zero(t, m.GetHistogram().GetSampleCount(), "no wait on the GPU")
				continue
			}
			found = true
			h := m.GetHistogram()
			assert.Equal(t, uint64(k.Waits), h.GetSampleCount())
			assert.InDelta(t, k.WaitTime.Seconds(), h.GetSampleSum(), 1e-9)
			require.Len(t, h.GetBucket(), accounting.NumWaitBuckets)
			for i, bk := range h.GetBucket() {
				assert.Equal(t, accounting.WaitBuckets()[i].Seconds(), bk.GetUpperBound())
				assert.Equal(t, uint64(k.WaitsWithin[i]), bk.GetCumulativeCount())
			}
		}
	}
	assert.True(t, found, "a wait histogram for the host")
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
	a.Unmap(30)
	a2.Unmap(40)
	a.Release(30)
	b.Release(60)
	gpu.Release(1 << 30)
}

func TestNamespaceAndAbsentUsage(t *testing.T) {
	// A cache on an unlimited device has no usage; the rest is there, renamed.
	gov := accounting.NewGovernor()
	cache := &statCache{s: kv.Stats{Sequences: 2, Owned: 1 << 20}}
	c, err := metrics.New(metrics.Options{Namespace: "srv", Governor: gov,
		Caches: []metrics.Cache{{Name: "c", Cache: cache, Device: accounting.HostKey}}})
	require.NoError(t, err)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP srv_kv_sequences Live sequences.
# TYPE srv_kv_sequences gauge
srv_kv_sequences{cache="c"} 2
`), "srv_kv_sequences", "srv_kv_cache_usage_perc", "vmarena_kv_sequences"))

	// Over budget (a limit lowered under use) reads as 1, not more.
	require.NoError(t, gov.SetLimit(accounting.HostKey, 1<<19))
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP srv_kv_cache_usage_perc Fraction of the KV budget held by live sequences and prefixes, 0 to 1 (1 means 100 percent).
# TYPE srv_kv_cache_usage_perc gauge
srv_kv_cache_usage_perc{cache="c"} 1
`), "srv_kv_cache_usage_perc"))

	// What a prefix cache could evict now is not in use: 1 MiB owned, 256 KiB
	// cached of which 64 KiB pinned, under a 2 MiB limit: (1024-192)/2048 KiB.
	require.NoError(t, gov.SetLimit(accounting.HostKey, 2<<20))
	pc := metrics.PrefixCacheFunc(func() kv.PrefixCacheStats {
		return kv.PrefixCacheStats{CachedBytes: 256 << 10, PinnedBytes: 64 << 10}
	})
	c, err = metrics.New(metrics.Options{Namespace: "srv", Governor: gov,
		Caches: []metrics.Cache{{Name: "c", Cache: cache, Device: accounting.HostKey, PrefixCache: pc}}})
	require.NoError(t, err)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP srv_kv_cache_usage_perc Fraction of the KV budget held by live sequences and prefixes, 0 to 1 (1 means 100 percent).
# TYPE srv_kv_cache_usage_perc gauge
srv_kv_cache_usage_perc{cache="c"} 0.40625
`), "srv_kv_cache_usage_perc"))

	// Without a governor there is no budget to divide by.
	c, err = metrics.New(metrics.Options{Caches: []metrics.Cache{{Name: "c", Cache: cache}}})
	require.NoError(t, err)
	n, err := testutil.GatherAndCount(registry(t, c), "vmarena_kv_cache_usage_perc", "vmarena_kv_sequences")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}

func registry(t *testing.T, c prometheus.Collector) *prometheus.Registry {
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	return reg
}

func TestNewBadOptions(t *testing.T) {
	pool := &statPool{}
	cache := &statCache{}
	pc := metrics.PrefixCacheFunc(func() kv.PrefixCacheStats { return kv.PrefixCacheStats{} })
	for _, tt := range []struct {
		name string
		opts metrics.Options
		msg  string
	}{
		{"namespace with a dash", metrics.Options{Namespace: "vm-arena"}, `namespace "vm-arena"`},
		{"namespace starting with a digit", metrics.Options{Namespace: "1x"}, `namespace "1x"`},
		{"pool without a name", metrics.Options{Pools: []metrics.Pool{{Pool: pool}}}, "pool 0 has no name"},
		{"nil pool", metrics.Options{Pools: []metrics.Pool{{Name: "p"}}}, `pool "p" has no source`},
		{"two pools of one name", metrics.Options{Pools: []metrics.Pool{{Name: "p", Pool: pool}, {Name: "p", Pool: pool}}}, `two pools named "p"`},
		{"nil cache", metrics.Options{Caches: []metrics.Cache{{Name: "c"}}}, `cache "c" has no source`},
		{"two caches of one name", metrics.Options{Caches: []metrics.Cache{{Name: "c", Cache: cache}, {Name: "c", Cache: cache}}}, `two caches named "c"`},
		{"nil prefix cache", metrics.Options{PrefixCaches: []metrics.PrefixCache{{Name: "c"}}}, `prefix cache "c" has no source`},
		{"prefix cache without a name", metrics.Options{PrefixCaches: []metrics.PrefixCache{{Source: pc}}}, "prefix cache 0 has no name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := metrics.New(tt.opts)
			assert.Nil(t, c)
			assert.ErrorIs(t, err, metrics.ErrOptions)
			assert.ErrorContains(t, err, tt.msg)
		})
	}
	// An empty collector is valid and reports nothing.
	c, err := metrics.New(metrics.Options{})
	require.NoError(t, err)
	assert.Zero(t, testutil.CollectAndCount(c))
}

// A cache without a prefix cache passes PrefixCacheOf(nil) as the README shows: it
// must collect as if no prefix cache were named, not panic in every Collect.
func TestPrefixCacheOfNil(t *testing.T) {
	var pc *kv.PrefixCache
	assert.Nil(t, metrics.PrefixCacheOf(pc))
	assert.Nil(t, metrics.PrefixCacheOf(nil))
	c, err := metrics.New(metrics.Options{Caches: []metrics.Cache{{Name: "c", Cache: &statCache{}, PrefixCache: metrics.PrefixCacheOf(pc)}}})
	require.NoError(t, err)
	assert.Positive(t, testutil.CollectAndCount(c))
	_, err = metrics.New(metrics.Options{PrefixCaches: []metrics.PrefixCache{{Name: "c", Source: metrics.PrefixCacheOf(pc)}}})
	assert.ErrorIs(t, err, metrics.ErrOptions)
}

// TestCacheOf: a cache's wiring comes from the cache itself; a nil cache gives a
// source New refuses.
func TestCacheOf(t *testing.T) {
	gov := accounting.NewGovernor()
	mem, err := host.NewPrivate(host.PrivateOptions{})
	require.NoError(t, err)
	cache, err := kv.New(mem, kv.Config{Model: kv.Tiny(), MaxTokens: 64, Authority: gov.Authority("kv", accounting.HostKey)})
	require.NoError(t, err)
	defer func() { assert.NoError(t, cache.Close()) }()
	got := metrics.CacheOf("tiny", cache, nil)
	assert.Equal(t, metrics.Cache{Name: "tiny", Cache: cache, Device: accounting.HostKey}, got, "no pool, no prefix cache")

	_, err = metrics.New(metrics.Options{Caches: []metrics.Cache{metrics.CacheOf("none", nil, nil)}})
	assert.ErrorIs(t, err, metrics.ErrOptions)
}
