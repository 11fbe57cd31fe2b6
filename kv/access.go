package kv

import (
	"fmt"

	"github.com/vmarena/vmarena/arena"
)

// Writable returns the first token that may be written: tokens below it lie in
// granules shared with a prefix or a fork and are read-only. On a Model it is the
// first that may be written in every group that has tokens. A server whose kernels
// write K and V in place writes no token below it (after Lookup, NewSequenceFrom,
// ForkAt, Freeze or an Insert of the sequence).
//
// WriteTokens refuses a token below it with ErrReadOnly, and a Truncate into a shared
// granule replaces it with a private copy of the kept tokens rather than write into
// it. The sharers map shared granules read-only; on a backing that can change access
// in place (backing.Protector: host.Shared, cuda) the origin's own mapping of them
// becomes read-only too when it is frozen or forked. Where the backing can not, the
// origin's mapping stays writable and its code MUST NOT write below Writable.
//
// A stray CPU store into read-only memory through Bytes or a host View is a hardware
// fault (SIGSEGV), which the Go runtime reports as "fatal error: fault" and ends the
// process. A goroutine that would rather recover it calls
// runtime/debug.SetPanicOnFault(true) first: the fault then becomes a Go panic (a
// runtime.Error whose Addr method gives the address) that a deferred recover can turn
// into an error. On a GPU a kernel's write into read-only memory is a fault of the
// CUDA context, where the driver grants read-only access at all.
func (s *Sequence) Writable() int {
	s.live()
	w := 0
	for gi := range s.c.groups {
		if g := &s.c.groups[gi]; g.state == 0 {
			w = max(w, g.writableFrom(*s.frozenOf(gi)))
		}
	}
	return w
}

// Bytes returns the Len × TokenBytes bytes of layer's K or V tensor in the PerLayer
// layout on a host backing, for CPU code that wants the tensor as one slice (View and
// Run serve every layout). The slice is valid until the sequence shrinks or closes.
// Bytes below Writable() × TokenBytes are shared with a prefix or a fork and MUST NOT
// be written: in a sequence started on a prefix or forked they are mapped read-only,
// and so are they in the sequence a prefix or fork was made from on a backing that
// can protect memory in place (a write faults: see Writable); elsewhere the
// origin's are not, and a write there would reach every sharer. In a window group the
// slice holds the tokens from FirstHeld on: (Len - FirstHeld) × TokenBytes bytes.
func (s *Sequence) Bytes(layer int, kind Kind) ([]byte, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	if s.c.cfg.Layout != PerLayer {
		return nil, fmt.Errorf("%w: %v tensors are strided; use a view", ErrLayout, s.c.cfg.Layout)
	}
	gi, i, _, ok := s.c.where(layer, kind)
	if !ok {
		return nil, s.c.noTensor(layer, kind)
	}
	buf := s.bufs[i]
	if !buf.HostAccessible() {
		return nil, fmt.Errorf("%w: device memory can not be touched by the CPU", ErrLayout)
	}
	g := &s.c.groups[gi]
	return buf.Bytes()[s.heldOf(gi)*g.row : g.extent(s.n)], nil
}

// Base returns the first address of layer's K or V tensor (its token 0), for a
// kernel that walks the tensor by BlockStride and TokenStride itself; host code
// reaches tokens by View, Run, ReadTokens and WriteTokens. It never changes from the
// sequence's creation to its Close. On a device it must not be dereferenced by the
// CPU.
func (s *Sequence) Base(layer int, kind Kind) uintptr {
	s.live()
	return s.c.tensorBase(s.bufs, layer, kind)
}

// TokenStride returns, for a kernel of a one-group model (see Base; LayerStrides
// serves every model), the bytes from one token to the next within a layer's K or V
// tensor: TokenBytes in both layouts (within a run of a block in Blocked, whose
// runs and blocks LayerStrides gives). On a Model it is the first group's, and
// BlockTokens' and BlockStride's too: each group has its own (Cache.LayerStrides).
func (s *Sequence) TokenStride() int {
	s.live()
	return s.c.row
}

