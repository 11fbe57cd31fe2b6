package kv

import (
	"fmt"
	"math"
	"math/bits"

	"github.com/vmarena/vmarena/backing"
)

// How a group's block is chosen (the Blocked layout). A block is whole granules and
// holds T tokens of every layer and tensor of its group; the bytes past its T tokens
// are dead (no token lies there). A block is committed whole when its first token
// arrives, shared whole (forks, prefixes, the prefix cache map it, and copy the
// tokens of a partly filled last one) and given back whole by a window, so T is the
// group's sharing and window granularity.
//
// The default (Config.BlockTokens 0) picks, per group, the block with the fewest dead
// bytes per byte of block among those of at most a bound of tokens, and of those the
// one of fewest tokens:
//
//   - Where a whole number of tokens fills a whole number of granules within the
//     bound, it is the smallest such block: G/gcd(G, B) tokens in B/gcd(G, B)
//     granules (G the granule, B the group's bytes per token), with no dead byte.
//   - Otherwise it is the block of least dead share within the bound (a token larger
//     than the bound's block still gets a block of one token).
//
// The bound is blockBound tokens, or the tokens one granule holds where that is more
// (a block is at least one granule); a sliding-window or chunked-local group's is at
// most half its window, so that a window holds at least two blocks and gives back
// granules as it moves. A recurrent group's block is its state, rounded up to whole
// granules.
//
// Config.BlockTokens > 0 overrides it: the block is the fewest whole granules that
// hold that many tokens of every layer, and holds as many as fit. An override whose
// block is more than 1/overrideDeadDiv dead bytes is reported, not refused (a
// caller may want a kernel's block whatever it costs): Size's GroupSizing.Block says
// so beside the default's block, and New logs it (Warn, Config.Logger).

// blockBound is the most tokens a full group's default block holds where one granule
// holds fewer: the sharing granularity a fork or a prefix hit copies below, and the
// smallest bound under which every preset finds a block with no dead byte at 64 KiB
// granules (DeepSeek-V3: 512 tokens in 549 granules).
const blockBound = 512

// overrideDeadDiv: a Config.BlockTokens whose block is more than 1/overrideDeadDiv
// dead bytes is reported.
const overrideDeadDiv = 8

// blockChoice is a group's block: Tokens tokens of every layer and tensor in Bytes
// bytes (whole granules), Dead of them holding no token, and why.
type blockChoice struct {
	Tokens int
	Bytes  int
	Dead   int
	Bound  int // the most tokens the default's block may hold (0 for an override)
	Why    string
}

// block returns g's block on granules of granule bytes (a power of two) for a
// Config.BlockTokens of blockTokens (0: the default; see above). g must be valid and
// hold tokens (not Recurrent).
func (g Group) block(granule, blockTokens int) (blockChoice, error) {
	bpt := g.BytesPerToken()
	if blockTokens < 0 {
		return blockChoice{}, fmt.Errorf("%w: BlockTokens %d is negative (0 chooses each group's block)", ErrConfig, blockTokens)
	}
	if blockTokens > 0 {
		if blockTokens > math.MaxInt/bpt-granule {
			return blockChoice{}, fmt.Errorf("%w: blocks of %d tokens of %d bytes overflow", ErrConfig, blockTokens, bpt)
		}
		blk, _ := backing.AlignUp(blockTokens*bpt, granule)
		b := blockChoice{Tokens: blk / bpt, Bytes: blk, Why: fmt.Sprintf("Config.BlockTokens asks for at least %d tokens", blockTokens)}
		b.Dead = blk - b.Tokens*bpt
		if b.Dead > blk/overrideDeadDiv {
			def, _ := g.block(granule, 0)
			b.Why += fmt.Sprintf(": %d of every block's %d bytes hold no token, more than 1/%d (the default's block: %d tokens in %d bytes, %d dead)",
				b.Dead, blk, overrideDeadDiv, def.Tokens, def.Bytes, def.Dead)
		}
		return b, nil
	}
	perGranule := granule / bpt
	bound := max(blockBound, perGranule)
	if g.Kind == SlidingWindow || g.Kind == ChunkedLocal {
		bound = min(bound, max(1, g.Window/2))
	}
	// NB: granule is a power of two, so the smallest block of no dead byte holds a
	// power of two tokens: granule over the greatest power of two dividing bpt.
	if t0 := granule >> min(bits.TrailingZeros(uint(bpt)), bits.TrailingZeros(uint(granule))); t0 <= bound {
		return blockChoice{Tokens: t0, Bytes: t0 * bpt, Bound: bound, Why: fmt.Sprintf("%d whole tokens fill %d whole granules", t0, t0*bpt/granule)}, nil
	}
	if bound > blockBound {
		// One granule holds more tokens than blockBound: the smallest block, one
		// granule, holds the most tokens of any block within the bound.
		return blockChoice{Tokens: bound, Bytes: granule, Dead: granule - bound*bpt, Bound: bound,
			Why: fmt.Sprintf("one granule, the smallest block, holds %d tokens", bound)}, nil
	}
	best := blockChoice{Bound: bound}
	for t := 1; t <= bound; t++ {
		blk, _ := backing.AlignUp(t*bpt, granule) // t*bpt ≤ blockBound × MaxInt32: no overflow
		dead := blk - t*bpt
		// dead/blk < best.Dead/best.Bytes, in 128 bits.
		hi1, lo1 := bits.Mul64(uint64(dead), uint64(best.Bytes))
		hi2, lo2 := bits.Mul64(uint64(best.Dead), uint64(blk))
		if best.Bytes == 0 || hi1 < hi2 || hi1 == hi2 && lo1 < lo2 {
			best.Tokens, best.Bytes, best.Dead = t, blk, dead
		}
	}
	why := "the fewest dead bytes per block of %d tokens at most (no whole number of tokens fills whole granules within it)"
	if g.Kind == SlidingWindow || g.Kind == ChunkedLocal {
		why = "the fewest dead bytes per block of %d tokens at most, half the window (no whole number of tokens fills whole granules within it)"
	}
	best.Why = fmt.Sprintf(why, bound)
	return best, nil
}

// warnBlocks logs (Warn) each group whose Config.BlockTokens block is more than
// 1/overrideDeadDiv dead bytes: what Size reports, told where the cache is made.
func (c *Cache) warnBlocks() {
	if c.cfg.Logger == nil || c.cfg.BlockTokens == 0 {
		return
	}
	for i := range c.groups {
		g := &c.groups[i]
		if g.layout != Blocked || g.state > 0 {
			continue
		}
		if dead := g.blk - g.tpb*g.bpt; dead > g.blk/overrideDeadDiv {
			def, _ := g.spec.block(c.gran, 0)
			c.cfg.Logger.Warn("kv: Config.BlockTokens makes blocks of dead bytes", "group", i, "kind", g.spec.Kind.String(),
				"block_tokens", g.tpb, "block_bytes", g.blk, "dead_bytes", dead,
				"default_block_tokens", def.Tokens, "default_block_bytes", def.Bytes, "default_dead_bytes", def.Dead)
		}
	}
}
