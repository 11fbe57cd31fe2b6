// Package kv is a KV cache for LLM servers: each sequence's K and V tensors grow token
// by token in granule steps on base addresses that never move, and a shared prompt
// prefix is physical memory owned once and mapped into every sequence that uses it.
//
// A [Cache] is built from a model [Geometry], a backing, and a per-sequence maximum
// length that is reserved as address space only. [Cache.NewSequence] starts an empty
// [Sequence]; [Sequence.Append] grows it, committing a granule only when a tensor
// crosses a granule boundary; [Sequence.Truncate] rolls it back (speculative decoding).
//
// # Sharing
//
// [Sequence.Freeze] turns a sequence's first P tokens into an immutable [Prefix]: the
// full granules that hold them are mapped, not copied; the tokens past the last full
// granule are copied into a granule of the prefix's own. [Cache.NewSequenceFrom] starts
// a sequence on a prefix the same way, and [Sequence.Fork] and [Sequence.ForkAt] fork a
// sequence, whole or at a checkpoint (parallel sampling, beam search, speculative
// decoding). Sharing needs a backing that implements backing.Sharer and owns its
// memory (host.Shared, cuda). Sharing whole granules takes no net memory, so a fork,
// a freeze or a prefix-cache hit is refused for budget only where not one granule is
// free: on host.Shared a granule the sequence made private is first moved into the
// shared memfd (a copy, once), one granule at a time.
//
// Tokens are reached by [View] (a layer's tensor), by [Run] (its contiguous runs, on
// the host) and by [Sequence.ReadTokens] and [Sequence.WriteTokens] (a bulk copy out
// and in, on any backing; ReadToken and WriteToken are their one-token forms); Base
// and the strides are for kernels.
//
// Shared tokens are never written: writes go only to a sequence's own tail
// ([Sequence.Writable] says where it starts). [Sequence.WriteTokens] refuses anything
// below with [ErrReadOnly], and truncating into a shared granule replaces it with a
// private copy of the kept tokens rather than writing into it. The sharers map shared
// granules read-only; on a backing that can change access in place
// (backing.Protector: host.Shared, cuda) the origin's own mapping of them becomes
// read-only too when it is frozen or forked, so that nobody can write shared memory by
// mistake. Where the backing can not, the origin's mapping stays writable and its code
// MUST NOT write below Writable.
//
// A stray CPU store into read-only memory through [Sequence.Bytes] or a host
// [View] is a hardware fault (SIGSEGV), which the Go runtime reports as "fatal error:
// fault" and ends the process. A goroutine that would rather recover it calls
// runtime/debug.SetPanicOnFault(true) first: the fault then becomes a Go panic (a
// runtime.Error whose Addr method gives the address) that a deferred recover can
// turn into an error. On a GPU a kernel's write into read-only memory is a fault of
// the CUDA context, where the driver grants read-only access at all.
//
// # Prefix caching
//
// A [PrefixCache] reuses K and V across requests by token IDs: [PrefixCache.Lookup]
// starts a sequence on the longest cached prefix of a prompt (whole granules mapped,
// the tail copied), [PrefixCache.Insert] caches a sequence's tokens after prefill.
// Cached prefixes are memory the governor can take back: the least recently used are
// evicted before any operation that commits granules is refused, whenever a request
// on the device waits for memory, to keep under PrefixCacheOptions.MaxBytes, and on
// request ([PrefixCache.Evict]); a [PrefixPin] holds a prefix against all of them.
// Insert is bookkeeping only, so a cache that is never hit costs no system call. How
// the index matches, counts, evicts and refers to inserted sequences is told on
// [PrefixCache].
//
// # KV events
//
// A prefix cache with an observer ([EventOptions], [BlockEvents]) announces each
// block of its tokens (16 by default) once it holds the block whole, chained by the
// hashes of package kv/blockhash, and withdraws it when it no longer does, whatever
// took the tokens (eviction by the budget, the cap or the governor's reclaimer, a
// damaged or taken-over entry); Close clears them all. Insert, eviction and Close
// only queue what changed (never a lookup or the token path); a goroutine of the
// prefix cache's computes the blocks and their hashes from it and tells the observer,
// in order ([PrefixCache.FlushEvents] waits for it). kv imports no transport: package
// kvevents puts the events on the wire in vLLM's format. On a model of several layer
// groups each group's blocks are told apart, as vLLM's hybrid KV cache tells them
// (its group_idx, kind and window: [BlocksStored]): a full or MLA group's are every
// whole block the index holds, a window group's those an entry holds whole from the
// first token its window units still hold, withdrawn as eviction gives those units
// back (events_groups.go).
//
// # Layer groups
//
// A [Model] (Config.Model, in place of a Geometry) is a list of layer groups, each
// with its attention kind, tensors and element type: full attention, a sliding
// window, chunked-local attention, an MLA latent (one tensor per layer, addressed as
// K, no V) or a recurrent state (StateBytes per sequence and layer, whatever its
// length). Each group lies on ranges of its own, laid out by the cache's Layout with
// its own blocks, so groups need no common page size and no padding. A
// sliding-window or chunked-local group gives its granules back as the window moves:
// an append to a sequence of n tokens gives back the whole units (Blocked: blocks)
// below the one that holds the group's FirstLive(n) — the first token the step can
// read — while the group's base and every held token's address stay. With
// Config.MapAhead the step leaves them behind and the map-ahead worker decommits
// them, so that the step makes no backing call (Stats.Ahead counts them until then).
// [Sequence.FirstHeld] says where a layer's held tokens start; reading, writing or
// viewing a token below fails with [ErrDropped].
//
// The window rule: whatever holds a sequence's first n tokens (a truncated sequence,
// a fork, a prefix, a prefix-cache entry or hit) needs of a window group exactly the
// tokens the step at n reads, [FirstLive(n), n): none at all where FirstLive(n) is n
// (a chunk boundary, a sliding window of one token, n = 0). A [Sequence.Truncate],
// [Sequence.ForkAt], [Sequence.Freeze] or [PrefixCache.Insert] whose holder would need
// a token the group dropped is refused with ErrDropped (recomputing it is the
// caller's), and a prefix-cache hit of m tokens needs the full groups' first m tokens
// and what the rule asks of each window group, held by one entry (see
// NewPrefixCache). A holder maps the source's units from the one that holds
// FirstLive(n) on and commits none below; one that needs none of a group's tokens
// holds none of them (FirstHeld is n), whatever the source had dropped.
//
// A recurrent state ([Sequence.ReadState], [Sequence.WriteState]) exists from the
// first token on, is copied on fork, never shared, and kept as it is by a Truncate
// but to 0; prefix caching of it is out of scope: [Sequence.Freeze] on a model with a
// recurrent group is refused with ErrConfig. On the other models it freezes each
// group as ForkAt forks it. The prefix cache serves a model of window groups beside
// full or MLA ones under the window rule, with events per group, and tiers only on a
// model of one full-attention or MLA group. Map-ahead maps each group that holds
// tokens ahead on its own, a recurrent state never. Each group of FP8 elements may
// keep scales of its own ([Group.Scales], [Cache.GroupScales]).
// window.go lists the states of a window group's bytes and their transitions.
//
// # Layout
//
// [Blocked] (the default) puts all layers of a sequence in one range cut into blocks
// of whole granules; a block holds [Sequence.BlockTokens] tokens of every layer,
// layer-major inside ([layer][K|V][tokens][KVHeads][HeadDim]), so that a layer's K
// and V of a block are one contiguous run (64 KiB for Llama-3-8B at 2 MiB granules).
// Each group's block is chosen so that a whole number of tokens fills it, with no
// byte dead, where that takes at most 512 tokens (or one granule's; half a window),
// else with the fewest dead bytes within that bound (blocks.go; [GroupSizing] says
// which and why). A sequence keeps one growth frontier and at most one partly filled
// block.
// A layer's tensor is then a strided tensor with one more dimension, [blocks,
// BlockTokens, KVHeads, HeadDim] ([View]; [Sequence.BlockStride] from one block to the
// next, [Sequence.TokenStride] from one token to the next inside a block); in the last
// block the tokens at or past Len are not the sequence's. Forks, prefixes and the
// prefix cache share whole blocks and copy the tokens of the partly filled last one.
// Config.BlockTokens overrides the choice: larger blocks read in longer runs and copy
// more tokens per fork. [PerLayer] gives each (layer, K|V) tensor its own contiguous range
// ([Sequence.Bytes]) at the cost of 2 × Layers growth frontiers and up to 2 × Layers
// partly filled granules per sequence. [Config.Size] computes the cost of
// each without allocating; BENCHMARKS.md lists them for Llama-3-8B and measures what
// each costs attention's read.
//
// # Element types and scales
//
// A geometry's element type sets a token's bytes ([Geometry.TokenBytes] counts them
// with arena.DType.Bytes): fp16 and bf16, the OCP FP8 formats (half of fp16), or
// llama.cpp's Q8_0, whose blocks of 32 values carry their own F16 scale (34 bytes a
// block, so a head must be a whole number of blocks and a view's last dimension counts
// blocks). An FP8 geometry may ask for dequantization scales ([Geometry.Scales]: per
// tensor or per KV head); the cache keeps them in one range of its own backing from
// New to Close, at an address a kernel reads ([Cache.Scales]), and [Cache.SetScales]
// writes them on any backing. On a [Model] each FP8 group asks for its own (per
// tensor or per KV head, [Group.Scales]); they lie in the same range, group after
// group, and [Cache.GroupScales] gives a kernel each group's, [L, T, H] over the
// group's layers in its order; SetScales and ReadScales take the model's layer index.
//
// # Memory management
//
// Every Sequence MUST be closed with [Sequence.Close], which gives back every granule
// (to the backing's pool, or the OS) and reports an honest outcome. The creator of a
// Prefix MUST call [Prefix.Release]; a prefix's memory is freed when the creator has
// released it and the last sequence started on it has closed. Slices from
// [Sequence.Bytes] are valid until the sequence shrinks below them or closes.
//
// Budget: growth the governor can not cover fails at once with an
// *accounting.BudgetError (the bytes needed, available and the limit) and changes
// nothing. [Cache.AppendBatch] grows a whole batch of sequences, each by its own
// count, all or nothing: the step of a scheduler loop, which preempts a sequence on a
// refusal (see ExampleCache_AppendBatch). [Sequence.Need] and [Cache.Need] say what a
// growth would take now, the pool's idle granules counted, [Sequence.ForkNeed] what a
// fork or freeze would, and [PrefixCache.Need] what serving a prompt would; a
// scheduler admits what fits in [Cache.Headroom], the governor's free bytes plus what
// evicting cached prefixes would give back. Every operation that commits granules
// (appends, forks, freezes, starts on a prefix, lookups) evicts cached prefixes before
// it refuses for budget; [PrefixCache.Evict] evicts on request. [PrefixCache.Match]
// says what a lookup would match and changes nothing; Lookup is the admission, and
// counts the queries of the prefix cache's hit rate. Every refusal counts in
// Stats.Refusals and in the governor's refusals of the device.
//
// Waiting lives in one place, the governor's FIFO queue of the device:
// [Cache.AppendBatchCtx] and [Sequence.AppendCtx] wait there for the whole step's
// bytes, behind whoever queued first, holding nothing meanwhile; the bytes they
// waited for go to their commit (accounting.Authority.AcquireFor), and the pool's
// idle granules serve them before any new ones. A plain Append or AppendBatch does not
// queue and may succeed ahead of waiters.
//
// Map-ahead (Config.MapAhead, on a pooling backing): a sequence within a few tokens
// of its next commit has the granules of that commit committed into its own ranges,
// past its tokens, by a goroutine of the cache (arena.Buffer.CommitAhead), so that the
// decode step that crosses into a new block adopts them with no backing call and no
// lock that a system call holds, instead of mapping a granule on the token path.
// Those granules are owned and charged like any (the governor, the pool's stats and
// Stats.Ahead show them), at most the next block of each layer group of each growing
// sequence (a step adopts of it what its tokens need), counted
// by Need and AppendBatch as the cache's own; a growth that the budget can not hold
// otherwise takes other sequences' back first, and the worker stands aside while a
// step that commits decides: map-ahead never makes a growth of the cache refused.
// Truncate, Close, ForkAt, Freeze and PrefixCache.Insert give a sequence's back to
// the pool first; Cache.Close stops the goroutine.
//
// A Cache is closed with [Cache.Close] once every sequence and prefix is gone (it
// fails with [ErrBusy] before); Close gives back the range of its FP8 scales too. A
// second [Sequence.Close] changes nothing and returns a Failed outcome matching
// [ErrClosed]; every other method of a closed sequence panics ("kv: Sequence used
// after Close").
//
// # Concurrency
//
// A Cache is safe for concurrent use by many goroutines: sequences may be created,
// grown, forked and closed at once. A Sequence is used by one goroutine at a time;
// Fork and Freeze read it, so they too belong to the goroutine that owns it, and a
// batch step belongs to the goroutine that owns all of its sequences. A Prefix
// may be used by many goroutines. [Cache.SetScales] must not run while anything reads
// the same tensor's scales. With Config.MapAhead the cache runs one goroutine of its
// own, which commits runs ahead into growing sequences' ranges (past their committed
// bytes, through the arena's one atomic word of a range, never its other fields) and
// takes no lock of the cache's or a sequence's; its own lock comes after any of those,
// before the pool's, and it holds it across no backing call. A sequence's owner waits
// for it only when a step crosses into a run the worker is still committing (see
// kv/ahead.go for the protocol). A prefix cache with an observer runs one goroutine of its own
// from its first change to Close, which takes only the prefix cache's lock (holding no
// other), to take the changes queued under it, and calls the observer with no lock
// held. A prefix cache calls its tiers (PrefixCacheOptions.Tiers) with none of these
// locks held; the lock of its tier counts is taken after all of them.
//
// The locks, in the order they are taken (a goroutine that holds one takes only those
// below it):
//
//  1. an origin's ranges lock (one sequence's: a sequence that a prefix cache entry
//     referred to takes it to resize or protect its ranges, and a lookup takes it to
//     map from them; no goroutine holds two);
//  2. the prefix cache's lock (its index and the counts of its granules);
//  3. the cache's lock (its sequences, prefixes and counters);
//  4. map-ahead's lock, then the backing's and the governor's own.
//
// A function holds each lock it takes across one stretch of its body and releases it
// there; none releases a lock its caller took. A lookup takes the prefix cache's lock
// to match, releases it, and only then takes an origin's ranges lock (and the prefix
// cache's again inside it) to map. The prefix cache's reclaimer runs on a goroutine
// of the governor's, holding none of these.
package kv
