package kv

import (
	"fmt"
	"math"

	"github.com/vmarena/vmarena/backing"
)

// Sizing is what one sequence of a configuration needs; see Config.Size. A server
// reads it before New, to choose MaxTokens, the granule and the budget.
type Sizing struct {
	TokenBytes    int   // one token of one layer's K or V (a uniform model's; else 0)
	BytesPerToken int   // one token, all layers, K and V
	Buffers       int   // address ranges per sequence
	BlockTokens   int   // tokens per block in the Blocked layout (a uniform model's; else 0)
	Used          int64 // bytes of the tokens themselves (the groups' Need)
	Committed     int64 // bytes of the granules that hold them
	// Waste is Committed - Used: partly filled granules, and in the Blocked layout the
	// bytes at each block's end that hold no whole token and the free tokens of the
	// last block (a window's dead tokens in its first block too).
	Waste        int64
	WastePercent float64 // Waste as a share of Committed
	Reserved     int64   // address space reserved per sequence (MaxTokens)
	// Groups is what each group needs, in the order of Model.Groups: Committed is
	// what the cache's layout commits for the group (in the Blocked layout,
	// Model.Size's figure), BlockBytes and BlockTokens its blocks (0 in PerLayer; a
	// recurrent group's BlockBytes is its state's granules), for a sequence whose
	// last step appended token tokens-1 (see Model.Size).
	Groups []GroupSizing
}

// Size returns what one sequence of tokens tokens holds under cfg's model, layout and
// blocks with granule bytes per granule, reserving room for MaxTokens (at least
// tokens): what a cache's sequence holds after the step that appended token tokens-1
// (see Model.Size). A uniform model (Uniform: one full-attention group of every layer
// in order) also has its group's TokenBytes and BlockTokens. It allocates nothing: a
// server calls it at start-up (or a capacity plan) to learn what a sequence of a
// typical length costs and wastes on its backing's granule.
func (cfg Config) Size(granule, tokens int) (Sizing, error) {
	m, err := cfg.model()
	if err != nil {
		return Sizing{}, err
	}
	if tokens < 0 || cfg.MaxTokens < tokens {
		return Sizing{}, fmt.Errorf("%w: granule %d, tokens %d, max tokens %d", ErrConfig, granule, tokens, cfg.MaxTokens)
	}
	groups, _, err := newGroups(m, cfg.Layout, granule, cfg.BlockTokens, cfg.RunTokens, cfg.MaxTokens)
	if err != nil {
		return Sizing{}, err
	}
	s := Sizing{BytesPerToken: m.BytesPerToken()}
	if m.uniform() {
		s.TokenBytes, s.BlockTokens = groups[0].tb, groups[0].tpb
	}
	for i := range groups {
		g := &groups[i]
		committed := g.committed(tokens)
		s.Buffers += g.nbuf
		s.Committed += committed
		s.Reserved += int64(g.nbuf) * int64(g.capac)
		gs, err := g.spec.size(granule, cfg.BlockTokens, tokens)
		if err != nil {
			return Sizing{}, fmt.Errorf("group %d: %w", i, err)
		}
		gs.Committed, gs.RunTokens = committed, g.rt
		if g.layout != Blocked && g.state == 0 {
			gs.BlockBytes, gs.BlockTokens, gs.DeadBytes, gs.BoundTokens, gs.Block = 0, 0, 0, 0, ""
		}
		s.Groups = append(s.Groups, gs)
		s.Used += gs.Need
	}
	s.Waste = s.Committed - s.Used
	if s.Committed > 0 {
		s.WastePercent = 100 * float64(s.Waste) / float64(s.Committed)
	}
	return s, nil
}

// committed returns the bytes g's ranges commit for a sequence of n tokens whose
// last step appended token n-1 alone: from the unit its window started in when that
// step began (dropOff(n-1): the step read from there) to the end of its last token's
// granule. (A unit is whole granules, and a Blocked extent whole units.)
func (g *group) committed(n int) int64 {
	end := (g.extent(n) + g.unit - 1) / g.unit * g.unit // a unit need not be a power of two
	return int64(g.nbuf) * int64(end-g.dropOff(max(n-1, 0)))
}

