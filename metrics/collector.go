package metrics

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/kv"
)

// DefaultNamespace is the prefix of every metric name unless Options.Namespace says
// otherwise.
const DefaultNamespace = "vmarena"

// ErrOptions is matched by the error New returns for bad Options.
var ErrOptions = errors.New("metrics: bad options")

// CacheSource is what a KV cache must provide to be collected: a snapshot. Any
// *kv.Cache does.
type CacheSource interface {
	Stats() kv.Stats
}

// PrefixCacheSource is what a prefix cache must provide to be collected: a snapshot
// (Queries and Hits in tokens, as vLLM counts them, Evictions, EvictedBytes,
// CachedBytes, PinnedBytes). Any *kv.PrefixCache does.
type PrefixCacheSource interface {
	Stats() kv.PrefixCacheStats
}

// PrefixCacheFunc adapts a function to a PrefixCacheSource.
type PrefixCacheFunc func() kv.PrefixCacheStats

// Stats returns f().
func (f PrefixCacheFunc) Stats() kv.PrefixCacheStats { return f() }

// Pool names a pooling backing to collect.
type Pool struct {
	Name string       // the pool label; unique among Options.Pools
	Pool backing.Pool // host.Shared, cuda.Backing, ...
}

// Cache names a KV cache to collect.
type Cache struct {
	Name  string      // the cache label; unique among Options.Caches
	Cache CacheSource // a *kv.Cache, say
	// Device is where the cache's memory is: its budget, for kv_cache_usage_perc,
	// is the governor's limit there. The metric is absent while the device has no
	// limit or Options.Governor is nil.
	Device accounting.DeviceKey
	// Pool is the cache's backing when it pools its memory (ByBacking): its idle
	// granules are owned but not in use. nil under ByBuffer.
	Pool backing.Pool
	// PrefixCache is the cache's prefix cache, or nil: what it could evict now
	// (cached bytes less pinned ones) is not in use either, as in vLLM, where cached
	// blocks no request holds count as free.
	PrefixCache PrefixCacheSource
}

// CacheOf returns the Cache to collect for c, named name: its Device and Pool are
// c's own (Cache.Device, Cache.Pool), and its PrefixCache is PrefixCacheOf(pc) (pc may
// be nil: no prefix cache). A nil c gives a Cache with no source, which New refuses.
func CacheOf(name string, c *kv.Cache, pc *kv.PrefixCache) Cache {
	if c == nil {
		return Cache{Name: name}
	}
	return Cache{Name: name, Cache: c, Device: c.Device(), Pool: c.Pool(), PrefixCache: PrefixCacheOf(pc)}
}

// PrefixCache names a prefix cache to collect.
type PrefixCache struct {
	Name   string // the cache label; unique among Options.PrefixCaches
	Source PrefixCacheSource
}

// Options says what a Collector reads. Every source is optional.
type Options struct {
	// Namespace prefixes every metric name: letters, digits and underscores, not
	// starting with a digit. "" means DefaultNamespace.
	Namespace    string
	Governor     *accounting.Governor // every device it has seen
	Pools        []Pool
	Caches       []Cache
	PrefixCaches []PrefixCache
	// EventPublishers are KV-event publishers (package kvevents), by name.
	EventPublishers []EventPublisher
}

// Collector is a prometheus.Collector over vmarena's snapshots. Register it on a
// registry of your own: prometheus.NewRegistry().MustRegister(c).
type Collector struct {
	opts Options
	d    descs
	ev   eventDescs
}

var _ prometheus.Collector = (*Collector)(nil)

var nameRe = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)

