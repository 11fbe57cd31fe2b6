package main

import (
	"errors"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/kv/blockhash"
)

// errEvents is matched by an event the index can not apply: one that does not
// follow what the replica announced before.
var errEvents = errors.New("router: events out of step")

// Index is a router's view of which replica holds which block, by keys of its own:
// as llm-d's indexer does, it recomputes each announced block's key from the event's
// token IDs (chained FNV-64a over CBOR, package blockhash, under a seed of its own)
// rather than trust the replicas' hashes, and keeps each replica's hash of a block
// only to apply that replica's removals. Many goroutines may use it at once.
type Index struct {
	h *blockhash.Hasher

	mu sync.Mutex
	// holders maps a block's key to the replicas that hold it, a bit each.
	holders map[blockhash.Hash]uint64
	// engine maps, per replica, the hash it announced a block by to the block's key.
	engine []map[uint64]blockhash.Hash
	errs   int64
}

// NewIndex returns an empty index of replicas (at most 64) over blocks of blockSize
// tokens, its keys seeded by seed.
func NewIndex(replicas, blockSize int, seed string) (*Index, error) {
	if replicas < 1 || replicas > 64 {
		return nil, fmt.Errorf("router: %d replicas, want 1 to 64", replicas)
	}
	h, err := blockhash.New(blockhash.Options{BlockSize: blockSize, Seed: seed})
	if err != nil {
		return nil, err
	}
	x := &Index{h: h, holders: map[blockhash.Hash]uint64{}, engine: make([]map[uint64]blockhash.Hash, replicas)}
	for i := range x.engine {
		x.engine[i] = map[uint64]blockhash.Hash{}
	}
	return x, nil
}

// BlockSize returns the tokens of a block.
func (x *Index) BlockSize() int { return x.h.BlockSize() }

// Stored applies a BlockStored of replica r: the block after the one r announced as
// parent (or the first block of a prompt), then each next one.
func (x *Index) Stored(r int, hashes []uint64, parent uint64, hasParent bool, tokens []int32, blockSize int, extra [][]any) error {
	bs := x.h.BlockSize()
	if blockSize != bs || len(tokens) != len(hashes)*bs || extra != nil && len(extra) != len(hashes) {
		x.fail()
		return fmt.Errorf("%w: replica %d: %d hashes, %d tokens of blocks of %d (the index's are %d)", errEvents, r, len(hashes), len(tokens), blockSize, bs)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	key := x.h.Root()
	if hasParent {
		k, ok := x.engine[r][parent]
		if !ok {
			x.errs++
			return fmt.Errorf("%w: replica %d: parent %x was never announced", errEvents, r, parent)
		}
		key = k
	}
	for i, eh := range hashes {
		var ek []any
		if extra != nil {
			ek = extra[i]
		}
		key = x.h.Block(key, tokens[i*bs:(i+1)*bs], ek)
		x.engine[r][eh] = key
		x.holders[key] |= 1 << r
	}
	return nil
}

// Removed applies a BlockRemoved of replica r.
func (x *Index) Removed(r int, hashes []uint64) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	var err error
	for _, eh := range hashes {
		key, ok := x.engine[r][eh]
		if !ok {
			x.errs++
			err = fmt.Errorf("%w: replica %d: removed %x was never announced", errEvents, r, eh)
			continue
		}
		delete(x.engine[r], eh)
		if x.holders[key] &^= 1 << r; x.holders[key] == 0 {
			delete(x.holders, key)
		}
	}
	return err
}

// Cleared applies an AllBlocksCleared of replica r.
func (x *Index) Cleared(r int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, key := range x.engine[r] {
		if x.holders[key] &^= 1 << r; x.holders[key] == 0 {
			delete(x.holders, key)
		}
	}
	clear(x.engine[r])
}

func (x *Index) fail() {
	x.mu.Lock()
	x.errs++
	x.mu.Unlock()
}

// Errors returns how many events the index could not apply.
func (x *Index) Errors() int64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.errs
}

// Keys returns the keys of the full blocks of a prompt's tokens (no extra keys: the
// replicas here serve no LoRA and no salt).
func (x *Index) Keys(tokens []int32) []blockhash.Hash {
	return x.h.Chain(nil, x.h.Root(), 0, tokens)
}

// Match returns, for each replica, how many of keys it holds in a row from the
// first: llm-d's longest-prefix score (LongestPrefixScorer in llm-d/llm-d-kv-cache,
// pkg/kvcache/kvblock_scorer.go), with every medium weighted 1.
func (x *Index) Match(keys []blockhash.Hash, replicas int) []int {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := make([]int, replicas)
	active := uint64(1)<<replicas - 1
	for _, k := range keys {
		if active &= x.holders[k]; active == 0 {
			break
		}
		for r := range out {
			if active&(1<<r) != 0 {
				out[r]++
			}
		}
	}
	return out
}

// Held returns the keys of the blocks the index says replica r holds.
func (x *Index) Held(r int) map[blockhash.Hash]bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := make(map[blockhash.Hash]bool, len(x.engine[r]))
	for _, k := range x.engine[r] {
		out[k] = true
	}
	return out
}
