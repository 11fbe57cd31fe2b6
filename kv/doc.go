// Package kv is a KV cache for LLM servers: each sequence's K and V tensors grow token
// by token in granule steps on base addresses that never move, and a shared prompt
// prefix is physical memory owned once and mapped into every sequence that uses it.
//
// A [Cache] is built from a [Model], a backing, and a per-sequence maximum length that
// is reserved as address space only. [Cache.NewSequence] starts an empty [Sequence];
// [Sequence.Append] grows it, committing a granule only when a tensor crosses a
// granule boundary; [Cache.AppendBatch] grows a batch, all or nothing (the step of a
// server's loop: docs/server.md); [Sequence.Truncate] rolls a sequence back. Tokens
// are reached by [Sequence.WriteTokens] and [Sequence.ReadTokens] on any backing, by
// [View] and [Run] on the host, and by Base and the strides in a kernel.
//
// [Sequence.Freeze] makes a sequence's first tokens an immutable [Prefix], which
// [Cache.NewSequenceFrom] starts sequences on, and [Sequence.Fork] and
// [Sequence.ForkAt] fork a sequence, whole or at a checkpoint: each maps the full
// granules of the shared tokens and copies the tokens past them, on a backing that
// shares (backing.Sharer: host.Shared, cuda). Shared tokens are never written: writes
// go to a sequence's own tail, from [Sequence.Writable] on. A [PrefixCache] shares the
// same way across requests, by token IDs (docs/prefix-cache.md); it may tell a router
// which blocks it holds ([BlockEvents], docs/events.md) and write them down into
// tiers below the device ([Tier], docs/tiers.md). On a node pool's client
// (backing.Lender) a Prefix is lent to another process ([Prefix.Lend]), which maps it
// read-only with no copy ([Cache.BorrowPrefix]; docs/node.md).
//
// A Model is a list of layer groups (full attention, sliding-window, chunked-local, an
// MLA latent, a recurrent state; docs/layer-groups.md), each on ranges of its own. A
// window group gives back its granules behind the window as a sequence grows, and
// every held token keeps its address. The window rule: whatever holds a sequence's
// first n tokens (a truncated sequence, a fork, a prefix, a prefix-cache entry or hit)
// needs of a window group exactly the tokens the step at n reads, [FirstLive(n), n),
// none where that is empty; a Truncate, ForkAt, Freeze or PrefixCache.Insert that
// would need a token the window gave back is refused with [ErrDropped].
//
// # Files
//
// Each file's first comment tells the mechanism its code holds; by concern:
//
//   - The core: cache.go (Config, New, Stats, Close), sequence.go (Truncate, Fork,
//     ForkAt, Freeze, Close), prefix.go, prefix_loan.go (a Prefix lent to another
//     process and borrowed there), batch.go (growth and its waits),
//     admission.go (what a scheduler asks first), tokens.go and access.go (reaching
//     tokens, the strides), share.go (how a new holder maps shared units).
//   - The shape: model*.go, group*.go and window*.go (the groups and how they lie on
//     ranges, the window rule, the states of a window group's bytes), layout.go,
//     blocks.go (how a block is chosen), sizing.go (what a configuration costs),
//     scales.go (FP8 scales).
//   - Map-ahead: ahead*.go, its worker and the window's give-back off the token path.
//   - The prefix cache: prefixcache*.go, its API and options (prefixcache.go), index
//     and counts (_index), eviction (_evict), lazy entries (_lazy), live holders of
//     its granules (_holders), layer groups (_groups), pins, a scheduler's questions
//     (_admit) and tiers (_tier, _background); hooks.go is the one seam by which the
//     core tells it what sequences do; namespace.go, its namespaces (Namespace: what
//     they keep apart, their keys in the index and the tiers).
//   - Events and tiers: blockevents.go (the observer's API), events*.go (how the
//     events follow the index), tier*.go (the Tier contract and its values),
//     swap.go (a preempted sequence moved into a Tier and back).
//   - store.go (the backing's type erased), unsafe.go (the one pointer conversion),
//     errors.go, observe.go (logs).
//
// # Memory rules
//
// Every Sequence MUST be closed ([Sequence.Close], which reports an honest outcome),
// and the creator of a Prefix MUST release it ([Prefix.Release]): a prefix's memory is
// freed with its last user. [Cache.Close] comes after them (it fails with [ErrBusy]
// before). A [Swapped] copy ([Cache.SwapOut]) holds no memory of the cache's, but its
// values stay in their tier until [Cache.SwapIn] or [Swapped.Drop]. A second [Sequence.Close] returns a Failed outcome matching [ErrClosed];
// any other method of a closed sequence panics with [PanicSequenceClosed]. A slice
// from [Sequence.Bytes] is valid until the sequence shrinks below it or closes.
//
// A growth the budget can not cover fails at once with an *accounting.BudgetError (the
// bytes needed, available and the limit) and changes nothing, and counts in
// Stats.Refusals and the governor's refusals. Cached prefixes are memory the budget
// takes back: every operation that commits granules (appends, forks, freezes, starts
// on a prefix, lookups) evicts cached prefixes that no live sequence maps before it
// refuses. Eviction runs too when a request on the device waits for memory (the prefix
// cache's reclaimer), to keep under PrefixCacheOptions.MaxBytes, and on request
// ([PrefixCache.Evict]); a [PrefixPin] holds a prefix against all of them.
//
// [Sequence.Need], [Cache.Need], [Sequence.ForkNeed] and [PrefixCache.Need] say what
// an operation would take now, the pool's idle granules counted as the cache's own; a
// scheduler admits what fits in [Cache.Headroom], the governor's free bytes plus what
// eviction would give back. Waiting lives in one place, the governor's FIFO queue of
// the device: [Cache.AppendBatchCtx] and [Sequence.AppendCtx] wait there for the whole
// step's bytes behind whoever queued first, holding nothing, and are served from the
// pool's idle granules as from free budget; a plain Append or AppendBatch does not
// queue. Map-ahead (on by default on a pooling backing; Config.NoMapAhead turns it
// off) commits granules that are charged like any, and a growth takes them back
// before it would be refused.
//
// # Concurrency and lock order
//
// A Cache is safe for concurrent use. A Sequence is used by one goroutine at a time
// (Fork and Freeze read it, so they are its owner's too, and a batch step belongs to
// the owner of all its sequences); a Prefix by many. [Cache.SetScales] must not run
// while anything reads that tensor's scales. Goroutines of the package's own: the
// map-ahead worker, which touches a sequence only through its ranges' runs ahead and
// takes no lock of the cache's or a sequence's (ahead.go); a prefix cache's events
// goroutine, which takes only the prefix cache's lock and calls the observer with
// none held; and its tiers' stores. Tiers are called with none of these locks held;
// the lock of their counts is taken after all of them. The locks, in the order they
// are taken (a goroutine that holds one takes only those below it):
//
//  1. an origin's ranges lock (one sequence's: taken to resize or protect ranges that
//     a prefix cache entry referred to, and by a lookup that maps from them; no
//     goroutine holds two);
//  2. the prefix cache's lock (its index and the counts of its granules);
//  3. the cache's lock (its sequences, prefixes and counters);
//  4. map-ahead's lock (held across no backing call), then the backing's and the
//     governor's own.
//
// A function holds each lock it takes across one stretch of its body and releases it
// there; none releases a lock its caller took. A lookup takes the prefix cache's lock
// to match, releases it, and only then takes an origin's ranges lock (and the prefix
// cache's again inside it) to map. The prefix cache's reclaimer runs on a goroutine of
// the governor's, holding none of these.
package kv
