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
	// block is needed. It models full attention only: with a sliding window in
	// Windows, NewPaged refuses it (ErrOptions).
	PrefixCache bool
	// Windows is, layer by layer (len Shape.Layers), the layer's sliding window in
	// tokens, 0 for full attention; nil: every layer full attention. This is vLLM's
	// hybrid KV cache manager: layers of one window are a class, each class is cut
	// into groups of as many layers (the greatest common divisor of the classes'
	// sizes, so that every group's block is the same size and the pool stays one
	// pool of one block size; vLLM pads a smaller class instead), and each group
	// has a block table of its own per sequence. A block holds BlockTokens tokens of
	// its group's layers, K and V. A window of fewer than BlockTokens tokens is
	// refused: its blocks would be dead before they fill.
	//
	// A window group keeps the tokens kv's window rule keeps (kv.Group.FirstLive of
	// a SlidingWindow group, max(0, n-Window+1)), so that memory figures compare
	// with the kv cache's: an Append that grows a sequence from n tokens first
	// gives back each window group's blocks below the one holding FirstLive(n), as
	// vLLM's SlidingWindowManager.remove_skipped_blocks does, and reading or writing
	// a token of a block given back fails with ErrDropped. Freeze(n) keeps what a
	// sequence of n tokens keeps: in a window group the blocks from the one holding
	// FirstLive(n).
	Windows []int
}

