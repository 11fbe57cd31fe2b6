package metrics_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
	"github.com/vmarena/vmarena/metrics"
)

func TestCollectTiers(t *testing.T) {
	src := metrics.TierFunc(func() metrics.TierStats {
		return metrics.TierStats{Queries: 10, QueryHits: 4, Hits: 3, Misses: 2, LoadedBytes: 3000,
			Stores: 5, StoredBytes: 5000, DroppedStores: 6, Errors: 7}
	})
	c, err := metrics.NewTierCollector("", metrics.Tier{Name: "redis", Source: src, BlockTokens: 16})
	require.NoError(t, err)
	want := `
# HELP vmarena_external_prefix_cache_hits_total Prompt tokens looked up in the KV tier and found there.
# TYPE vmarena_external_prefix_cache_hits_total counter
vmarena_external_prefix_cache_hits_total{tier="redis"} 64
# HELP vmarena_external_prefix_cache_queries_total Prompt tokens looked up in the KV tier.
# TYPE vmarena_external_prefix_cache_queries_total counter
vmarena_external_prefix_cache_queries_total{tier="redis"} 160
# HELP vmarena_kv_offload_load_bytes_total Bytes loaded from the KV tier.
# TYPE vmarena_kv_offload_load_bytes_total counter
vmarena_kv_offload_load_bytes_total{tier="redis"} 3000
# HELP vmarena_kv_offload_store_bytes_total Bytes stored into the KV tier.
# TYPE vmarena_kv_offload_store_bytes_total counter
vmarena_kv_offload_store_bytes_total{tier="redis"} 5000
# HELP vmarena_kv_tier_errors_total Calls of the KV tier that failed other than by a miss (timeouts, a server down).
# TYPE vmarena_kv_tier_errors_total counter
vmarena_kv_tier_errors_total{tier="redis"} 7
# HELP vmarena_kv_tier_loads_total Block loads from the KV tier, by outcome: hit, miss.
# TYPE vmarena_kv_tier_loads_total counter
vmarena_kv_tier_loads_total{outcome="hit",tier="redis"} 3
vmarena_kv_tier_loads_total{outcome="miss",tier="redis"} 2
# HELP vmarena_kv_tier_stores_total Block stores into the KV tier, by outcome: kept, dropped.
# TYPE vmarena_kv_tier_stores_total counter
vmarena_kv_tier_stores_total{outcome="dropped",tier="redis"} 6
vmarena_kv_tier_stores_total{outcome="kept",tier="redis"} 5
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want)))
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
	require.NoError(t, prometheus.NewRegistry().Register(c), "the collector registers")
}

// TestCollectTierBytes: a tier with a budget of its own (the host tier) exports the
// bytes it holds and its budget; one that can not tell (Redis) exports neither.
func TestCollectTierBytes(t *testing.T) {
	host := metrics.TierFunc(func() metrics.TierStats { return metrics.TierStats{HeldBytes: 3 << 20, BudgetBytes: 64 << 20} })
	redis := metrics.TierFunc(func() metrics.TierStats { return metrics.TierStats{Stores: 1} })
	c, err := metrics.NewTierCollector("", metrics.Tier{Name: "host", Source: host, BlockTokens: 16},
		metrics.Tier{Name: "redis", Source: redis, BlockTokens: 16})
	require.NoError(t, err)
	want := `
# HELP vmarena_kv_tier_budget_bytes The most bytes of memory the KV tier may hold.
# TYPE vmarena_kv_tier_budget_bytes gauge
vmarena_kv_tier_budget_bytes{tier="host"} 6.7108864e+07
# HELP vmarena_kv_tier_bytes Bytes of memory the KV tier holds now; only for a tier with a budget of its own.
# TYPE vmarena_kv_tier_bytes gauge
vmarena_kv_tier_bytes{tier="host"} 3.145728e+06
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want), "vmarena_kv_tier_bytes", "vmarena_kv_tier_budget_bytes"))
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
}

func TestTierCollectorBadOptions(t *testing.T) {
	src := metrics.TierFunc(func() metrics.TierStats { return metrics.TierStats{} })
	for _, tt := range []struct {
		name  string
		ns    string
		tiers []metrics.Tier
	}{
		{"bad namespace", "1x", nil},
		{"no source", "", []metrics.Tier{{Name: "a", BlockTokens: 1}}},
		{"no name", "", []metrics.Tier{{Source: src, BlockTokens: 1}}},
		{"repeated name", "", []metrics.Tier{{Name: "a", Source: src, BlockTokens: 1}, {Name: "a", Source: src, BlockTokens: 1}}},
		{"no block tokens", "", []metrics.Tier{{Name: "a", Source: src}}},
		{"negative block tokens", "", []metrics.Tier{{Name: "a", Source: src, BlockTokens: -16}}},
	} {
		_, err := metrics.NewTierCollector(tt.ns, tt.tiers...)
		assert.ErrorIs(t, err, metrics.ErrOptions, tt.name)
	}
}

// ExampleNewTierCollector collects a Redis tier, adapted by a TierFunc; here the
// server is not running, so the tier's one load fails and its store is dropped.
func ExampleNewTierCollector() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, MaxRetries: -1})
	defer client.Close()
	tier, _ := redistier.New(client, redistier.Options{Timeout: 200 * time.Millisecond, Backoff: time.Minute})
	ctx := context.Background()
	_ = tier.Load(ctx, tierval.Key{Hash: 1}, func([]byte) error { return nil })
	_ = tier.Store(ctx, tierval.Key{Hash: 1}, 8, func([]byte) error { return nil })

	c, _ := metrics.NewTierCollector("", metrics.Tier{Name: tier.Name(), BlockTokens: 16, Source: metrics.TierFunc(func() metrics.TierStats {
		s := tier.Stats()
		return metrics.TierStats{Queries: s.Queries, QueryHits: s.QueryHits, Hits: s.Hits, Misses: s.Misses,
			LoadedBytes: s.BytesLoaded, Stores: s.Stores, StoredBytes: s.BytesStored, DroppedStores: s.DroppedStores, Errors: s.Errors}
	})})
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	families, _ := reg.Gather()
	for _, f := range families {
		for _, m := range f.GetMetric() {
			fmt.Println(f.GetName(), labels(m.GetLabel()), m.GetCounter().GetValue())
		}
	}
	// Output:
	// vmarena_external_prefix_cache_hits_total tier=redis 0
	// vmarena_external_prefix_cache_queries_total tier=redis 0
	// vmarena_kv_offload_load_bytes_total tier=redis 0
	// vmarena_kv_offload_store_bytes_total tier=redis 0
	// vmarena_kv_tier_errors_total tier=redis 2
	// vmarena_kv_tier_loads_total outcome=hit,tier=redis 0
	// vmarena_kv_tier_loads_total outcome=miss,tier=redis 0
	// vmarena_kv_tier_stores_total outcome=dropped,tier=redis 1
	// vmarena_kv_tier_stores_total outcome=kept,tier=redis 0
}

// labels writes a metric's labels as name=value, comma-separated.
func labels(ls []*dto.LabelPair) string {
	parts := make([]string, len(ls))
	for i, l := range ls {
		parts[i] = l.GetName() + "=" + l.GetValue()
	}
	return strings.Join(parts, ",")
}
