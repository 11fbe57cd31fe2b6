package kv

import (
	"encoding/binary"
	"slices"
)

// The events of a prefix cache on a model of several layer groups, as vLLM's hybrid
// KV cache reports them (read at github.com/vllm-project/vllm):
//
//   - vllm/v1/core/block_pool.py: BlockPool.cache_full_blocks announces one
//     BlockStored per group and call, with group_idx the KV cache group's index, its
//     block_hashes only the blocks the group caches (it skips a window group's null
//     blocks, those outside the window), its parent the chain's block before the
//     first; _maybe_evict_cached_block sends one BlockRemoved per evicted block, with
//     that block's group_idx. The hash is the one chain over the request's tokens
//     (request.block_hashes) in every group; the cache keys a block by hash and group.
//   - vllm/v1/core/kv_cache_manager.py: KVCacheManager.take_events sets each
//     BlockStored's kv_cache_spec_kind and kv_cache_spec_sliding_window from its
//     group's spec; BlockRemoved carries group_idx alone.
//   - vllm/v1/kv_cache_interface.py: get_kv_cache_spec_kind names FullAttentionSpec
//     "full_attention", MLAAttentionSpec "mla_attention", SlidingWindowSpec
//     "sliding_window", ChunkedLocalAttentionSpec "chunked_local_attention";
//     get_kv_cache_spec_sliding_window is the spec's sliding_window for a
//     SlidingWindowSpec and None for any other (a chunk is no window). Package
//     kvevents writes those names from BlocksStored's Attention and Window.
//
// Here a group's index is its index in Model.Groups (vLLM may split one kind's layers
// into several groups of equal size; this cache keeps Model's). The full and MLA
// groups hold every token of the index: each is told of root's tree (announce,
// withdraw), one event per group. A window group holds, in each entry, the tokens
// from the first its window units still hold (evPath.from) to the entry's end: its
// blocks are those some entry holds whole there, counted per entry (evSide.held), and
// it is told of a block when its count leaves 0 (BlocksStored, a run of consecutive
// blocks per event, Parent the chain's block before, announced in that group or not)
// and when it comes back to 0 (BlocksRemoved, which names exactly the hashes
// announced). Where vLLM's window BlockStored spans the tokens of the blocks it
// skipped too, these carry exactly their blocks' tokens (len(Hashes)*BlockSize).
//
// The counts change, in the events' goroutine, on the changes the cache queues: an
// entry inserted holds nothing in its window groups until an evFrom per group says
// from where it holds (Insert queues them after the insert, eviction when it gives
// older window units back); an evCut moves its end; an entry that leaves the index
// (evCut gone, evDrop) holds nothing more. A block the tree withdraws must hold no
// window count: only its own entry held it, and gave it back first.

// evGroup is a layer group as its events name it.
type evGroup struct {
	idx    int // in Model.Groups
	kind   Attention
	window int
}

// evPath is an entry's inserted path, and what the entry holds of it.
type evPath struct {
	sp     *evSpace // its namespace's part
	tokens []int32
	n      int   // the tokens the index holds of it, and the entry (its end)
	from   []int // per window group (evSide.wins), the first token the entry holds there
}

// evWinKey is a window group's count of a block: wins[w], the announced block b.
type evWinKey struct {
	b *evBlock
	w int
}

// fill writes block i of path into ev.key.
func (ev *evSide) fill(path []int32, i int) {
	for j, t := range path[i*ev.bs : (i+1)*ev.bs] {
		binary.LittleEndian.PutUint32(ev.key[4*j:], uint32(t))
	}
}

// tellStored tells the observer of st, announced in root's tree, in each full or
// MLA group, each call with slices of its own (st's Tokens are the path's: copied).
func (ev *evSide) tellStored(st BlocksStored) {
	tokens, hashes, extra := st.Tokens, st.Hashes, st.ExtraKeys
	for i, g := range ev.full {
		st.Group, st.Attention = g.idx, g.kind
		st.Tokens = slices.Clone(tokens)
		if i > 0 {
			st.Hashes, st.ExtraKeys = slices.Clone(hashes), slices.Clone(extra)
		}
		ev.obs.BlocksStored(st)
	}
}

