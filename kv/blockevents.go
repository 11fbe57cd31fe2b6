package kv

import "github.com/vmarena/vmarena/kv/blockhash"

// The observer of a prefix cache's blocks, and what it is told: the API of the
// events, which events.go (one group) and events_groups.go (several) produce.

// BlockEvents is told what a PrefixCache caches and evicts, in blocks of EventOptions.
// BlockSize tokens chained by their hashes (package kv/blockhash): what a cluster's
// router needs to know which replica holds a prefix (vLLM's KV events; the publisher
// that puts them on the wire lives above kv, in package kvevents). A server passes
// kvevents' Publisher; it implements this itself only to read the events in its own
// process (a router in the same binary, a test).
//
// It is told of what Insert, eviction and Close change, never of the token path, and
// not on the caller's goroutine: the cache queues each change to a goroutine of its
// own (what it then computes, the block hashes among it, would cost the cache's calls
// many times their own time), which tells the observer in the order of the changes;
// PrefixCache.FlushEvents waits for it, and Close returns once AllBlocksCleared has
// been told. Its calls must not block for long or call back into the cache, and what
// it is passed is its own to keep (the cache never touches those slices again).
//
// NB: on a model of one full-attention or MLA group, the blocks of a prompt it has been
// told of and not told of again are the whole blocks of the prompt's first Match(prompt
// plus any one token) tokens: Match never counts a prompt's last token, so the extra token makes
// it count the whole prompt. On a model of window groups Match answers the hit rule
// (each window group's blocks before the match held too), which a router applies to
// the groups' blocks itself, as it does for vLLM's.
type BlockEvents interface {
	BlocksStored(BlocksStored)
	BlocksRemoved(BlocksRemoved)
	AllBlocksCleared()
}

// BlocksStored announces blocks that became fully cached in one layer group, each
// once, a chain of them in order: Hashes[i+1] is chained to Hashes[i], and Hashes[0]
// to Parent. An observer (BlockEvents) reads it; a server never makes one.
//
// On a model of several groups each group's blocks are announced apart, with its
// index in Model.Groups (vLLM's group_idx), its attention kind and its window: a full
// or MLA group's blocks are those of every token the index holds; a window group's
// (SlidingWindow, ChunkedLocal) are the blocks some entry holds whole in that group,
// from the first token its window units still hold on (see prefixcache_groups.go).
// The hashes are the one chain over the tokens in every group (a block has the same
// hash in each; Group tells them apart), so a window group's Parent is the hash of the
// block before, whether that group holds it or not.
type BlocksStored struct {
	Hashes    []uint64 // chained block hashes, oldest first
	Parent    uint64   // hash of the block before Hashes[0]; meaningful when HasParent
	HasParent bool
	// Attention is the group's kind (kvevents sends it as vLLM's kv_cache_spec_kind);
	// 0 for none.
	Attention Attention
	Tokens    []int32 // len(Hashes)*BlockSize token ids
	BlockSize int
	LoRA      string // "" for none
	// ExtraKeys holds, per block of Hashes, the extra keys its hash covers (vLLM's
	// extra_keys: LoRA name, cache salt), or is nil when no block has any.
	ExtraKeys [][]any
	Group     int // the layer group's index in Model.Groups
	// Window is the group's Window in tokens (a SlidingWindow's window, a
	// ChunkedLocal's chunk), 0 for a full or MLA group.
	Window int
	Medium string // "GPU" or "CPU", from the cache's device
}

// BlocksRemoved names blocks, each announced by an earlier BlocksStored of the same
// Group, that the cache no longer holds whole in that group. An observer (BlockEvents)
// reads it; a server never makes one.
type BlocksRemoved struct {
	Hashes []uint64
	Group  int
	Medium string
}

// EventOptions configures what a PrefixCache tells a BlockEvents
// (PrefixCacheOptions.Events). Set it when a router reads the cache's block events
// (kvevents); a cache without an observer needs none.
type EventOptions struct {
	// Observer is told what the cache caches and evicts; nil means no events, at no
	// cost.
	Observer BlockEvents
	// Hash sets the blocks: their size (16 tokens when 0; more than the cache's
	// MaxTokens is refused with ErrConfig, since no sequence could hold one whole), the
	// hash algorithm, its seed, and the extra keys (LoRA name, cache salt) the default
	// namespace's hashes cover; another Namespace's Adapter and Salt take their place
	// where set (see Namespace).
	Hash blockhash.Options
	// Medium names the cache's memory in events; "" means "GPU" for a device's cache,
	// "CPU" for the host's.
	Medium string
}
