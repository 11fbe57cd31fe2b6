package kv

import (
	"fmt"
	"math"
	"slices"

	"github.com/vmarena/vmarena/backing"
)

// Model is the shape of a model's KV cache as a list of layer groups: each of its
// layers is in exactly one group, and each group has its own attention kind, tensors
// and element type. A Geometry is the one-group case (Geometry.Model).
//
// A Model is pure description: Validate and Size allocate nothing, and the cache is
// meant to lay each group out in ranges of its own (so groups need no common page
// size and no padding) and to give back a window group's granules below FirstLive.
type Model struct {
	Name   string
	Layers int // the model's layers; every index in [0, Layers) is in one group
	Groups []Group
}

// Model returns g as a one-group model: every layer full attention with g's shape.
func (g Geometry) Model() Model {
	layers := make([]int, max(g.Layers, 0))
	for i := range layers {
		layers[i] = i
	}
	return Model{Name: g.Name, Layers: g.Layers, Groups: []Group{{
		Kind: FullAttention, Layers: layers, KVHeads: g.KVHeads, HeadDim: g.HeadDim, DType: g.DType, Scales: g.Scales,
	}}}
}

// Validate reports, with an error matching ErrGeometry that says what, a model with
// no layers or no groups, a group that is wrong on its own (an unknown kind, no
// layers, a window missing or larger than maxTokens, an MLA group with V, a
// recurrent group with tensors, a shape its element type can not hold), a layer index
// outside the model, a layer listed twice or in no group, or a token size that
// overflows. maxTokens is the cache's per-sequence maximum; 0 means none is given.
func (m Model) Validate(maxTokens int) error {
	if m.Layers <= 0 {
		return fmt.Errorf("%w: model %q has %d layers", ErrGeometry, m.Name, m.Layers)
	}
	if len(m.Groups) == 0 {
		return fmt.Errorf("%w: model %q has no layer groups", ErrGeometry, m.Name)
	}
	if maxTokens < 0 {
		return fmt.Errorf("%w: max tokens %d", ErrConfig, maxTokens)
	}
	owner := make([]int, m.Layers) // group index + 1 of each layer, 0 while unseen
	total := 0
	for i, g := range m.Groups {
		if err := g.validate(i, maxTokens); err != nil {
			return err
		}
		for _, l := range g.Layers {
			switch {
			case l < 0 || l >= m.Layers:
				return fmt.Errorf("%w: group %d lists layer %d of a %d-layer model", ErrGeometry, i, l, m.Layers)
			case owner[l] != 0:
				return fmt.Errorf("%w: layer %d is listed twice (groups %d and %d)", ErrGeometry, l, owner[l]-1, i)
			}
			owner[l] = i + 1
		}
		if bpt := g.BytesPerToken(); total > math.MaxInt32-bpt {
			return fmt.Errorf("%w: a token of model %q is too large", ErrGeometry, m.Name)
		}
		total += g.BytesPerToken()
	}
	if l := slices.Index(owner, 0); l >= 0 {
		return fmt.Errorf("%w: layer %d of model %q is in no group", ErrGeometry, l, m.Name)
	}
	return nil
}

// clone returns a copy of m that shares no slice with it.
func (m Model) clone() Model {
	m.Groups = slices.Clone(m.Groups)
	for i := range m.Groups {
		m.Groups[i].Layers = slices.Clone(m.Groups[i].Layers)
	}
	return m
}

// BytesPerToken returns the bytes one token adds across all groups, block scales
// included: the recurrent groups add none.
func (m Model) BytesPerToken() int {
	n := 0
	for _, g := range m.Groups {
		n += g.BytesPerToken()
	}
	return n
}

// Uniform returns m with its sliding-window and chunked-local groups made full
// attention: the cache a server holds when it keeps every token of every layer.
func (m Model) Uniform() Model {
	u := Model{Name: m.Name + " (full attention)", Layers: m.Layers, Groups: slices.Clone(m.Groups)}
	for i, g := range u.Groups {
		if g.Kind == SlidingWindow || g.Kind == ChunkedLocal {
			u.Groups[i].Kind, u.Groups[i].Window = FullAttention, 0
		}
	}
	return u
}

