package baseline

import (
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
)

// DefaultBlockTokens is vLLM's default block size, in tokens.
const DefaultBlockTokens = 16

// DefaultChunkBytes is about how much a Paged pool grows by when it runs out of blocks.
const DefaultChunkBytes = 64 << 20

// PagedOptions configures a Paged strategy.
type PagedOptions struct {
	// BlockTokens is the tokens per block (DefaultBlockTokens when zero).
	BlockTokens int
	// ChunkBlocks is how many blocks the pool grows by at a time (about
	// DefaultChunkBytes worth when zero).
	ChunkBlocks int
	// Blocks is how many blocks NewPaged allocates and clears up front, as vLLM sizes
	// its pool at start-up; rounded up to whole chunks.
	Blocks int
	// Authority, when set, is charged for every chunk before it is allocated.
	Authority *accounting.Authority
	// PrefixCache turns on automatic prefix caching (see Paged.Lookup): full blocks
	// are indexed by a hash chain and kept, once free, in an LRU queue until their
	// block is needed.
	PrefixCache bool
}

// Paged is the vLLM design: a pool of fixed blocks, each BlockTokens tokens of every
// (layer, K|V) tensor, handed out from a free list, and a block table per sequence.
// The pool grows in chunks (each one make, cleared) and never shrinks until Close.
// Prefixes share whole blocks by reference count; a block referenced more than once
// is read-only, and a prefix's partly filled last block is copied into each sequence
// that starts from it. Its zero value is not usable; call NewPaged.
type Paged struct {
	shape       Shape
	blockTokens int
	blockBytes  int
	chunkBlocks int

	mu         sync.Mutex
	led        ledger
	chunks     [][]byte
	refs       []int32 // per block; 0 when free
	free       []int32 // free block ids, a stack
	savedBlock int64   // sum over blocks of refs-1
	seqs       int
	prefixes   int
	closed     bool
	tokens     atomic.Int64
	pc         *pagedCache // nil when prefix caching is off
}