// New returns a collector of the sources in opts. It returns an error matching
// ErrOptions for a bad namespace, a nil source, or an empty or repeated name.
func New(opts Options) (*Collector, error) {
	if opts.Namespace == "" {
		opts.Namespace = DefaultNamespace
	}
	if !nameRe.MatchString(opts.Namespace) {
		return nil, fmt.Errorf("%w: namespace %q is not a metric name prefix", ErrOptions, opts.Namespace)
	}
	if err := checkSources("pool", opts.Pools, func(p Pool) (string, bool) { return p.Name, p.Pool != nil }); err != nil {
		return nil, err
	}
	if err := checkSources("cache", opts.Caches, func(c Cache) (string, bool) { return c.Name, c.Cache != nil }); err != nil {
		return nil, err
	}
	if err := checkSources("prefix cache", opts.PrefixCaches, func(c PrefixCache) (string, bool) { return c.Name, c.Source != nil }); err != nil {
		return nil, err
	}
	opts.Pools = append([]Pool(nil), opts.Pools...)
	opts.Caches = append([]Cache(nil), opts.Caches...)
	if err := checkSources("event publisher", opts.EventPublishers, func(p EventPublisher) (string, bool) { return p.Name, p.Source != nil }); err != nil {
		return nil, err
	}
	opts.PrefixCaches = append([]PrefixCache(nil), opts.PrefixCaches...)
	opts.EventPublishers = append([]EventPublisher(nil), opts.EventPublishers...)
	return &Collector{opts: opts, d: newDescs(opts.Namespace), ev: newEventDescs(opts.Namespace)}, nil
}

// checkSources returns an error matching ErrOptions unless every source of a kind
// has a source and a name of its own; of says what each has.
func checkSources[T any](kind string, sources []T, of func(T) (name string, ok bool)) error {
	seen := make(map[string]bool, len(sources))
	for i, src := range sources {
		n, ok := of(src)
		switch {
		case !ok:
			return fmt.Errorf("%w: %s %q has no source", ErrOptions, kind, n)
		case n == "":
			return fmt.Errorf("%w: %s %d has no name", ErrOptions, kind, i)
		case seen[n]:
			return fmt.Errorf("%w: two %ss named %q", ErrOptions, kind, n)
		}
		seen[n] = true
	}
	return nil
}

type descs struct {
	govLimit, govUsed, govPeak, govOwned, govMapped, govWaiters *prometheus.Desc
	govWait, govRefusals, govQuarantines, govQuarantinedBytes   *prometheus.Desc

	poolOwned, poolIdle, poolResident, poolMapped, poolCreated, poolGivenBack *prometheus.Desc

	kvUsage, kvSequences, kvPrefixes, kvTokens, kvUsed, kvCommitted, kvSaved, kvWaits *prometheus.Desc
	kvRefusals, kvUnreleased, kvAhead                                                 *prometheus.Desc

	pcQueries, pcHits, pcEvictions, pcEvictedBytes, pcCached, pcPinned *prometheus.Desc
	pcCheckpoints, pcCheckpointBytes, pcPendingCheckpointBytes         *prometheus.Desc

	pcTierHits, pcTierMisses, pcTierLoaded, pcTierStored, pcTierDrops, pcTierInvalid, pcTierUnfit *prometheus.Desc
}

