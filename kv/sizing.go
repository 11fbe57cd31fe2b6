package kv

import "fmt"

// Sizing is what a configuration needs; see Size.
type Sizing struct {
	TokenBytes    int   // one token of one layer's K or V (a Geometry's; 0 on a Model)
	BytesPerToken int   // one token, all layers, K and V
	Buffers       int   // address ranges per sequence
	BlockTokens   int   // tokens per block in the Blocked layout, else 0 (0 on a Model)
	Used          int64 // bytes of the tokens themselves (on a Model: the groups' Need)
	Committed     int64 // bytes of the granules that hold them
	// Waste is Committed - Used: partly filled granules, and in the Blocked layout the
	// bytes at each block's end that hold no whole token and the free tokens of the
	// last block (on a Model, a window's dead tokens in its first block too).
	Waste        int64
	WastePercent float64 // Waste as a share of Committed
	Reserved     int64   // address space reserved per sequence (MaxTokens)
	// Groups is, on a Model, what each group needs, in the order of Model.Groups:
	// Committed is what the cache's layout commits for the group (in the Blocked
	// layout, Model.Size's figure), BlockBytes and BlockTokens its blocks (0 in
	// PerLayer; a recurrent group's BlockBytes is its state's granules). NB: where a
	// chunk ends at tokens (a ChunkedLocal group with no live token), the cache still
	// holds the unit that token tokens goes into, which Model.Size does not count. nil
	// for a Geometry.
	Groups []GroupSizing
}

// Size returns what one sequence of tokens tokens needs under cfg's geometry (or
// model), layout and block with granule bytes per granule, reserving room for
// MaxTokens (at least tokens). It allocates nothing.
func (cfg Config) Size(granule, tokens int) (Sizing, error) {
	m, set, err := cfg.model()
	if err != nil {
		return Sizing{}, err
	}
	if tokens < 0 || cfg.MaxTokens < tokens {
		return Sizing{}, fmt.Errorf("%w: granule %d, tokens %d, max tokens %d", ErrConfig, granule, tokens, cfg.MaxTokens)
	}
	groups, _, err := newGroups(m, cfg.Layout, granule, cfg.BlockTokens, cfg.MaxTokens)
	if err != nil {
		return Sizing{}, err
	}
	s := Sizing{BytesPerToken: m.BytesPerToken()}
	if !set {
		s.TokenBytes, s.BlockTokens = groups[0].tb, groups[0].tpb
	}
	for i := range groups {
		g := &groups[i]
		committed := g.committed(tokens)
		s.Buffers += g.nbuf
		s.Committed += committed
		s.Reserved += int64(g.nbuf) * int64(g.capac)
		if !set {
			s.Used = int64(tokens) * int64(g.bpt)
			continue
		}
		gs, err := g.spec.size(granule, max(cfg.BlockTokens, 1), tokens)
		if err != nil {
			return Sizing{}, fmt.Errorf("group %d: %w", i, err)
		}
		gs.Committed = committed
		if g.layout != Blocked && g.state == 0 {
			gs.BlockBytes, gs.BlockTokens = 0, 0
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

// committed returns the bytes g's ranges commit for a sequence of n tokens: from
// the unit its window starts in (dropOff) to the end of its last token's granule.
// (A unit is whole granules, and a Blocked extent whole units.)
func (g *group) committed(n int) int64 {
	end := (g.extent(n) + g.unit - 1) / g.unit * g.unit // a unit need not be a power of two
	return int64(g.nbuf) * int64(end-g.dropOff(n))
}
