package kv

import (
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/vmarena/vmarena/backing"
)

// Layout says how a sequence's K and V tensors lie in address space (Config.Layout):
// pick the one the attention kernel reads. Leave it Blocked unless the kernel needs
// each layer's tensor contiguous.
type Layout uint8

const (
	// Blocked, the default, for a kernel that reads a layer block by block, puts all
	// layers in one range cut into blocks: a block is
	// whole granules that hold T tokens of every layer (chosen per group so that no
	// byte or few are dead, blocks.go; Config.BlockTokens overrides), layer-major
	// inside ([layer][K|V][T tokens][KVHeads][HeadDim]), or cut into runs of R tokens
	// of every layer, layer-major inside each run ([T/R runs][layer][K|V][R tokens]
	// [KVHeads][HeadDim]) where Config.RunTokens asks. So a sequence has one growth
	// frontier and at most one partly filled block, a block is committed when its
	// first token arrives, and each layer's K and V of a block (of a run) are one
	// contiguous run (64 KiB of Llama-3-8B at 2 MiB granules): attention reads a
	// layer run by run. A layer's tensor is a strided tensor of [blocks, T, KVHeads,
	// HeadDim], or [blocks, T/R, R, KVHeads, HeadDim] with runs (View,
	// Cache.LayerStrides); the bytes at a block's end that hold no whole token are
	// waste (Config.Size).
	Blocked Layout = 0
	// PerLayer, for a kernel that needs each tensor contiguous, gives every (layer,
	// K|V) tensor its own range (Sequence.Bytes); a sequence has 2 × Layers growth
	// frontiers, so up to 2 × Layers partly filled granules: up to 128 MiB per
	// sequence for Llama-3-8B at 2 MiB granules, 4 MiB at 64 KiB.
	//
	// NB: 1 was a token-major layout (all layers of a token together), removed
	// because it read slowest everywhere (BENCHMARKS.md); PerLayer keeps its value,
	// and a Config with Layout 1 is refused with ErrConfig.
	PerLayer Layout = 2
)

// String returns the layout's name as logs and flags print it ("blocked").
func (l Layout) String() string {
	switch l {
	case Blocked:
		return "blocked"
	case PerLayer:
		return "per-layer"
	}
	return fmt.Sprintf("Layout(%d)", uint8(l))
}

// shape is where a layout puts a sequence's tokens on a backing's granules: the byte
// arithmetic every operation shares. Sharing (Freeze, forks, the prefix cache) works
// in whole units: a block in the Blocked layout, a granule otherwise.
type shape struct {
	layout Layout
	nbuf   int // address ranges per sequence
	// row is the bytes from one token to the next within a tensor's run: TokenBytes
	// in both layouts (a PerLayer range holds one tensor; a block holds each tensor's
	// tokens together).
	row int
	tb  int // TokenBytes
	// kinds is the tensors each layer has, in order (K, V); places is every tensor of
	// a sequence, layer after layer and each layer's kinds in order: a list, so that
	// nothing but this file knows how many tensors a layer has.
	kinds  []Kind
	places []place
	tpb    int // Blocked: tokens per block; else 0
	blk    int // Blocked: bytes per block, whole granules; else 0
	// rt is the Blocked layout's tokens per run (a power of two that divides tpb, or
	// tpb: one run a block) and rs a run's bytes (every tensor's rt tokens); rsh and
	// rmask find a token's run within its block with no division: its run is
	// in>>rsh and its place in the run in&rmask (rsh 62 and rmask -1 where a block is
	// one run, so that both give the run 0 and the token's place in the block).
	rt, rs     int
	rsh, rmask int
	unit       int // bytes of a sharing unit: blk, or a granule
	capac      int // bytes reserved per range (granule-aligned)
	// state is a recurrent group's bytes (every layer's state, in one range), held
	// from a sequence's first token on and copied, never shared; 0 for the others.
	state int
}