// Paged is the vLLM design: a pool of fixed blocks, each BlockTokens tokens of every
// (layer, K|V) tensor, handed out from a free list, and a block table per sequence.
// The pool grows in chunks (each one make, cleared) and never shrinks until Close.
// Prefixes share whole blocks by reference count; a block referenced more than once
// is read-only, and a prefix's partly filled last block is copied into each sequence
// that starts from it. With sliding windows (PagedOptions.Windows) each layer group
// has blocks and block tables of its own, and a window group's blocks go back to the
// free list once the window has passed them: vLLM's hybrid KV cache manager. Its zero
// value is not usable; call NewPaged.
type Paged struct {
	shape       Shape
	blockTokens int
	blockBytes  int
	chunkBlocks int
	groups      []pagedGroup // one, of every layer, when no layer has a window
	layerGroup  []int32      // per layer: its group
	plain       bool         // no layer has a window: one group of every layer, from block 0
	layerPos    []int32      // per layer: its place among its group's layers

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
// cleared. Options it can not be built from (a window list of the wrong length, a
// negative window or one under a block, a prefix cache with windows) fail with
// ErrOptions, allocating nothing.
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
	groups, layerGroup, layerPos, err := pagedGroups(s, bt, o)
	if err != nil {
		return nil, err
	}
	p := &Paged{shape: s, blockTokens: bt, groups: groups, layerGroup: layerGroup, layerPos: layerPos, led: ledger{auth: o.Authority}}
	p.plain = len(groups) == 1 && groups[0].window == 0
	p.blockBytes = bt * 2 * groups[0].layers * s.TokenBytes
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

// pagedGroup is a group of layers of one window with a block table of its own per
// sequence.
type pagedGroup struct {
	window int // 0: full attention
	layers int
}

// firstBlock returns the first block a holder of n tokens keeps of a group of window
// w: 0 for full attention, else the block holding FirstLive(n) (kv.Group.FirstLive
// of a SlidingWindow group).
func firstBlock(w, n, bt int) int {
	if w == 0 {
		return 0
	}
	return max(0, n-w+1) / bt
}

// pagedGroups cuts s's layers into groups by o.Windows (see PagedOptions.Windows).
func pagedGroups(s Shape, bt int, o PagedOptions) ([]pagedGroup, []int32, []int32, error) {
	ws := o.Windows
	if ws == nil {
		ws = make([]int, s.Layers)
	}
	if len(ws) != s.Layers {
		return nil, nil, nil, fmt.Errorf("%w: %d windows for %d layers", ErrOptions, len(ws), s.Layers)
	}
	var classes []int // windows in order of their first layer
	count := map[int]int{}
	for l, w := range ws {
		switch {
		case w < 0:
			return nil, nil, nil, fmt.Errorf("%w: layer %d: window %d is negative", ErrOptions, l, w)
		case w > 0 && w < bt:
			return nil, nil, nil, fmt.Errorf("%w: layer %d: window %d is under one block of %d tokens", ErrOptions, l, w, bt)
		}
		if count[w] == 0 {
			classes = append(classes, w)
		}
		count[w]++
	}
	if o.PrefixCache && (len(classes) > 1 || classes[0] != 0) {
		return nil, nil, nil, fmt.Errorf("%w: the prefix cache models full attention only, not sliding windows", ErrOptions)
	}
	size := 0
	for _, w := range classes {
		size = gcd(size, count[w])
	}
	var groups []pagedGroup
	layerGroup, layerPos := make([]int32, s.Layers), make([]int32, s.Layers)
	for _, w := range classes {
		seen := 0
		for l, lw := range ws {
			if lw != w {
				continue
			}
			if seen%size == 0 {
				groups = append(groups, pagedGroup{window: w, layers: size})
			}
			layerGroup[l], layerPos[l] = int32(len(groups)-1), int32(seen%size)
			seen++
		}
	}
	return groups, layerGroup, layerPos, nil
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// Name returns "paged", or "paged+prefix-cache" with prefix caching on.
func (p *Paged) Name() string {
	if p.pc != nil {
		return "paged+prefix-cache"
	}
	return "paged"
}

// BlockBytes returns the bytes of one block: BlockTokens tokens of one group's layers,
// K and V (of every layer when no layer has a window).
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
	for t := range 2 * p.groups[0].layers {
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
	return p.newSeq(0, 0), nil
}

// newSeq returns a sequence of n tokens, the first shared blocks read-only, with
// empty block tables.
func (p *Paged) newSeq(n, shared int) *pagedSeq {
	return &pagedSeq{p: p, n: n, shared: shared, gs: make([]seqGroup, len(p.groups))}
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
	tails := 0
	for _, g := range pp.gs {
		if g.tail >= 0 {
			tails++
		}
	}
	ids, err := p.take(tails)
	if err != nil {
		return nil, err
	}
	q := p.newSeq(pp.n, pp.n/p.blockTokens)
	for i, g := range pp.gs {
		qg := &q.gs[i]
		qg.first = g.first
		qg.push(p, g.full...)
		if g.tail >= 0 {
			p.copyBlockTokens(ids[0], g.tail, pp.n%p.blockTokens)
			qg.push(p, ids[0])
			ids = ids[1:]
		}
		p.ref(g.full)
	}
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
	gs       []prefixGroup // per group of p
	n        int
	released bool
}

// prefixGroup is what a prefix holds of one group.
type prefixGroup struct {
	first int     // the block full starts at: 0 but in a window group
	full  []int32 // shared whole blocks
	tail  int32   // the prefix's own copy of its partly filled block, or -1
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
	for _, g := range pp.gs {
		p.unref(g.full)
		if g.tail >= 0 {
			p.unref([]int32{g.tail})
		}
	}
	p.prefixes--
}

type pagedSeq struct {
	p      *Paged
	gs     []seqGroup // per group of p
	shared int        // blocks below this one belong to a prefix: read-only
	n      int
	closed bool
}

// seqGroup is a sequence's block table of one group.
type seqGroup struct {
	first  int      // the block table[0] is: blocks below were given back (a window)
	table  []int32  // block ids
	blocks [][]byte // their bytes, looked up once so that writes take no lock
}

// push appends blocks to the table. p.mu is held.
func (g *seqGroup) push(p *Paged, ids ...int32) {
	for _, id := range ids {
		g.table = append(g.table, id)
		g.blocks = append(g.blocks, p.block(id))
	}
}

// end returns the block past g's last.
func (g *seqGroup) end() int { return g.first + len(g.table) }

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
	blocks := (q.n + n + p.blockTokens - 1) / p.blockTokens
	if p.plain {
		// Full attention only: as before windows.
		g := &q.gs[0]
		if need := blocks - len(g.table); need > 0 {
			p.mu.Lock()
			ids, err := p.take(need)
			if err == nil {
				g.push(p, ids...)
			}
			p.mu.Unlock()
			if err != nil {
				return err
			}
		}
	} else if err := q.grow(blocks); err != nil {
		return err
	}
	q.n += n
	p.tokens.Add(int64(n))
	return nil
}

// grow gives back each window group's blocks below the one holding FirstLive of the
// sequence's length and gives every group blocks up to blocks. On error nothing
// changed: the blocks given back are taken back.
func (q *pagedSeq) grow(blocks int) error {
	p := q.p
	drop, need := 0, 0
	for i, pg := range p.groups {
		g := &q.gs[i]
		drop += max(0, firstBlock(pg.window, q.n, p.blockTokens)-g.first)
		need += max(0, blocks-g.end())
	}
	if drop == 0 && need == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	free, saved := len(p.free), p.savedBlock
	var dropped []int32
	for i, pg := range p.groups {
		g := &q.gs[i]
		d := max(0, firstBlock(pg.window, q.n, p.blockTokens)-g.first)
		dropped = append(dropped, g.table[:d]...)
	}
	p.unref(dropped) // first, so that the new blocks may be these
	ids, err := p.take(need)
	if err != nil {
		// take changed nothing: the blocks given back lie on top of the free list.
		p.free = p.free[:free]
		for _, id := range dropped {
			p.refs[id]++
		}
		p.savedBlock = saved
		return err
	}
	for i, pg := range p.groups {
		g := &q.gs[i]
		if d := max(0, firstBlock(pg.window, q.n, p.blockTokens)-g.first); d > 0 {
			g.table, g.blocks = g.table[d:], g.blocks[d:]
			g.first += d
		}
		k := max(0, blocks-g.end())
		g.push(p, ids[:k]...)
		ids = ids[k:]
	}
	return nil
}

func (q *pagedSeq) Len() int { q.live(); return q.n }

// at returns the bytes of (layer, v, token) in q, whose block is b, where p has
// windows, or ErrDropped where its window group gave that block back. Without windows
// WriteToken and ReadToken find the bytes themselves, with no group to look up, so
// that the full-attention path costs what it did before windows.
func (q *pagedSeq) at(layer int, v Kind, token, b int) ([]byte, error) {
	p := q.p
	g := &q.gs[p.layerGroup[layer]]
	if b < g.first {
		return nil, fmt.Errorf("%w: token %d of layer %d (its group holds the tokens from %d on)", ErrDropped, token, layer, g.first*p.blockTokens)
	}
	return g.blocks[b-g.first][p.off(tensor(int(p.layerPos[layer]), v), token-b*p.blockTokens):], nil
}

func (q *pagedSeq) WriteToken(layer int, v Kind, token int, src []byte) error {
	q.live()
	p := q.p
	if err := checkWrite(p.shape, q.n, layer, v, token, src); err != nil {
		return err
	}
	var dst []byte
	b := token / p.blockTokens
	if p.plain {
		// NB: no windows: the path before them, every layer's block from block 0.
		dst = q.gs[0].blocks[b][p.off(tensor(layer, v), token-b*p.blockTokens):]
	} else {
		var err error
		if dst, err = q.at(layer, v, token, b); err != nil {
			return err
		}
	}
	if b < q.shared {
		return fmt.Errorf("%w: token %d", ErrReadOnly, token)
	}
	copy(dst, src)
	return nil
}

func (q *pagedSeq) ReadToken(layer int, v Kind, token int, dst []byte) error {
	q.live()
	p := q.p
	if err := checkWrite(p.shape, q.n, layer, v, token, dst); err != nil {
		return err
	}
	var src []byte
	b := token / p.blockTokens
	if p.plain {
		src = q.gs[0].blocks[b][p.off(tensor(layer, v), token-b*p.blockTokens):] // NB: as in WriteToken
	} else {
		var err error
		if src, err = q.at(layer, v, token, b); err != nil {
			return err
		}
	}
	copy(dst, src)
	return nil
}

// Freeze shares the whole blocks of the first n tokens and copies the partly filled
// one: the prefix owns that copy. In a window group it keeps what a sequence of n
// tokens keeps, the blocks from the one holding FirstLive(n); where the sequence gave
// those back it fails with ErrDropped.
func (q *pagedSeq) Freeze(n int) (Prefix, error) {
	q.live()
	if err := checkFreeze(n, q.n); err != nil {
		return nil, err
	}
	p := q.p
	bt := p.blockTokens
	for i, pg := range p.groups {
		if first := firstBlock(pg.window, n, bt); n > 0 && first < q.gs[i].first {
			return nil, fmt.Errorf("%w: a prefix of %d tokens needs the tokens from %d on, and the sequence holds them from %d on", ErrDropped, n, first*bt, q.gs[i].first*bt)
		}
	}
	rest := n % bt
	p.mu.Lock()
	defer p.mu.Unlock()
	var ids []int32
	if rest > 0 {
		var err error
		if ids, err = p.take(len(p.groups)); err != nil {
			return nil, err
		}
	}
	pp := &pagedPrefix{p: p, n: n, gs: make([]prefixGroup, len(p.groups))}
	for i, pg := range p.groups {
		g, first := &q.gs[i], firstBlock(pg.window, n, bt)
		if n == 0 {
			first = 0 // holds nothing, whatever the sequence gave back
		}
		h := prefixGroup{first: first, tail: -1, full: []int32{}}
		if n > 0 {
			h.full = append(h.full, g.table[first-g.first:n/bt-g.first]...)
		}
		if rest > 0 {
			h.tail = ids[i]
			p.copyBlockTokens(h.tail, g.table[n/bt-g.first], rest)
		}
		p.ref(h.full)
		pp.gs[i] = h
	}
	p.prefixes++
	// The blocks now belong to the prefix too: immutable from here on.
	q.shared = max(q.shared, n/bt)
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
	for i := range q.gs {
		p.unref(q.gs[i].table)
	}
	q.gs = nil
	p.seqs--
	p.tokens.Add(-int64(q.n))
	return nil
}