func newDescs(ns string) descs {
	dev := []string{"device"}
	auth := []string{"device", "authority"}
	pool := []string{"pool", "device"}
	cache := []string{"cache"}
	tier := []string{"cache", "tier"}
	d := func(name, help string, labels []string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, labels, nil)
	}
	return descs{
		govLimit:            d("governor_limit_bytes", "Byte budget of the device; absent while it has none.", dev),
		govUsed:             d("governor_used_bytes", "Bytes owned by all ledgers on the device.", dev),
		govPeak:             d("governor_peak_bytes", "Highest used bytes seen on the device since the last peak reset.", dev),
		govOwned:            d("governor_owned_bytes", "Physical bytes a ledger holds (they consume budget).", auth),
		govMapped:           d("governor_mapped_bytes", "Bytes a ledger has mapped (attribution only: a granule mapped twice counts twice).", auth),
		govWaiters:          d("governor_waiters", "Requests queued for budget on the device now.", dev),
		govWait:             d("governor_wait_seconds", "Time finished requests spent queued for budget.", dev),
		govRefusals:         d("governor_refusals_total", "Requests refused because the budget could not cover them: by the governor, and by takers that check the budget first (a KV cache's growths).", dev),
		govQuarantines:      d("governor_quarantines_total", "Releases that failed midway and left memory behind.", dev),
		govQuarantinedBytes: d("governor_quarantined_bytes_total", "Bytes left behind by releases that failed midway.", dev),

		poolOwned:     d("pool_owned_bytes", "Physical bytes the pool holds, mapped or idle.", pool),
		poolIdle:      d("pool_idle_bytes", "Pooled bytes mapped nowhere.", pool),
		poolResident:  d("pool_resident_bytes", "Idle bytes known to be populated (no fault on first touch).", pool),
		poolMapped:    d("pool_mapped_bytes", "Bytes of the pool's mappings (a granule mapped twice counts twice).", pool),
		poolCreated:   d("pool_granules_created_total", "Granules the pool has taken on (charged to its ledger).", pool),
		poolGivenBack: d("pool_granules_given_back_total", "Granules the pool has given back.", pool),

		kvUsage:      d("kv_cache_usage_perc", "Fraction of the KV budget held by live sequences and prefixes, 0 to 1 (1 means 100 percent).", cache),
		kvSequences:  d("kv_sequences", "Live sequences.", cache),
		kvPrefixes:   d("kv_prefixes", "Live prefixes.", cache),
		kvTokens:     d("kv_tokens", "Tokens held by live sequences.", cache),
		kvUsed:       d("kv_used_bytes", "Bytes of the tokens live sequences hold.", cache),
		kvCommitted:  d("kv_committed_bytes", "Bytes of granules committed in live sequences' ranges, shared mappings included.", cache),
		kvSaved:      d("kv_saved_by_sharing_bytes", "Bytes live sequences map from a prefix or a parent instead of holding their own.", cache),
		kvWaits:      d("kv_waits_total", "Appends that had to wait for memory.", cache),
		kvRefusals:   d("kv_refusals_total", "Operations (growths, forks, starts on a prefix, lookups) refused because the memory could not be had (a scheduler's cue to preempt).", cache),
		kvUnreleased: d("kv_unreleased_bytes", "Bytes failed releases left held: kept for the cache's Close to retry, or quarantined.", cache),
		kvAhead:      d("kv_ahead_bytes", "Bytes that map-ahead holds outside every sequence: committed ahead into growing sequences' ranges and taken by no step yet, and granules that windows left behind for the worker to give back. Owned, and taken back by any growth that needs the budget.", cache),

		pcQueries:      d("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", cache),
		pcHits:         d("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", cache),
		pcEvictions:    d("prefix_cache_evictions_total", "Evictions from the prefix cache.", cache),
		pcEvictedBytes: d("prefix_cache_evicted_bytes_total", "Physical bytes evictions from the prefix cache gave back.", cache),
		pcCached:       d("prefix_cache_cached_bytes", "Bytes the prefix cache holds, pinned or not.", cache),
		pcPinned:       d("prefix_cache_pinned_bytes", "Bytes the prefix cache holds pinned (never evicted).", cache),

		pcCheckpoints:            d("prefix_cache_checkpoints", "Recurrent-state checkpoints the prefix cache's entries hold, each once however many hold it.", cache),
		pcCheckpointBytes:        d("prefix_cache_checkpoint_bytes", "Bytes of the recurrent-state checkpoints the prefix cache's entries hold: part of prefix_cache_cached_bytes.", cache),
		pcPendingCheckpointBytes: d("prefix_cache_pending_checkpoint_bytes", "Bytes of the recurrent-state checkpoints that live sequences alone hold (recorded and not inserted yet): not part of prefix_cache_cached_bytes, never evicted.", cache),

		pcTierHits:    d("prefix_cache_tier_hits_total", "Prompt tokens the prefix cache loaded from a tier below the device (they count in prefix_cache_hits_total too).", tier),
		pcTierMisses:  d("prefix_cache_tier_misses_total", "Lookups that asked a tier and loaded nothing from it.", tier),
		pcTierLoaded:  d("prefix_cache_tier_load_bytes_total", "Bytes of the values the prefix cache loaded from a tier, each checked.", tier),
		pcTierStored:  d("prefix_cache_tier_store_bytes_total", "Bytes of the values the prefix cache wrote down into a tier.", tier),
		pcTierDrops:   d("prefix_cache_tier_dropped_total", "Blocks not stored into a tier, and loads that failed other than by a value's check: misses, never errors.", tier),
		pcTierInvalid: d("prefix_cache_tier_invalid_total", "Values from a tier that failed their check (damaged, another namespace, other tokens): misses, never mapped.", tier),
		pcTierUnfit:   d("prefix_cache_tier_unfit_total", "Blocks a tier held for a lookup that the device's budget could not take even after eviction: the lookup loaded those before them.", tier),
	}
}