// GroupSizing is what one group of one sequence needs; see Model.Size. Read it to
// see which group of a model of layer groups holds the memory, and why its block is
// the size it is.
type GroupSizing struct {
	Kind   Attention
	Layers int
	// BytesPerToken is one token across the group's layers and tensors, block
	// scales included; 0 for a recurrent group.
	BytesPerToken int
	// BlockBytes is the group's block, whole granules (a recurrent group: its whole
	// state), and BlockTokens the tokens of each of its layers and tensors a block
	// holds: the group's sharing and window granularity (a fork or a prefix maps whole
	// blocks, a window gives back whole blocks). DeadBytes is a block's bytes that
	// hold no token (BlockBytes - BlockTokens × BytesPerToken), waste in every block;
	// BoundTokens the most tokens the default block may hold (0 for an override); and
	// Block says why this block (see Config.BlockTokens for the rule).
	BlockBytes  int
	BlockTokens int
	DeadBytes   int
	BoundTokens int
	Block       string
	// RunTokens is the tokens of each run a block is cut into (Config.RunTokens'
	// default in Model.Size; the block's tokens where it is one run); 0 in PerLayer
	// and for a recurrent group.
	RunTokens int
	// FirstLive is the first token the group holds: the first the sequence's last
	// step read, the one that appended token n-1 (Group.FirstLive(n-1); 0 for n = 0).
	// The next step gives back what it no longer reads, from Group.FirstLive(n) on.
	// Live is the tokens from FirstLive on.
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

// ModelSizing is what one sequence of a model needs, group by group; see Model.Size
// and ChunkedPeak.
type ModelSizing struct {
	Tokens int
	Groups []GroupSizing // in the order of Model.Groups
	// Need, Committed and Packed are the sums over the groups.
	Need      int64
	Committed int64
	Packed    int64
}

// Size returns what one sequence of tokens tokens holds of each of m's groups, on
// granules of granule bytes, when each group lies in a range of its own cut into
// blocks as kv's Blocked layout cuts them (blockTokens is Config.BlockTokens: 0
// chooses each group's block, see there) and a window group holds the blocks from
// the one with the first token its last step read (a sequence grown one token at a
// time: the step that appended token tokens-1; ChunkedPeak sizes a prefill in
// chunks). A recurrent group holds its state, rounded up to whole granules, once the
// sequence has a token. Size allocates nothing and keeps no state: it is what a
// cache's sequence of tokens tokens holds, block for block. Config.Size answers for a
// whole configuration; call this for the group-by-group detail of a model of layer
// groups.
func (m Model) Size(granule, blockTokens, tokens int) (ModelSizing, error) {
	if err := m.Validate(0); err != nil {
		return ModelSizing{}, err
	}
	if !backing.IsPowerOfTwo(granule) || tokens < 0 || blockTokens < 0 {
		return ModelSizing{}, fmt.Errorf("%w: granule %d, block tokens %d, tokens %d", ErrConfig, granule, blockTokens, tokens)
	}
	s := ModelSizing{Tokens: tokens, Groups: make([]GroupSizing, len(m.Groups))}
	for i, g := range m.Groups {
		gs, err := g.size(granule, blockTokens, tokens)
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

// size is Size for one valid group with Config.BlockTokens blockTokens.
func (g Group) size(granule, blockTokens, n int) (GroupSizing, error) {
	return g.sizeFrom(granule, blockTokens, n, max(n-1, 0))
}

// sizeFrom is size for a sequence of n tokens whose last step grew it from from
// tokens (from < n, or both 0): a window group holds from FirstLive(from) on.
func (g Group) sizeFrom(granule, blockTokens, n, from int) (GroupSizing, error) {
	gs := GroupSizing{Kind: g.Kind, Layers: len(g.Layers), BytesPerToken: g.BytesPerToken()}
	if g.Kind == Recurrent {
		state := len(g.Layers) * g.StateBytes // cannot overflow: validate bounds it
		gs.BlockBytes, _ = backing.AlignUp(state, granule)
		gs.Block = "a recurrent state in whole granules"
		if n > 0 {
			gs.Need, gs.Committed, gs.Packed = int64(state), int64(gs.BlockBytes), int64(gs.BlockBytes)
		}
		return gs, nil
	}
	bpt := gs.BytesPerToken
	b, err := g.block(granule, blockTokens)
	if err != nil {
		return GroupSizing{}, err
	}
	blk := b.Bytes
	gs.BlockBytes, gs.BlockTokens, gs.DeadBytes, gs.BoundTokens, gs.Block = blk, b.Tokens, b.Dead, b.Bound, b.Why
	gs.RunTokens = runFor(b.Tokens, 0)
	gs.FirstLive = g.FirstLive(from)
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

// ChunkedPeak returns the most one sequence of m holds while a prompt of tokens
// tokens is written in chunks of chunk tokens, each step appending chunk tokens (the
// last the rest), as Size counts it: for a server that prefills in chunks and
// budgets the peak, which Size at tokens does not show. After the step that grows
// the sequence from p to e tokens, a window group holds from FirstLive(p) on, so the
// whole chunk and the window before it. Tokens is the e of the step that holds the most (the first such),
// and each group's FirstLive and Live are at that step. The peak is at most Size's
// Need at tokens plus one chunk of each window group and one block per group.
//
// NB: within the step, the step's growth is committed (and asked of the governor)
// before the window gives back what the step no longer reads (see the states of a
// window group's bytes): a window group then holds, for a moment, from the FirstLive of the
// length the step before grew from.
func (m Model) ChunkedPeak(granule, blockTokens, tokens, chunk int) (ModelSizing, error) {
	if chunk <= 0 {
		return ModelSizing{}, fmt.Errorf("%w: chunks of %d tokens", ErrConfig, chunk)
	}
	peak, err := m.Size(granule, blockTokens, 0) // validates m and the sizes
	if err != nil {
		return ModelSizing{}, err
	}
	for p, e := 0, 0; p < tokens; p = e {
		e = p + min(chunk, tokens-p)
		s := ModelSizing{Tokens: e, Groups: make([]GroupSizing, len(m.Groups))}
		for i, g := range m.Groups {
			gs, err := g.sizeFrom(granule, blockTokens, e, p)
			if err != nil {
				return ModelSizing{}, fmt.Errorf("group %d: %w", i, err)
			}
			s.Groups[i] = gs
			s.Need += gs.Need
			s.Committed += gs.Committed
			s.Packed += gs.Packed
		}
		if s.Committed > peak.Committed || peak.Tokens == 0 {
			peak = s
		}
	}
	return peak, nil
}
