package baseline

import (
	"fmt"
	"slices"
)

// Automatic prefix caching for Paged, the vLLM way: every full block a sequence has
// computed is indexed by a hash of its tokens chained with its parent block's hash;
// a cached block that no sequence holds goes to the tail of an LRU queue of free
// blocks, and is evicted (its hash forgotten) only when the pool must hand it out
// again, the queue's head first. A lookup walks the chain block by block.
//
// NB: a lookup trusts a block when its own 16 token IDs and its parent's 64-bit hash
// match, as vLLM does: two different chains reach one block only if their parents'
// hashes collide, about k²/2⁶⁵ for k cached blocks (under 10⁻⁷ for a million). The
// kv package's radix index compares every token instead.

// PrefixStats counts what a Paged prefix cache did, in tokens, and what it holds.
type PrefixStats struct {
	Queries int64 // prompt tokens looked up (vLLM's prefix_cache_queries)
	Hits    int64 // of which found cached (vLLM's prefix_cache_hits)
	Evicted int64 // tokens of cached blocks handed out again
	// CachedBytes is the bytes of blocks the index holds (in use or free);
	// FreeCachedBytes the part no sequence holds, which the pool may evict.
	CachedBytes     int64
	FreeCachedBytes int64
}

const noBlock = -1

// pagedCache is Paged's prefix index and free-block LRU queue; p.mu guards it.
type pagedCache struct {
	bt     int
	byHash map[uint64]int32 // chained hash → block
	hash   []uint64         // per block: its chained hash, when has[id]
	parent []uint64         // per block: its parent's chained hash
	has    []bool
	toks   []int32 // per block: its bt tokens
	// LRU queue of cached blocks with no reference, oldest at head.
	prev, next []int32
	head, tail int32
	n          int

	queries, hits, evicted int64
}

func newPagedCache(bt int) *pagedCache {
	return &pagedCache{bt: bt, byHash: map[uint64]int32{}, head: noBlock, tail: noBlock}
}

// grow adds n blocks' worth of bookkeeping.
func (c *pagedCache) grow(n int) {
	c.hash = append(c.hash, make([]uint64, n)...)
	c.parent = append(c.parent, make([]uint64, n)...)
	c.has = append(c.has, make([]bool, n)...)
	c.toks = append(c.toks, make([]int32, n*c.bt)...)
	for range n {
		c.prev = append(c.prev, noBlock)
		c.next = append(c.next, noBlock)
	}
}

func (c *pagedCache) cached(id int32) bool { return c.has[id] }

// push puts a cached block that lost its last reference at the queue's tail.
func (c *pagedCache) push(id int32) {
	c.prev[id], c.next[id] = c.tail, noBlock
	if c.tail != noBlock {
		c.next[c.tail] = id
	} else {
		c.head = id
	}
	c.tail = id
	c.n++
}

// unlink takes block id out of the queue.
func (c *pagedCache) unlink(id int32) {
	p, n := c.prev[id], c.next[id]
	if p != noBlock {
		c.next[p] = n
	} else {
		c.head = n
	}
	if n != noBlock {
		c.prev[n] = p
	} else {
		c.tail = p
	}
	c.prev[id], c.next[id] = noBlock, noBlock
	c.n--
}

// evict pops the queue's head, forgets its hash and returns it.
func (c *pagedCache) evict() int32 {
	id := c.head
	c.unlink(id)
	c.forget(id)
	c.evicted += int64(c.bt)
	return id
}

func (c *pagedCache) forget(id int32) {
	if c.byHash[c.hash[id]] == id {
		delete(c.byHash, c.hash[id])
	}
	c.has[id] = false
}

func (c *pagedCache) blockTokens(id int32) []int32 {
	return c.toks[int(id)*c.bt : (int(id)+1)*c.bt]
}

// chain returns the hash of a block of tokens whose parent's hash is h (FNV-1a over
// the token IDs, seeded with h).
func chain(h uint64, tokens []int32) uint64 {
	const prime = 1099511628211
	h ^= 14695981039346656037
	for _, t := range tokens {
		h = (h ^ uint64(uint32(t))) * prime
	}
	return h
}