// GroupSizing is what one group of one sequence needs; see Model.Size.
type GroupSizing struct {
	Kind   Attention
	Layers int
	// BytesPerToken is one token across the group's layers and tensors, block
	// scales included; 0 for a recurrent group.
	BytesPerToken int
	// BlockBytes is the group's block: the fewest whole granules that hold the
	// block tokens asked for (by default one) of each of its layers and tensors (a
	// recurrent group: its whole state), and BlockTokens the tokens a block holds. The
	// bytes at a block's end that hold no whole token are waste.
	BlockBytes  int
	BlockTokens int
	// FirstLive is the first token a later step still reads (Group.FirstLive), and
	// Live the tokens from there on: the ones the group must hold.
	FirstLive int
	Live      int
	// Need is the exact bytes of the live tokens (a recurrent group: its state),
	// Committed the whole blocks that hold them.
	Need      int64
	Committed int64
	// Packed is the whole granules that hold the live tokens laid end to end, token
	// after token with no block tails: the floor of any layout of the group in one
	// range (less than one granule partly dead at the front of a window and one
	// partly filled at the end). A recurrent group's is its Committed.
	Packed int64
}

// ModelSizing is what one sequence of a model needs; see Model.Size.
type ModelSizing struct {
	Tokens int
	Groups []GroupSizing // in the order of Model.Groups
	// Need, Committed and Packed are the sums over the groups.
	Need      int64
	Committed int64
	Packed    int64
}

// Size returns what one sequence of tokens tokens needs of each of m's groups, on
// granules of granule bytes, when each group lies in a range of its own cut into
// blocks (the fewest whole granules that hold blockTokens tokens of every layer and
// tensor of the group, as kv's Blocked layout cuts them; 0 means one token) and a
// window group holds only the blocks from the one with its first live token on. A
// recurrent group holds its state, rounded up to whole granules, once the sequence
// has a token. Size allocates nothing and keeps no state: the cache can size each
// group with it.
func (m Model) Size(granule, blockTokens, tokens int) (ModelSizing, error) {
	if err := m.Validate(0); err != nil {
		return ModelSizing{}, err
	}
	if !backing.IsPowerOfTwo(granule) || tokens < 0 || blockTokens < 0 {
		return ModelSizing{}, fmt.Errorf("%w: granule %d, block tokens %d, tokens %d", ErrConfig, granule, blockTokens, tokens)
	}
	s := ModelSizing{Tokens: tokens, Groups: make([]GroupSizing, len(m.Groups))}
	for i, g := range m.Groups {
		gs, err := g.size(granule, max(blockTokens, 1), tokens)
		if err != nil {
			return ModelSizing{}, fmt.Errorf("group %d: %w", i, err)
		}
		s.Groups[i] = gs
		s.Need += gs.Need
		s.Committed += gs.Committed
		s.Packed += gs.Packed
	}
	return s, nil
}

// size is Size for one valid group with blocks of at least bt tokens.
func (g Group) size(granule, bt, n int) (GroupSizing, error) {
	gs := GroupSizing{Kind: g.Kind, Layers: len(g.Layers), BytesPerToken: g.BytesPerToken()}
	if g.Kind == Recurrent {
		state := len(g.Layers) * g.StateBytes // cannot overflow: validate bounds it
		gs.BlockBytes, _ = backing.AlignUp(state, granule)
		if n > 0 {
			gs.Need, gs.Committed, gs.Packed = int64(state), int64(gs.BlockBytes), int64(gs.BlockBytes)
		}
		return gs, nil
	}
	bpt := gs.BytesPerToken
	if bt > (math.MaxInt-granule)/bpt {
		return GroupSizing{}, fmt.Errorf("%w: blocks of %d tokens of %d bytes overflow", ErrConfig, bt, bpt)
	}
	blk, _ := backing.AlignUp(bt*bpt, granule)
	gs.BlockBytes, gs.BlockTokens = blk, blk/bpt
	gs.FirstLive = g.FirstLive(n)
	gs.Live = n - gs.FirstLive
	if gs.Live == 0 {
		return gs, nil
	}
	blocks := (n-1)/gs.BlockTokens - gs.FirstLive/gs.BlockTokens + 1
	if int64(blocks) > math.MaxInt64/int64(blk) || int64(n) > math.MaxInt64/int64(bpt)-int64(granule) {
		return GroupSizing{}, fmt.Errorf("%w: %d tokens in blocks of %d bytes overflow", ErrConfig, n, blk)
	}
	gs.Need = int64(gs.Live) * int64(bpt)
	gs.Committed = int64(blocks) * int64(blk)
	g64 := int64(granule)
	end := (int64(n)*int64(bpt) + g64 - 1) / g64 * g64
	gs.Packed = end - int64(gs.FirstLive)*int64(bpt)/g64*g64
	return gs, nil
}