// tellRemoved tells the observer of rm, withdrawn from root's tree, in each full or
// MLA group.
func (ev *evSide) tellRemoved(rm BlocksRemoved) {
	hashes := rm.Hashes
	for i, g := range ev.full {
		rm.Group = g.idx
		if i > 0 {
			rm.Hashes = slices.Clone(hashes)
		}
		ev.obs.BlocksRemoved(rm)
	}
}

// unheld panics unless no window group's entry holds b, which root's tree withdraws.
func (ev *evSide) unheld(b *evBlock) {
	if len(ev.held) == 0 {
		return
	}
	for w := range ev.wins {
		if ev.held[evWinKey{b, w}] != 0 {
			panic(panicEventsOutOfStep)
		}
	}
}

// along returns the announced blocks of path's first n blocks, of namespace sp
// (ev.chain's array).
func (ev *evSide) along(sp *evSpace, path []int32, n int) []*evBlock {
	chain := ev.chain[:0]
	cur := &sp.root
	for i := range n {
		ev.fill(path, i)
		b := ev.blocks[evKey{cur, string(ev.key)}]
		if b == nil {
			panic(panicEventsOutOfStep) // a window holds what the index does not
		}
		chain = append(chain, b)
		cur = b
	}
	ev.chain = chain
	return chain
}

// span returns the blocks an entry holds whole from token from to token n: [a, b),
// empty as [0, 0).
func (ev *evSide) span(from, n int) (int, int) {
	a, b := (from+ev.bs-1)/ev.bs, n/ev.bs
	if a >= b {
		return 0, 0
	}
	return a, b
}

// holdWin moves what p's entry holds in window group wins[w] to its tokens [from, n),
// telling the observer of the blocks no entry holds there any more, then of those
// some entry holds now and none did; p.from[w] becomes from (p.n is the caller's).
func (ev *evSide) holdWin(p *evPath, w, from, n int) {
	a0, b0 := ev.span(p.from[w], p.n)
	a1, b1 := ev.span(from, n)
	p.from[w] = from
	if b0 == 0 && b1 == 0 {
		return
	}
	chain := ev.along(p.sp, p.tokens, max(b0, b1))
	in := func(i, a, b int) bool { return i >= a && i < b }
	g := ev.wins[w]
	var gone []uint64
	for i := a0; i < b0; i++ {
		if in(i, a1, b1) {
			continue
		}
		k := evWinKey{chain[i], w}
		switch c := ev.held[k]; {
		case c <= 0:
			panic(panicEventsOutOfStep)
		case c == 1:
			delete(ev.held, k)
			gone = append(gone, chain[i].hash.Uint64())
		default:
			ev.held[k] = c - 1
		}
	}
	if gone != nil {
		ev.obs.BlocksRemoved(BlocksRemoved{Hashes: gone, Group: g.idx, Medium: ev.medium})
	}
	run := -1 // the first block of a run of blocks newly held, or -1
	for i := a1; i <= b1; i++ {
		fresh := false
		if i < b1 && !in(i, a0, b0) {
			k := evWinKey{chain[i], w}
			ev.held[k]++
			fresh = ev.held[k] == 1
		}
		switch {
		case fresh && run < 0:
			run = i
		case !fresh && run >= 0:
			ev.storeRun(g, p.sp, p.tokens, chain, run, i)
			run = -1
		}
	}
}

// storeRun tells the observer of blocks [from, to) of path, of namespace sp, whose
// announced blocks are chain, as stored in window group g.
func (ev *evSide) storeRun(g evGroup, sp *evSpace, path []int32, chain []*evBlock, from, to int) {
	bs := ev.bs
	st := BlocksStored{
		Hashes: make([]uint64, 0, to-from), HasParent: from > 0, Attention: g.kind,
		Tokens: slices.Clone(path[from*bs : to*bs]), BlockSize: bs, LoRA: sp.lora,
		Group: g.idx, Window: g.window, Medium: ev.medium,
	}
	if st.HasParent {
		st.Parent = chain[from-1].hash.Uint64()
	}
	for i := from; i < to; i++ {
		extra := sp.h.ExtraKeys(i)
		if extra != nil && st.ExtraKeys == nil {
			st.ExtraKeys = make([][]any, i-from, to-from)
		}
		if st.ExtraKeys != nil {
			st.ExtraKeys = append(st.ExtraKeys, extra)
		}
		st.Hashes = append(st.Hashes, chain[i].hash.Uint64())
	}
	ev.obs.BlocksStored(st)
}