// newGroupShape returns the shape of one valid layer group in layout on granules of
// granule bytes with blocks of at least blockTokens tokens (0: the default) cut into
// runs of runTokens (0: the default, see runFor), reserving maxTokens per sequence:
// its layers, in the group's order, are the shape's layers, and its blocks are
// Group.block's (blocks.go). A recurrent group's shape is one range that holds every
// layer's state, layer after layer, from the sequence's first token on.
func newGroupShape(g Group, layout Layout, granule, blockTokens, runTokens, maxTokens int) (shape, error) {
	if !backing.IsPowerOfTwo(granule) || maxTokens < 0 {
		return shape{}, fmt.Errorf("%w: granule %d, max tokens %d", ErrConfig, granule, maxTokens)
	}
	if blockTokens < 0 || blockTokens > 0 && layout != Blocked {
		return shape{}, fmt.Errorf("%w: BlockTokens %d with layout %v (only Blocked has blocks; 0 is its default)", ErrConfig, blockTokens, layout)
	}
	if runTokens < 0 || runTokens > 0 && (layout != Blocked || !backing.IsPowerOfTwo(runTokens)) {
		return shape{}, fmt.Errorf("%w: RunTokens %d with layout %v (a power of two, in Blocked only; 0 is its default)", ErrConfig, runTokens, layout)
	}
	if layout != Blocked && layout != PerLayer {
		return shape{}, fmt.Errorf("%w: layout %v", ErrConfig, layout)
	}
	sh := shape{layout: layout, tb: g.TokenBytes(), kinds: g.kinds(), unit: granule}
	if g.Kind == Recurrent {
		sh.nbuf, sh.state = 1, len(g.Layers)*g.StateBytes // validate bounds it
		sh.capac, _ = backing.AlignUp(sh.state, granule)
		return sh, nil
	}
	nt := len(g.Layers) * len(sh.kinds)
	var extent int
	switch layout {
	case Blocked:
		b, err := g.block(granule, blockTokens)
		if err != nil {
			return shape{}, err
		}
		sh.nbuf, sh.row = 1, sh.tb
		sh.blk, sh.tpb, sh.unit = b.Bytes, b.Tokens, b.Bytes
		sh.rt = runFor(sh.tpb, runTokens)
		sh.rs, sh.rsh, sh.rmask = sh.rt*nt*sh.tb, 62, -1
		if sh.rt < sh.tpb {
			sh.rsh, sh.rmask = bits.TrailingZeros(uint(sh.rt)), sh.rt-1
		}
		if units := maxTokens/sh.tpb + 1; units > (math.MaxInt-granule)/sh.blk {
			return shape{}, fmt.Errorf("%w: %d tokens in blocks of %d bytes overflow", ErrConfig, maxTokens, sh.blk)
		}
		extent = sh.extent(maxTokens)
	case PerLayer:
		sh.nbuf, sh.row = nt, sh.tb
		if maxTokens > math.MaxInt/sh.row-granule {
			return shape{}, fmt.Errorf("%w: %d tokens of %d bytes overflow", ErrConfig, maxTokens, sh.row)
		}
		extent = maxTokens * sh.row
	default:
		return shape{}, fmt.Errorf("%w: layout %v", ErrConfig, layout)
	}
	sh.places = make([]place, nt)
	for i := range sh.places {
		sh.places[i] = sh.placeOf(i)
	}
	sh.capac, _ = backing.AlignUp(extent, granule)
	if sh.capac > 0 && int64(sh.nbuf) > math.MaxInt64/int64(sh.capac) {
		return shape{}, fmt.Errorf("%w: %d ranges of %d bytes overflow", ErrConfig, sh.nbuf, sh.capac)
	}
	return sh, nil
}

// extent returns the bytes at the start of each range that n tokens occupy: whole
// blocks in the Blocked layout (a block's last layer lies at its end).
func (sh *shape) extent(n int) int {
	if sh.state > 0 {
		return min(n, 1) * sh.state
	}
	if sh.layout == Blocked {
		return sh.unitsFor(n) * sh.blk
	}
	return n * sh.row
}

// unitsFor returns the sharing units that hold n tokens, the last one perhaps partly.
func (sh *shape) unitsFor(n int) int {
	if sh.state > 0 {
		return (sh.extent(n) + sh.unit - 1) / sh.unit
	}
	if sh.layout == Blocked {
		return (n + sh.tpb - 1) / sh.tpb
	}
	return (n*sh.row + sh.unit - 1) / sh.unit
}

// fullUnits returns the whole sharing units below n tokens: those a sequence started
// on n tokens maps rather than copies.
func (sh *shape) fullUnits(n int) int {
	if sh.state > 0 {
		return 0 // a recurrent state is copied, never shared
	}
	if sh.layout == Blocked {
		return n / sh.tpb
	}
	return n * sh.row / sh.unit
}

// shareable returns the bytes of the whole sharing units below n tokens.
func (sh *shape) shareable(n int) int { return sh.fullUnits(n) * sh.unit }

// tokensWithin returns the tokens wholly within the first b bytes of each range.
func (sh *shape) tokensWithin(b int) int {
	if sh.layout == Blocked {
		return b / sh.blk * sh.tpb
	}
	return b / sh.row
}

// tokensIn returns the tokens wholly held by sharing units [0, k).
func (sh *shape) tokensIn(k int) int { return sh.tokensWithin(k * sh.unit) }

// writableFrom returns the first token that lies wholly past the first frozen bytes
// of each range.
func (sh *shape) writableFrom(frozen int) int {
	if sh.layout == Blocked {
		return (frozen + sh.blk - 1) / sh.blk * sh.tpb
	}
	return (frozen + sh.row - 1) / sh.row
}