// NewPaged returns a Paged strategy for shape with o.Blocks blocks allocated and
// cleared.
func NewPaged(s Shape, o PagedOptions) (*Paged, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	bt := o.BlockTokens
	if bt == 0 {
		bt = DefaultBlockTokens
	}
	if bt < 0 || bt > s.MaxTokens || o.ChunkBlocks < 0 || o.Blocks < 0 {
		return nil, fmt.Errorf("%w: block tokens %d (max tokens %d), chunk blocks %d, blocks %d", ErrOptions, o.BlockTokens, s.MaxTokens, o.ChunkBlocks, o.Blocks)
	}
	p := &Paged{shape: s, blockTokens: bt, blockBytes: bt * s.BytesPerToken(), led: ledger{auth: o.Authority}}
	if o.PrefixCache {
		p.pc = newPagedCache(bt)
	}
	p.chunkBlocks = o.ChunkBlocks
	if p.chunkBlocks == 0 {
		p.chunkBlocks = max(1, DefaultChunkBytes/p.blockBytes)
	}
	if p.chunkBlocks > math.MaxInt/p.blockBytes || o.Blocks > math.MaxInt32-p.chunkBlocks {
		return nil, fmt.Errorf("%w: chunks of %d blocks of %d bytes overflow", ErrOptions, p.chunkBlocks, p.blockBytes)
	}
	if o.Blocks > 0 {
		if err := p.grow(o.Blocks); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// Name returns "paged", or "paged+prefix-cache" with prefix caching on.
func (p *Paged) Name() string {
	if p.pc != nil {
		return "paged+prefix-cache"
	}
	return "paged"
}

// BlockBytes returns the bytes of one block.
func (p *Paged) BlockBytes() int { return p.blockBytes }

// grow adds whole chunks until at least n blocks are free, charging them first: on
// error nothing changed. p.mu is held (or p is not yet shared).
func (p *Paged) grow(n int) error {
	need := n - len(p.free)
	if need <= 0 {
		return nil
	}
	chunks := (need + p.chunkBlocks - 1) / p.chunkBlocks
	if len(p.refs)+chunks*p.chunkBlocks > math.MaxInt32 {
		return fmt.Errorf("%w: more than %d blocks", ErrOptions, math.MaxInt32)
	}
	chunkBytes := p.chunkBlocks * p.blockBytes
	if err := p.led.take(int64(chunks) * int64(chunkBytes)); err != nil {
		return fmt.Errorf("baseline: paged: grow by %d chunks: %w", chunks, err)
	}
	for range chunks {
		first := len(p.refs)
		p.chunks = append(p.chunks, newCleared(chunkBytes))
		p.refs = append(p.refs, make([]int32, p.chunkBlocks)...)
		if p.pc != nil {
			p.pc.grow(p.chunkBlocks)
		}
		// Push in reverse so that blocks are handed out in address order.
		for id := first + p.chunkBlocks - 1; id >= first; id-- {
			p.free = append(p.free, int32(id))
		}
	}
	return nil
}

// take pops n free blocks with one reference each, growing the pool as needed and,
// with prefix caching, then evicting the least recently used cached free blocks. p.mu
// is held. On error nothing changed.
func (p *Paged) take(n int) ([]int32, error) {
	if err := p.grow(n); err != nil {
		if p.pc == nil || len(p.free)+p.pc.n < n {
			return nil, err
		}
	}
	ids := make([]int32, n)
	for i := range ids {
		if last := len(p.free) - 1; last >= 0 {
			ids[i] = p.free[last]
			p.free = p.free[:last]
		} else {
			ids[i] = p.pc.evict()
		}
		p.refs[ids[i]] = 1
	}
	return ids, nil
}

// ref adds a reference to each block. p.mu is held.
func (p *Paged) ref(ids []int32) {
	for _, id := range ids {
		p.refs[id]++
		p.savedBlock++
	}
}

// unref drops a reference to each block and frees those left with none, last block
// first (so that with prefix caching a sequence's tail is evicted before its head, as
// vLLM does). p.mu is held.
func (p *Paged) unref(ids []int32) {
	for _, id := range slices.Backward(ids) {
		switch p.refs[id] {
		case 0:
			panic("baseline: paged block released twice")
		case 1:
			if p.pc != nil && p.pc.cached(id) {
				p.pc.push(id)
			} else {
				p.free = append(p.free, id)
			}
		default:
			p.savedBlock--
		}
		p.refs[id]--
	}
}

// block returns the bytes of block id.
func (p *Paged) block(id int32) []byte {
	c, i := int(id)/p.chunkBlocks, int(id)%p.chunkBlocks
	return p.chunks[c][i*p.blockBytes : (i+1)*p.blockBytes]
}

// off returns the offset of (tensor t, token slot i) inside a block.
func (p *Paged) off(t, i int) int { return (t*p.blockTokens + i) * p.shape.TokenBytes }

// copyBlockTokens copies the first n token slots of every tensor of block src to dst.
func (p *Paged) copyBlockTokens(dst, src int32, n int) {
	d, s := p.block(dst), p.block(src)
	for t := range p.shape.tensors() {
		copy(d[p.off(t, 0):p.off(t, n)], s[p.off(t, 0):p.off(t, n)])
	}
}

// NewSequence returns an empty sequence; it takes no block until it grows.
func (p *Paged) NewSequence() (Sequence, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	p.seqs++
	return &pagedSeq{p: p}, nil
}

// NewSequenceFrom returns a sequence whose block table starts with pf's full blocks
// (shared) and a copy of its partly filled last block.
func (p *Paged) NewSequenceFrom(pf Prefix) (Sequence, error) {
	pp, ok := pf.(*pagedPrefix)
	if !ok || pp.p != p {
		return nil, fmt.Errorf("%w: %T", ErrForeign, pf)
	}
	if pp.released {
		panic(PanicPrefixReleased)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	q := &pagedSeq{p: p, n: pp.n, shared: len(pp.full)}
	if pp.tail >= 0 {
		ids, err := p.take(1)
		if err != nil {
			return nil, err
		}
		p.copyBlockTokens(ids[0], pp.tail, pp.n%p.blockTokens)
		q.push(pp.full...)
		q.push(ids[0])
	} else {
		q.push(pp.full...)
	}
	p.ref(pp.full)
	p.seqs++
	p.tokens.Add(int64(pp.n))
	return q, nil
}

// Stats returns a snapshot; Saved counts every extra reference to a block.
func (p *Paged) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Stats{
		Sequences:    p.seqs,
		Prefixes:     p.prefixes,
		Tokens:       p.tokens.Load(),
		Physical:     p.led.physical,
		PeakPhysical: p.led.peak,
		Saved:        p.savedBlock * int64(p.blockBytes),
	}
}

// FreeBlocks returns how many blocks of the pool no sequence or prefix holds (cached
// free blocks included).
func (p *Paged) FreeBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pc != nil {
		return len(p.free) + p.pc.n
	}
	return len(p.free)
}

// Close frees the pool. It fails with ErrBusy while sequences or prefixes are live.
func (p *Paged) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	if p.seqs > 0 || p.prefixes > 0 {
		return fmt.Errorf("%w: %d sequences, %d prefixes", ErrBusy, p.seqs, p.prefixes)
	}
	p.led.give(int64(len(p.chunks)) * int64(p.chunkBlocks) * int64(p.blockBytes))
	p.chunks, p.refs, p.free = nil, nil, nil
	p.closed = true
	return nil
}