// BlockTokens returns the tokens of each block in the Blocked layout (token t of a
// tensor is token t % BlockTokens of block t / BlockTokens, in the block's run of
// RunTokens that LayerStrides gives), and 0 in the others, whose tensors have no
// blocks: what a kernel of a one-group model needs to find a block (LayerStrides
// serves every model). It is at least Config.BlockTokens.
func (s *Sequence) BlockTokens() int {
	s.live()
	return s.c.tpb
}

// BlockStride returns, for a kernel of a one-group model (see Base; LayerStrides
// serves every model), the bytes from a block to the next (whole granules) in the
// Blocked layout, and 0 in the others.
func (s *Sequence) BlockStride() int {
	s.live()
	return s.c.blk
}

// View returns layer's K or V tensor of s as a tensor of T, for host code (a CPU
// kernel, a check) that reads or writes elements in place, or a kernel handed a
// tensor: [Len, KVHeads, HeadDim],
// contiguous in the PerLayer layout; in the Blocked layout [blocks, BlockTokens,
// KVHeads, HeadDim] with blocks = ⌈Len / BlockTokens⌉, strided by BlockStride and
// TokenStride, whose token t is element
// [t / BlockTokens, t % BlockTokens], or, where a block is cut into runs
// (Strides.RunTokens below BlockTokens), [blocks, BlockTokens / RunTokens, RunTokens,
// KVHeads, HeadDim], strided by BlockStride, RunStride and TokenStride, whose token t
// is element [t / BlockTokens, t % BlockTokens / RunTokens, t % RunTokens]. NB: in
// the last block the tokens at or past Len are not the sequence's (free room, or
// another sequence's tokens copied with a fork or prefix): a kernel masks them out.
// T must be the layer group's element type
// (ErrElemType otherwise). On a host backing the tensor's elements may be read and
// written (tokens below Writable are read-only); on a device it carries only the
// address. The view is valid until s shrinks below it or closes. For Q8_0 the last
// dimension counts blocks (HeadDim / 32 of them: see arena.BlockQ8_0), and the Blocked
// layout, whose blocks of whole granules are no whole number of 34-byte blocks, has
// no view (ErrLayout).
//
// On a Model the tensor is the layer's group's, of its element type (an MLA layer's
// one latent is its K: its V is refused with ErrRange). A window group's view is its
// held window: it starts at FirstHeld (in the Blocked layout, at FirstHeld's block,
// a multiple of BlockTokens), so that its element [0] is that token (block), and the
// dropped tokens below are in no view but, in the Blocked layout, those of
// FirstHeld's own block below it (a holder of n tokens at a chunk boundary holds
// none below n, which no step reads).
func View[T arena.Elem](s *Sequence, layer int, kind Kind) (arena.Tensor[T], error) {
	if err := s.usable(); err != nil {
		return arena.Tensor[T]{}, err
	}
	gi, i, off, ok := s.c.where(layer, kind)
	if !ok {
		return arena.Tensor[T]{}, s.c.noTensor(layer, kind)
	}
	gr := &s.c.groups[gi]
	g := gr.spec
	if dt := arena.DTypeOf[T](); dt != g.DType {
		return arena.Tensor[T]{}, fmt.Errorf("%w: %v view of a %v cache", ErrElemType, dt, g.DType)
	}
	held := s.heldOf(gi)
	size := g.DType.Size()
	hd := g.HeadDim / g.DType.BlockValues() // elements per head: values, or blocks (Validate)
	var shape, strides []int
	switch gr.layout {
	case PerLayer:
		return arena.NewTensor[T](s.bufs[i], held*gr.row, s.n-held, g.KVHeads, hd)
	case Blocked:
		if gr.blk%size != 0 {
			return arena.Tensor[T]{}, fmt.Errorf("%w: blocks of %d bytes are not a whole number of %d-byte %v elements; use Base, BlockStride and TokenStride", ErrLayout, gr.blk, size, g.DType)
		}
		hb := held / gr.tpb // held's block: held is its first token but after a restart at a chunk boundary
		off += hb * gr.blk
		if gr.rt < gr.tpb {
			if gr.rs%size != 0 {
				return arena.Tensor[T]{}, fmt.Errorf("%w: runs of %d bytes are not a whole number of %d-byte %v elements; use Base and LayerStrides", ErrLayout, gr.rs, size, g.DType)
			}
			shape = []int{gr.unitsFor(s.n) - hb, gr.tpb / gr.rt, gr.rt, g.KVHeads, hd}
			strides = []int{gr.blk / size, gr.rs / size, gr.row / size, hd, 1}
			break
		}
		shape = []int{gr.unitsFor(s.n) - hb, gr.tpb, g.KVHeads, hd}
		strides = []int{gr.blk / size, gr.row / size, hd, 1}
	default:
		shape = []int{s.n, g.KVHeads, hd}
		strides = []int{gr.row / size, hd, 1}
	}
	// NB: a range is one pointer wide in an interface, so a view on it at off
	// allocates nothing; only an empty range (Len 0, below off) needs memory that
	// starts at the tensor's own base, so that an empty sequence still has a view there.
	if buf := s.bufs[i]; off <= buf.Len() {
		return arena.NewTensorStrided[T](buf, off, shape, strides)
	}
	return arena.NewTensorStrided[T](layerMemory{buf: s.bufs[i], off: off}, 0, shape, strides)
}