// place is where one tensor of a sequence lies: the index of the range that holds it
// among the sequence's ranges, and the byte offset of its token 0 in that range.
type place struct{ buf, off int }

// placeOf returns where the layout puts a sequence's tensor i (of places): in
// Blocked, its place in a block's first run.
func (sh *shape) placeOf(i int) place {
	if sh.layout == Blocked {
		return place{0, i * sh.rt * sh.tb}
	}
	return place{i, 0}
}

// runFor returns the tokens of each run of a block of tpb tokens for a
// Config.RunTokens of runTokens (a power of two, or 0): runTokens where it divides
// the block into more than one run, else the whole block (the default, a run that
// holds the block, or one that does not divide it: each group's Strides say which).
func runFor(tpb, runTokens int) int {
	if runTokens == 0 || runTokens >= tpb || tpb%runTokens != 0 {
		return tpb
	}
	return runTokens
}

// tensorIndex returns the index of layer's tensor of kind among the shape's tensors
// (places: layer after layer, each layer's kinds in order). ok is false when the
// layer or the kind is not one the geometry has.
func (sh *shape) tensorIndex(layer int, kind Kind) (i int, ok bool) {
	k := len(sh.kinds)
	if layer < 0 || layer >= len(sh.places)/max(k, 1) {
		return 0, false
	}
	j := slices.Index(sh.kinds, kind)
	if j < 0 {
		return 0, false
	}
	return layer*k + j, true
}

// tensor returns where layer's tensor of kind lies (see place). ok is false when the
// layer or the kind is not one the geometry has.
func (sh *shape) tensor(layer int, kind Kind) (buf, off int, ok bool) {
	i, ok := sh.tensorIndex(layer, kind)
	if !ok {
		return 0, 0, false
	}
	p := sh.places[i]
	return p.buf, p.off, true
}

// offset returns the byte offset of token t of the tensor whose token 0 lies at off.
func (sh *shape) offset(off, t int) int {
	at, _ := sh.tokenAt(off, t, 0)
	return at
}

// tokenAt returns offset(off, t), and whether token t lies below
// writableFrom(frozen) (in memory shared with a prefix or a fork), with one division
// where the two take three: in the Blocked layout t is below it exactly when its
// block starts below frozen bytes, elsewhere when its row does. A block's run is
// found by a shift (rsh, rmask), with no second division.
func (sh *shape) tokenAt(off, t, frozen int) (at int, shared bool) {
	if sh.layout == Blocked {
		b := t / sh.tpb
		in := t - b*sh.tpb
		return off + b*sh.blk + (in>>sh.rsh)*sh.rs + (in&sh.rmask)*sh.tb, b*sh.blk < frozen
	}
	return off + t*sh.row, t*sh.row < frozen
}

// run returns the tokens of the contiguous run of a tensor that starts at token t
// (before the sequence's length cuts it): to the end of t's run in the Blocked
// layout, unbounded in PerLayer.
func (sh *shape) run(t int) int {
	if sh.layout == Blocked {
		return sh.rt - t%sh.tpb%sh.rt
	}
	return math.MaxInt
}

// copyTail copies the tokens of src's range past its whole sharing units below n
// tokens into dst's, which must hold extent(n) bytes.
func (sh *shape) copyTail(dst, src buffer, n int) error {
	if sh.state > 0 {
		if n > 0 {
			return copyRange(dst, src, 0, sh.state)
		}
		return nil
	}
	full := sh.shareable(n)
	if sh.layout != Blocked {
		if tail := n*sh.row - full; tail > 0 {
			return copyRange(dst, src, full, tail)
		}
		return nil
	}
	r := n % sh.tpb
	if r == 0 {
		return nil
	}
	// The tail's whole runs are one span; the tokens of its last run, partly
	// filled, lie in each tensor's part of that run.
	runs, r := r/sh.rt, r%sh.rt
	if !dst.HostAccessible() || !src.HostAccessible() || r == 0 {
		// One span (through the bounce buffer on a device) rather than a copy per
		// tensor: it holds the free tokens of every tensor but the last too, which
		// are no sequence's.
		last := 0
		if r > 0 {
			last = ((len(sh.places)-1)*sh.rt + r) * sh.tb
		}
		return copyRange(dst, src, full, runs*sh.rs+last)
	}
	if runs > 0 {
		if err := copyRange(dst, src, full, runs*sh.rs); err != nil {
			return err
		}
	}
	at := full + runs*sh.rs
	for i := range len(sh.places) {
		if err := copyRange(dst, src, at+i*sh.rt*sh.tb, r*sh.tb); err != nil {
			return err
		}
	}
	return nil
}
