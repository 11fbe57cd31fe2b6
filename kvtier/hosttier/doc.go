// Package hosttier is a [kv.Tier] in host memory: the first tier below a cache's
// device, where evicted KV blocks go so that a later prompt loads them instead of
// computing them again.
//
// A [Tier] reserves one region of address space the size of its budget and commits
// it in granules (package backing/host) as values need them: the Go collector never
// scans, copies or moves the values, and the memory goes back to the OS with [Tier.Trim]
// and [Tier.Close], not at the collector's leisure. Each value is kept whole in a run
// of granules. A store that finds no room evicts the least recently stored or loaded
// values, counted in [Stats], or, with Options.NoEvict, is refused.
//
// # Which memory, under which budget
//
// The tier's bytes are charged to a ledger of their own, on a device of tier
// [accounting.HostTier] ("host-tier:0"), not to the host's own budget.
//
//   - For a CUDA cache, tier 1 is this package with Options.CUDA: host memory that the
//     device's DMA engine copies into and out of, pinned in the background in pieces of
//     at most 64 GiB ([cuda.MaxPinChunk]), with a stream of its own ([Tier.Stream]).
//   - For a host cache, tier 1 is the same machine's memory under a different budget.
//     It is not skipped: a block in the tier costs its bytes once and no mapping or
//     page fault to load (one copy, ~0.09 ms per 2 MiB here), where recomputing it
//     costs a prefill. What the split buys is that the two budgets can not starve
//     each other: cold blocks fill the tier up to its own limit and are evicted there,
//     while the cache's live sequences keep theirs. A user who would rather keep
//     every byte for the cache leaves the tier out; the cache then works as before.
//
// On Linux [New] refuses a budget above what the process's memory cgroup leaves free
// (memory.max less memory.current, or cgroup v1's limit_in_bytes less usage_in_bytes,
// at the tightest level), with an error naming the figures ([ErrCgroup]): a pool sized
// past its container's limit would be OOM-killed when it filled, not refused.
//
// # States
//
// A value is Filling (its store took room and its fill func writes into it), Held
// (visible to Load and Contains), Doomed (evicted, replaced or deleted while a Load
// still reads it) or Free (its granules are back in the free space, still committed
// until Trim). tier.go lists the transitions.
//
// # Memory management
//
// The Tier owns its region. Whoever makes a Tier MUST close it with Close, which
// waits for the calls in progress, stops the pinning, closes the stream, unpins and
// unreserves the region, and releases every byte to the ledger; a CUDA tier MUST be
// closed before its cuda.Backing. The dst of a fill func and the src of a use func
// are the tier's own memory, valid only during the call: a caller that keeps bytes
// copies them. Freed granules stay committed (and charged) so that the next store
// reuses resident memory; Trim decommits them.
//
// # Concurrency
//
// A Tier is safe for concurrent use. One lock guards the index, the LRU list, the free
// space and the counters; it is never held while fill or use runs, nor while
// granules are committed, so stores and loads of different values copy in parallel.
// A value being read is never evicted or freed: its readers are counted and the last
// one frees it. The pinning goroutine touches only its own record and the cuda
// backing. Calling Store, Load, Contains, Delete or Trim after Close panics.
package hosttier