// FirstHeld returns the first token of layer's tensors that s still holds: 0 but in
// a SlidingWindow or ChunkedLocal group, whose tokens below it were given back (see
// the package doc): reading, writing or viewing them fails with ErrDropped. A kernel
// walks a window group's tensor from there (Base, BlockStride and TokenStride of
// Cache.LayerStrides). It is at most the group's FirstLive of the length the last
// append grew from, so at most FirstLive(Len). It panics ("kv: layer or kind out of
// range") for a layer the model does not have.
func (s *Sequence) FirstHeld(layer int) int {
	s.live()
	if uint(layer) >= uint(len(s.c.layers)) {
		panic(panicLayerRange)
	}
	return s.heldOf(s.c.layers[layer].group)
}

// Strides is how a layer's tensors lie in a sequence's ranges, for a kernel that
// walks them from Sequence.Base itself. In the Blocked layout token t of a tensor lies
// at Base + t/BlockTokens × BlockStride + t%BlockTokens/RunTokens × RunStride +
// t%RunTokens × TokenStride: each run holds RunTokens contiguous tokens of the
// tensor, a paged kernel's page. In PerLayer it lies at Base + t × TokenStride.
type Strides struct {
	Group       int // the index of the layer's group in the model
	TokenBytes  int // one token of one of the layer's tensors, block scales included
	TokenStride int // bytes from one token to the next within a run
	// BlockTokens and BlockStride are the tokens of a block and the bytes from one
	// block to the next in the Blocked layout; 0 in PerLayer.
	BlockTokens int
	BlockStride int
	// RunTokens and RunStride are the tokens of each run of a block (a divisor of
	// BlockTokens; BlockTokens where a block is one run) and the bytes from one run
	// to the next within a block, in the Blocked layout (Config.RunTokens); 0 in
	// PerLayer.
	RunTokens int
	RunStride int
	// StateBytes is a recurrent layer's state; 0 for the others, which have tokens.
	StateBytes int
}

// LayerStrides returns how layer's tensors lie (see Strides): what a server hands
// its kernels for each layer, once, since it never changes. In a one-group cache
// every layer's are Sequence.TokenStride's, BlockTokens' and BlockStride's; on a
// Model each group has its own. It fails with ErrRange for a layer the model does not
// have.
func (c *Cache) LayerStrides(layer int) (Strides, error) {
	if uint(layer) >= uint(len(c.layers)) {
		return Strides{}, fmt.Errorf("%w: layer %d of %d layers", ErrRange, layer, len(c.layers))
	}
	gi := c.layers[layer].group
	g := &c.groups[gi]
	return Strides{Group: gi, TokenBytes: g.tb, TokenStride: g.row, BlockTokens: g.tpb, BlockStride: g.blk,
		RunTokens: g.rt, RunStride: g.rs, StateBytes: g.spec.StateBytes}, nil
}
