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
// With the default namespace "vmarena":
//
// Governor, labelled device (and authority where it says so):
//
//	vmarena_governor_limit_bytes                  byte budget (absent while unlimited)
//	vmarena_governor_used_bytes                   owned bytes of all ledgers
//	vmarena_governor_peak_bytes                   highest used bytes seen
//	vmarena_governor_owned_bytes{authority}       physical bytes a ledger holds
//	vmarena_governor_mapped_bytes{authority}      bytes a ledger maps (attribution only)
//	vmarena_governor_waiters                      requests queued for budget now
//	vmarena_governor_wait_seconds                 histogram of finished waits for budget
//	vmarena_governor_refusals_total               requests refused for budget (kv's too)
//	vmarena_governor_quarantines_total            releases that failed midway
//	vmarena_governor_quarantined_bytes_total      bytes those releases left behind
//
// Pools, labelled pool and device:
//
//	vmarena_pool_owned_bytes                      physical bytes the pool holds
//	vmarena_pool_idle_bytes                       pooled bytes mapped nowhere
//	vmarena_pool_resident_bytes                   idle bytes already populated
//	vmarena_pool_mapped_bytes                     bytes of mappings
//	vmarena_pool_granules_created_total           granules taken on
//	vmarena_pool_granules_given_back_total        granules given back
//
// KV caches, labelled cache:
//
//	vmarena_kv_cache_usage_perc                   fraction of the budget in use, 0-1
//	vmarena_kv_sequences                          live sequences
//	vmarena_kv_prefixes                           live prefixes
//	vmarena_kv_tokens                             tokens held by live sequences
//	vmarena_kv_used_bytes                         bytes of those tokens
//	vmarena_kv_committed_bytes                    bytes of granules sequences address
//	vmarena_kv_saved_by_sharing_bytes             bytes mapped from a prefix or a parent
//	vmarena_kv_waits_total                        appends that waited for memory
//	vmarena_kv_refusals_total                     growths, forks, lookups refused for memory
//	vmarena_kv_unreleased_bytes                   bytes failed releases left held
//	vmarena_kv_ahead_bytes                        bytes committed ahead, not taken yet (map-ahead)
//
// Prefix caches, labelled cache (vLLM's names where the meaning is the same):
//
//	vmarena_prefix_cache_queries_total            prompt tokens looked up
//	vmarena_prefix_cache_hits_total               of which found cached
//	vmarena_prefix_cache_evictions_total          evictions
//	vmarena_prefix_cache_evicted_bytes_total      physical bytes evictions gave back
//	vmarena_prefix_cache_cached_bytes             bytes cached
//	vmarena_prefix_cache_pinned_bytes             of which pinned
//
// KV-event publishers (package kvevents, adapted by an EventPublisherFunc), labelled
// publisher:
//
//	vmarena_kv_events_published_total             events sent
//	vmarena_kv_events_dropped_total               events the publisher's full queue dropped
//	vmarena_kv_events_subscriber_drops_total      messages a subscriber's full queue dropped
//	vmarena_kv_events_queue_depth                 events waiting to be sent now
//	vmarena_kv_events_subscribers                 subscribers connected now
//	vmarena_kv_events_replay_requests_total{outcome}  served, refused, aborted, malformed
//
// KV tiers (host memory, Redis: packages under kvtier) have a collector of their own,
// [TierCollector], labelled tier, with vLLM's external_prefix_cache_* and
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