type pagedPrefix struct {
	p        *Paged
	full     []int32 // shared whole blocks
	tail     int32   // the prefix's own copy of its partly filled block, or -1
	n        int
	released bool
}

func (pp *pagedPrefix) Len() int { return pp.n }

// Release drops the prefix's references; its blocks are freed with their last user.
func (pp *pagedPrefix) Release() {
	if pp.released {
		panic(PanicPrefixReleased)
	}
	pp.released = true
	p := pp.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.unref(pp.full)
	if pp.tail >= 0 {
		p.unref([]int32{pp.tail})
	}
	p.prefixes--
}

type pagedSeq struct {
	p      *Paged
	table  []int32  // block ids
	blocks [][]byte // their bytes, looked up once so that writes take no lock
	shared int      // leading blocks that belong to a prefix: read-only
	n      int
	closed bool
}

// push appends blocks to the table. p.mu is held.
func (q *pagedSeq) push(ids ...int32) {
	for _, id := range ids {
		q.table = append(q.table, id)
		q.blocks = append(q.blocks, q.p.block(id))
	}
}

func (q *pagedSeq) live() {
	if q.closed {
		panic(PanicSequenceClosed)
	}
}

func (q *pagedSeq) Append(n int) error {
	q.live()
	p := q.p
	if err := checkAppend(p.shape, q.n, n); err != nil {
		return err
	}
	need := (q.n+n+p.blockTokens-1)/p.blockTokens - len(q.table)
	if need > 0 {
		p.mu.Lock()
		ids, err := p.take(need)
		if err == nil {
			q.push(ids...)
		}
		p.mu.Unlock()
		if err != nil {
			return err
		}
	}
	q.n += n
	p.tokens.Add(int64(n))
	return nil
}

func (q *pagedSeq) Len() int { q.live(); return q.n }

func (q *pagedSeq) WriteToken(layer int, v Kind, token int, src []byte) error {
	q.live()
	p := q.p
	if err := checkWrite(p.shape, q.n, layer, v, token, src); err != nil {
		return err
	}
	b := token / p.blockTokens
	if b < q.shared {
		return fmt.Errorf("%w: token %d", ErrReadOnly, token)
	}
	copy(q.blocks[b][p.off(tensor(layer, v), token%p.blockTokens):], src)
	return nil
}

func (q *pagedSeq) ReadToken(layer int, v Kind, token int, dst []byte) error {
	q.live()
	p := q.p
	if err := checkWrite(p.shape, q.n, layer, v, token, dst); err != nil {
		return err
	}
	copy(dst, q.blocks[token/p.blockTokens][p.off(tensor(layer, v), token%p.blockTokens):])
	return nil
}

// Freeze shares the whole blocks of the first n tokens and copies the partly filled
// one: the prefix owns that copy.
func (q *pagedSeq) Freeze(n int) (Prefix, error) {
	q.live()
	if err := checkFreeze(n, q.n); err != nil {
		return nil, err
	}
	p := q.p
	p.mu.Lock()
	defer p.mu.Unlock()
	pp := &pagedPrefix{p: p, n: n, tail: -1}
	pp.full = append([]int32(nil), q.table[:n/p.blockTokens]...)
	if rest := n % p.blockTokens; rest > 0 {
		ids, err := p.take(1)
		if err != nil {
			return nil, err
		}
		pp.tail = ids[0]
		p.copyBlockTokens(pp.tail, q.table[n/p.blockTokens], rest)
	}
	p.ref(pp.full)
	p.prefixes++
	// The blocks now belong to the prefix too: immutable from here on.
	q.shared = max(q.shared, len(pp.full))
	return pp, nil
}

// Close returns the sequence's blocks to the free list (those it shares stay with
// their other users).
func (q *pagedSeq) Close() error {
	if q.closed {
		return fmt.Errorf("%w: sequence closed twice", ErrClosed)
	}
	q.closed = true
	p := q.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.unref(q.table)
	q.table, q.blocks = nil, nil
	p.seqs--
	p.tokens.Add(-int64(q.n))
	return nil
}