// find returns the cached block for tokens (one block) whose parent's hash is parent.
func (c *pagedCache) find(parent uint64, tokens []int32) (int32, uint64, bool) {
	h := chain(parent, tokens)
	id, ok := c.byHash[h]
	if !ok || c.parent[id] != parent || !slices.Equal(c.blockTokens(id), tokens) {
		return noBlock, h, false
	}
	return id, h, true
}

// match returns the cached blocks holding the longest run of whole blocks of tokens,
// leaving out the last token (it must be computed again for its logits, as vLLM
// does).
func (c *pagedCache) match(tokens []int32) []int32 {
	var ids []int32
	var h uint64
	for i := 0; (i+1)*c.bt <= len(tokens)-1; i++ {
		id, nh, ok := c.find(h, tokens[i*c.bt:(i+1)*c.bt])
		if !ok {
			break
		}
		ids = append(ids, id)
		h = nh
	}
	return ids
}

// Lookup returns a sequence that starts with the longest run of whole blocks of tokens
// the prefix cache holds, sharing those blocks, and how many tokens that is. The last
// token of tokens is never matched: a server computes it again for its logits. It
// counts len(tokens) queries and the matched tokens as hits. Prefix caching must be
// on (PagedOptions.PrefixCache), else it fails with ErrOptions. The sequence MUST be
// closed.
func (p *Paged) Lookup(tokens []int32) (Sequence, int, error) {
	if p.pc == nil {
		return nil, 0, fmt.Errorf("%w: prefix caching is off", ErrOptions)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, 0, ErrClosed
	}
	c := p.pc
	ids := c.match(tokens)
	for _, id := range ids {
		if p.refs[id] == 0 {
			c.unlink(id)
		}
	}
	n := len(ids) * p.blockTokens
	if n > p.shape.MaxTokens {
		return nil, 0, fmt.Errorf("%w: %d cached tokens, MaxTokens %d", ErrTooLong, n, p.shape.MaxTokens)
	}
	c.queries += int64(len(tokens))
	c.hits += int64(n)
	q := p.newSeq(n, len(ids))
	q.gs[0].push(p, ids...)
	for _, id := range ids {
		// A block taken from the queue had no reference; ref counts a sharer.
		if p.refs[id] == 0 {
			p.refs[id] = 1
		} else {
			p.refs[id]++
			p.savedBlock++
		}
	}
	p.seqs++
	p.tokens.Add(int64(n))
	return q, n, nil
}

// Insert indexes the whole blocks of seq's first tokens, whose IDs are tokens (at most
// seq.Len() of them are used), so that later lookups find them; blocks another
// sequence already cached for the same tokens are left as they are. The indexed
// blocks become read-only in seq. seq must come from p; prefix caching must be on.
func (p *Paged) Insert(seq Sequence, tokens []int32) error {
	if p.pc == nil {
		return fmt.Errorf("%w: prefix caching is off", ErrOptions)
	}
	q, ok := seq.(*pagedSeq)
	if !ok || q.p != p {
		return fmt.Errorf("%w: %T", ErrForeign, seq)
	}
	q.live()
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.pc
	nb := min(q.n, len(tokens)) / p.blockTokens
	var h uint64
	for i := range nb {
		blk := tokens[i*p.blockTokens : (i+1)*p.blockTokens]
		if _, nh, ok := c.find(h, blk); ok {
			h = nh
			continue
		}
		id := q.gs[0].table[i]
		if c.has[id] {
			// The block is indexed under other tokens: it can not be, since a
			// cached block is read-only; refuse rather than corrupt the index.
			return fmt.Errorf("%w: block %d of the sequence is cached for other tokens", ErrRange, i)
		}
		nh := chain(h, blk)
		if _, taken := c.byHash[nh]; !taken {
			c.byHash[nh] = id
			c.hash[id], c.parent[id], c.has[id] = nh, h, true
			copy(c.blockTokens(id), blk)
		}
		h = nh
	}
	q.shared = max(q.shared, nb)
	return nil
}

// PrefixStats returns a snapshot of the prefix cache's counters (zero when it is off).
func (p *Paged) PrefixStats() PrefixStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.pc
	if c == nil {
		return PrefixStats{}
	}
	return PrefixStats{
		Queries: c.queries, Hits: c.hits, Evicted: c.evicted,
		CachedBytes:     int64(len(c.byHash)) * int64(p.blockBytes),
		FreeCachedBytes: int64(c.n) * int64(p.blockBytes),
	}
}
