// Package metrics exports vmarena's snapshots to Prometheus: a [Collector] reads a
// governor, pools, KV caches and prefix caches that the server passes in, and turns
// each scrape into constant metrics. It lives apart so that the core packages never
// import Prometheus; it registers nothing by itself (no global registry, no init).
//
// Names carry their units (_bytes, _seconds) and cumulative figures are counters
// (_total): rates and ratios are for PromQL. The one ratio, kv_cache_usage_perc, has
// vLLM's name and meaning, since operators already chart it: the fraction, 0 to 1, of
// the KV budget that live sequences and prefixes hold (a pool's idle granules and
// what a prefix cache could evict now are not in use).
//
// # Metrics
//
// With the default namespace "vmarena" the families are vmarena_governor_* (labelled
// device, and authority for a ledger's owned and mapped bytes), vmarena_pool_*
// (labelled pool and device), vmarena_kv_* (labelled cache), vmarena_prefix_cache_*
// (labelled cache, vLLM's names where the meaning is the same) and
// vmarena_kv_events_* (labelled publisher: package kvevents, adapted by an
// EventPublisherFunc). docs/metrics.md lists every metric with its labels and
// meaning. KV tiers (host memory, Redis: packages under kvtier) have a collector of
// their own, [TierCollector], labelled tier, with vLLM's external_prefix_cache_* and
// kv_offload_*_bytes_total names.
//
// # Cost of a scrape
//
// Collect takes each source's snapshot once: the governor's lock for a copy of its
// counters, each pool's lock for its counters, and each cache's Stats. Nothing is
// held across sources, and nothing here runs on a token path.
//
// # Concurrency
//
// A Collector is safe for concurrent use: Prometheus may scrape it from several
// goroutines at once.
package metrics