func (d *descs) all() []*prometheus.Desc {
	return []*prometheus.Desc{
		d.govLimit, d.govUsed, d.govPeak, d.govOwned, d.govMapped, d.govWaiters,
		d.govWait, d.govRefusals, d.govQuarantines, d.govQuarantinedBytes,
		d.poolOwned, d.poolIdle, d.poolResident, d.poolMapped, d.poolCreated, d.poolGivenBack,
		d.kvUsage, d.kvSequences, d.kvPrefixes, d.kvTokens, d.kvUsed, d.kvCommitted, d.kvSaved, d.kvWaits,
		d.kvRefusals, d.kvUnreleased, d.kvAhead,
		d.pcQueries, d.pcHits, d.pcEvictions, d.pcEvictedBytes, d.pcCached, d.pcPinned,
		d.pcCheckpoints, d.pcCheckpointBytes, d.pcPendingCheckpointBytes,
		d.pcTierHits, d.pcTierMisses, d.pcTierLoaded, d.pcTierStored, d.pcTierDrops, d.pcTierInvalid, d.pcTierUnfit,
	}
}

// Describe sends the descriptor of every metric the collector may report.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.d.all() {
		ch <- d
	}
	for _, d := range c.ev.all() {
		ch <- d
	}
}

// Collect sends one snapshot of every source.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	var limits map[accounting.DeviceKey]int64
	if g := c.opts.Governor; g != nil {
		limits = c.collectGovernor(ch, g.AllStats())
	}
	for _, p := range c.opts.Pools {
		c.collectPool(ch, p)
	}
	for _, k := range c.opts.Caches {
		c.collectCache(ch, k, limits)
	}
	for _, p := range c.opts.PrefixCaches {
		s := p.Source.Stats()
		counter(ch, c.d.pcQueries, s.Queries, p.Name)
		counter(ch, c.d.pcHits, s.Hits, p.Name)
		counter(ch, c.d.pcEvictions, s.Evictions, p.Name)
		counter(ch, c.d.pcEvictedBytes, s.EvictedBytes, p.Name)
		gauge(ch, c.d.pcCached, float64(s.CachedBytes), p.Name)
		gauge(ch, c.d.pcPinned, float64(s.PinnedBytes), p.Name)
		gauge(ch, c.d.pcCheckpoints, float64(s.Checkpoints), p.Name)
		gauge(ch, c.d.pcCheckpointBytes, float64(s.CheckpointBytes), p.Name)
		gauge(ch, c.d.pcPendingCheckpointBytes, float64(s.PendingCheckpointBytes), p.Name)
		for _, t := range s.Tiers {
			counter(ch, c.d.pcTierHits, t.Hits, p.Name, t.Name)
			counter(ch, c.d.pcTierMisses, t.Misses, p.Name, t.Name)
			counter(ch, c.d.pcTierLoaded, t.LoadBytes, p.Name, t.Name)
			counter(ch, c.d.pcTierStored, t.StoreBytes, p.Name, t.Name)
			counter(ch, c.d.pcTierDrops, t.Drops, p.Name, t.Name)
			counter(ch, c.d.pcTierInvalid, t.Invalid, p.Name, t.Name)
			counter(ch, c.d.pcTierUnfit, t.Unfit, p.Name, t.Name)
		}
	}
	for _, p := range c.opts.EventPublishers {
		c.collectEventPublisher(ch, p)
	}
}

