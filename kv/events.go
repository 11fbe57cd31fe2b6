package kv

// BlockEvents is told what a PrefixCache caches and evicts, in blocks of EventOptions.
// BlockSize tokens chained by their hashes (package kv/blockhash): what a cluster's
// router needs to know which replica holds a prefix (vLLM's KV events; the publisher
// that puts them on the wire lives above kv, in package kvevents).
//
// It is called on Insert, eviction and Close only, never on the token path, with the
// prefix cache's lock held: it must not block or call back into the cache, and what it
// is passed is its own to keep (the cache never touches those slices again).
type BlockEvents interface {
	BlocksStored(BlocksStored)
	BlocksRemoved(BlocksRemoved)
	AllBlocksCleared()
}

// BlocksStored announces blocks that became fully cached, each once, a chain of them
// in order: Hashes[i+1] is chained to Hashes[i], and Hashes[0] to Parent.
type BlocksStored struct {
	Hashes    []uint64 // chained block hashes, oldest first
	Parent    uint64   // hash of the block before Hashes[0]; meaningful when HasParent
	HasParent bool
	Tokens    []int32 // len(Hashes)*BlockSize token ids
	BlockSize int
	LoRA      string // "" for none
	// ExtraKeys holds, per block of Hashes, the extra keys its hash covers (vLLM's
	// extra_keys: LoRA name, cache salt), or is nil when no block has any.
	ExtraKeys [][]any
	Group     int    // layer group index; 0 until layer groups land
	Medium    string // "GPU" or "CPU", from the cache's device
}

// BlocksRemoved names blocks, each announced by an earlier BlocksStored, that the cache
// no longer holds whole.
type BlocksRemoved struct {
	Hashes []uint64
	Group  int
	Medium string
}
