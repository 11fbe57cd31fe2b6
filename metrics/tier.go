package metrics

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// TierStats is a snapshot of a KV tier's counters, all since the tier was made
// (package kvtier/redistier's Stats has each of them). Lookups are counted in blocks.
type TierStats struct {
	Queries       int64 // blocks asked of Contains
	QueryHits     int64 // of which found, in the runs Contains returned
	Hits          int64 // loads that found their block
	Misses        int64 // loads of a block the tier does not hold
	LoadedBytes   int64 // value bytes loads read
	Stores        int64 // stores the tier kept
	StoredBytes   int64 // value bytes of those stores
	DroppedStores int64 // stores the tier did not keep (down, timed out, refused)
	Errors        int64 // calls that failed for a reason other than a miss
	// HeldBytes is the memory the tier holds now and BudgetBytes the most it may
	// hold (for kvtier/hosttier, set them from its Stats.Held and Stats.Budget). A
	// tier that can not tell (a Redis server's memory is the server's) leaves
	// BudgetBytes 0, and neither is then exported.
	HeldBytes, BudgetBytes int64
}

// TierSource is what a KV tier must provide to be collected. metrics imports no
// client library: adapt a tier with TierFunc, as the example of NewTierCollector does.
type TierSource interface {
	TierStats() TierStats
}

// TierFunc adapts a function to a TierSource.
type TierFunc func() TierStats

// TierStats returns f().
func (f TierFunc) TierStats() TierStats { return f() }

// Tier names a KV tier to collect.
type Tier struct {
	Name   string // the tier label; unique among a TierCollector's tiers
	Source TierSource
	// BlockTokens is the tokens of one block of the cache that uses the tier, so that
	// lookups are reported in tokens, as vLLM's external prefix cache counts them.
	// It must be positive.
	BlockTokens int
}

// TierCollector is a prometheus.Collector over KV tiers (host memory, Redis), apart
// from Collector so that a server adds tiers without changing how it builds that one.
// With the default namespace it exports, labelled tier (vLLM's names where the
// meaning is the same):
//
//	vmarena_external_prefix_cache_queries_total   tokens looked up in the tier
//	vmarena_external_prefix_cache_hits_total      of which found there
//	vmarena_kv_offload_load_bytes_total           bytes loaded from the tier
//	vmarena_kv_offload_store_bytes_total          bytes stored into the tier
//	vmarena_kv_tier_loads_total{outcome}          loads: hit, miss
//	vmarena_kv_tier_stores_total{outcome}         stores: kept, dropped
//	vmarena_kv_tier_errors_total                  calls failed other than by a miss
//	vmarena_kv_tier_bytes                         memory the tier holds now (with a budget)
//	vmarena_kv_tier_budget_bytes                  the most it may hold (when it has one)
//
// It is safe for concurrent use; each scrape takes each tier's snapshot once.
type TierCollector struct {
	tiers                                        []Tier
	queries, hits, loaded, stored, loads, stores *prometheus.Desc
	errors, held, budget                         *prometheus.Desc
}

var _ prometheus.Collector = (*TierCollector)(nil)

// NewTierCollector returns a collector of tiers under namespace ("" means
// DefaultNamespace). It returns an error matching ErrOptions for a bad namespace, a
// tier with no source, no name, a repeated name or a BlockTokens below 1.
func NewTierCollector(namespace string, tiers ...Tier) (*TierCollector, error) {
	if namespace == "" {
		namespace = DefaultNamespace
	}
	if !nameRe.MatchString(namespace) {
		return nil, fmt.Errorf("%w: namespace %q is not a metric name prefix", ErrOptions, namespace)
	}
	if err := checkSources("tier", tiers, func(t Tier) (string, bool) { return t.Name, t.Source != nil }); err != nil {
		return nil, err
	}
	for _, t := range tiers {
		if t.BlockTokens < 1 {
			return nil, fmt.Errorf("%w: tier %q has BlockTokens %d", ErrOptions, t.Name, t.BlockTokens)
		}
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, append([]string{"tier"}, labels...), nil)
	}
	return &TierCollector{
		tiers:   append([]Tier(nil), tiers...),
		queries: d("external_prefix_cache_queries_total", "Prompt tokens looked up in the KV tier."),
		hits:    d("external_prefix_cache_hits_total", "Prompt tokens looked up in the KV tier and found there."),
		loaded:  d("kv_offload_load_bytes_total", "Bytes loaded from the KV tier."),
		stored:  d("kv_offload_store_bytes_total", "Bytes stored into the KV tier."),
		loads:   d("kv_tier_loads_total", "Block loads from the KV tier, by outcome: hit, miss.", "outcome"),
		stores:  d("kv_tier_stores_total", "Block stores into the KV tier, by outcome: kept, dropped.", "outcome"),
		errors:  d("kv_tier_errors_total", "Calls of the KV tier that failed other than by a miss (timeouts, a server down)."),
		held:    d("kv_tier_bytes", "Bytes of memory the KV tier holds now; only for a tier with a budget of its own."),
		budget:  d("kv_tier_budget_bytes", "The most bytes of memory the KV tier may hold."),
	}, nil
}

// Describe sends the descriptions of every metric.
func (c *TierCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.queries, c.hits, c.loaded, c.stored, c.loads, c.stores, c.errors, c.held, c.budget} {
		ch <- d
	}
}

// Collect sends one snapshot of every tier.
func (c *TierCollector) Collect(ch chan<- prometheus.Metric) {
	for _, t := range c.tiers {
		s := t.Source.TierStats()
		bt := int64(t.BlockTokens)
		counter(ch, c.queries, s.Queries*bt, t.Name)
		counter(ch, c.hits, s.QueryHits*bt, t.Name)
		counter(ch, c.loaded, s.LoadedBytes, t.Name)
		counter(ch, c.stored, s.StoredBytes, t.Name)
		counter(ch, c.loads, s.Hits, t.Name, "hit")
		counter(ch, c.loads, s.Misses, t.Name, "miss")
		counter(ch, c.stores, s.Stores, t.Name, "kept")
		counter(ch, c.stores, s.DroppedStores, t.Name, "dropped")
		counter(ch, c.errors, s.Errors, t.Name)
		if s.BudgetBytes > 0 {
			gauge(ch, c.held, float64(s.HeldBytes), t.Name)
			gauge(ch, c.budget, float64(s.BudgetBytes), t.Name)
		}
	}
}