// collectGovernor sends every device's figures and returns the devices' limits.
func (c *Collector) collectGovernor(ch chan<- prometheus.Metric, all []accounting.DeviceStats) map[accounting.DeviceKey]int64 {
	limits := make(map[accounting.DeviceKey]int64, len(all))
	buckets := accounting.WaitBuckets()
	for _, s := range all {
		dev := s.Device.String()
		limits[s.Device] = s.Limit
		if s.Limit != accounting.Unlimited {
			gauge(ch, c.d.govLimit, float64(s.Limit), dev)
		}
		gauge(ch, c.d.govUsed, float64(s.Used), dev)
		gauge(ch, c.d.govPeak, float64(s.Peak), dev)
		gauge(ch, c.d.govWaiters, float64(s.Waiters), dev)
		// Ledger names need not be unique: one series per name, summed.
		type axes struct{ owned, mapped int64 }
		byName := make(map[string]*axes, len(s.Authorities))
		var order []string
		for _, a := range s.Authorities {
			x := byName[a.Name]
			if x == nil {
				x = &axes{}
				byName[a.Name] = x
				order = append(order, a.Name)
			}
			x.owned += a.Owned
			x.mapped += a.Mapped
		}
		for _, n := range order {
			gauge(ch, c.d.govOwned, float64(byName[n].owned), dev, n)
			gauge(ch, c.d.govMapped, float64(byName[n].mapped), dev, n)
		}
		k := s.Counters
		cum := make(map[float64]uint64, len(buckets))
		for i, b := range buckets {
			cum[b.Seconds()] = uint64(k.WaitsWithin[i])
		}
		ch <- prometheus.MustNewConstHistogram(c.d.govWait, uint64(k.Waits), k.WaitTime.Seconds(), cum, dev)
		counter(ch, c.d.govRefusals, k.Refusals, dev)
		counter(ch, c.d.govQuarantines, k.Quarantines, dev)
		counter(ch, c.d.govQuarantinedBytes, k.QuarantinedBytes, dev)
	}
	return limits
}

// deviced is a backing that says which memory it commits.
type deviced interface{ Device() accounting.DeviceKey }

func (c *Collector) collectPool(ch chan<- prometheus.Metric, p Pool) {
	dev := ""
	if d, ok := p.Pool.(deviced); ok {
		dev = d.Device().String()
	}
	s := p.Pool.PoolStats()
	gauge(ch, c.d.poolOwned, float64(s.Owned), p.Name, dev)
	gauge(ch, c.d.poolIdle, float64(s.Idle), p.Name, dev)
	gauge(ch, c.d.poolResident, float64(s.Resident), p.Name, dev)
	gauge(ch, c.d.poolMapped, float64(s.Mapped), p.Name, dev)
	counter(ch, c.d.poolCreated, s.Created, p.Name, dev)
	counter(ch, c.d.poolGivenBack, s.GivenBack, p.Name, dev)
}

func (c *Collector) collectCache(ch chan<- prometheus.Metric, k Cache, limits map[accounting.DeviceKey]int64) {
	s := k.Cache.Stats()
	spare := s.Ahead // owned but not in use: runs committed ahead, idle granules, unpinned cache
	if k.Pool != nil {
		spare += k.Pool.PoolStats().Idle
	}
	if k.PrefixCache != nil {
		p := k.PrefixCache.Stats()
		spare += max(p.CachedBytes-p.PinnedBytes, 0)
	}
	if limit, ok := limits[k.Device]; ok && limit != accounting.Unlimited {
		gauge(ch, c.d.kvUsage, usage(s.Owned-spare, limit), k.Name)
	}
	gauge(ch, c.d.kvSequences, float64(s.Sequences), k.Name)
	gauge(ch, c.d.kvPrefixes, float64(s.Prefixes), k.Name)
	gauge(ch, c.d.kvTokens, float64(s.Tokens), k.Name)
	gauge(ch, c.d.kvUsed, float64(s.Used), k.Name)
	gauge(ch, c.d.kvCommitted, float64(s.Committed), k.Name)
	gauge(ch, c.d.kvSaved, float64(s.Shared), k.Name)
	counter(ch, c.d.kvWaits, s.Waits, k.Name)
	counter(ch, c.d.kvRefusals, s.Refusals, k.Name)
	gauge(ch, c.d.kvUnreleased, float64(s.Unreleased), k.Name)
	gauge(ch, c.d.kvAhead, float64(s.Ahead), k.Name)
}

// usage returns kv_cache_usage_perc for inUse bytes held under a budget of limit
// bytes: their ratio, clamped to [0, 1]; 0 when limit is not positive.
func usage(inUse, limit int64) float64 {
	if limit <= 0 || inUse <= 0 {
		return 0
	}
	return min(float64(inUse)/float64(limit), 1)
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v int64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
}

// PrefixCacheOf returns pc as a PrefixCacheSource, or nil for a nil pc: no prefix
// cache for Cache.PrefixCache, and a source New refuses in Options.PrefixCaches,
// rather than an interface holding a nil *kv.PrefixCache whose every Collect panics.
func PrefixCacheOf(pc *kv.PrefixCache) PrefixCacheSource {
	if pc == nil {
		return nil
	}
	return pc
}
