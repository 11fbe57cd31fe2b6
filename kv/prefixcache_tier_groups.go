package kv

import (
	"context"
	"fmt"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/radix"
	"github.com/vmarena/vmarena/kv/tierval"
)

// Tiers on a model of several layer groups (window groups beside full or MLA ones:
// gpt-oss, Gemma-3, Llama-4). Each group has units (blocks) of its own size, so a
// tier's block here is a run of tokens that every group's units tile: the least
// common multiple of the groups' block tokens (pcTiers.bt; gpt-oss-20b and
// gemma-3-27b on 2 MiB granules: 256 and 128 tokens, their full group's block). Its
// key is the kv/blockhash chain of the prompt's tier blocks up to it, under the
// cache's tier namespace, as on one group; its value is tierval's grouped value
// (EncodeGroups: version 2), one entry key carrying each group's units of the block's
// tokens, under the groups' layout (tierGroups.layout), so that a value of another model or
// layout is refused (ErrLayout: counted in TierStats.Invalid, never mapped) even
// where its namespace agreed.
//
// What a value holds: every full and MLA group's units of the block, always; of each
// window group, the units of the block that the entry written down still held: all of
// them, its last ones (the entry's window starts inside the block), or none (a window
// gives its older units back, in the inserted sequence before the insert and by
// eviction's trimWindows after it). With tiers, trimWindows keeps what the step at
// the end of the entry's last whole tier block below its last token reads, so that
// that block, the one a later turn of the conversation loads last, serves a hit. A
// value without the whole of a full group's part is refused (ErrBlock).
//
// What a load serves: blocks are loaded as on one group (a run of keys past the
// device's match, each value checked in full before any of its bytes is written, into
// granules the new sequence commits for them, as far as the budget holds them), and
// each value restores every group it holds of its block or nothing. A hit never
// serves a block whose window groups' units a step there would read are missing: the
// load keeps, per window group, the first token from which the sequence holds that
// group's tokens without a gap (units missing at a block's start move it past them),
// and the lookup's match is the end of the last loaded block at which every window
// group serves the step (the window rule: group.serves), or the device's match. The sequence is cut back to it, and the window units below what the step at
// it reads are given back at once (dropDead), so that no unwritten unit is ever held.
// The group parts below what the new sequence maps from the device's hit (its frozen
// bytes) are not written: they are the cache's, read-only, and hold the same tokens.
// A tier's Hits count the tokens the match grew by its loads; a lookup whose loads
// from a tier served nothing (none, or none that the window rule lets it serve) is
// one of its Misses, the blocks cut off being asked of the next tier. Probe counts the
// run each tier holds: an upper bound here, where the window rule may serve less.
//
// Write-down is as on one group: eviction takes an entry whole where every unit of
// its own gives memory back (shrinkGroups), its blocks from its parent's on copied out
// of its ranges before they close; where a cut stops short of that (a unit another
// entry or a live sequence maps), the whole tier blocks it cuts off are mapped into a
// holder first (pickCutGroups) and copied from it.
//
// Not here: a recurrent group's state (tiers are refused on a model with one:
// tierval's PartState is the place its checkpoint will take), and a write-through at
// insert (entries here are never lazy: an entry's first hit starts it).

// newTiersOf is newTiers for c: on a cache of several groups with tiers, with their
// part (newTierGroups) and its tier block.
func newTiersOf(c *Cache, opts PrefixCacheOptions) (*pcTiers, error) {
	if !c.multi || len(opts.Tiers) == 0 {
		return newTiers(c, opts, nil, c.tpb)
	}
	grp, bt, err := newTierGroups(c)
	if err != nil {
		return nil, err
	}
	return newTiers(c, opts, grp, bt)
}

// loadFor is load, or loadGroups on a cache of several groups.
func (t *pcTiers) loadFor(ns Namespace, s *Sequence, tokens []int32, m, limit int) int {
	if t.grp != nil {
		return t.loadGroups(ns, s, tokens, m, limit)
	}
	return t.load(ns, s, tokens, m, limit)
}

// writeDown is writeBack, or writeBackGroups on a cache of several groups: what an
// entry's close and a write-through call. NB: the other write-downs (a lazy entry's,
// one a miss's spare makes) are of one group's caches only, and call writeBack.
func (t *pcTiers) writeDown(ctx context.Context, s *Sequence, w *tierWrite) {
	if t.grp != nil {
		t.writeBackGroups(ctx, s, w)
		return
	}
	t.writeBack(ctx, s, w)
}

// tierGroups is the tiers' part on a cache of several groups: the value layout, and
// per group its units in a tier block and the bytes of its part.
type tierGroups struct {
	layout *tierval.Layout
	per    []int // units of the group in one tier block
	parts  []int // bytes of the group's part of one value: per × unit
}

// newTierGroups returns the tiers' part of a cache of several groups and its tier
// block's tokens, or an error matching ErrConfig: a recurrent group (its state after
// a block is not kept), a layout other than Blocked, or a tier block past MaxTokens.
func newTierGroups(c *Cache) (*tierGroups, int, error) {
	m := c.cfg.Model
	for gi := range c.groups {
		if c.groups[gi].spec.Kind == Recurrent {
			return nil, 0, fmt.Errorf("%w: tiers store each group's units of a block, and a recurrent group's state after a block is not kept: model %q has %s", ErrConfig, m.Name, groupKinds(m))
		}
	}
	if c.cfg.Layout != Blocked {
		return nil, 0, fmt.Errorf("%w: tiers store whole blocks, and only the Blocked layout lays a block out as one contiguous unit (layout %v)", ErrConfig, c.cfg.Layout)
	}
	bt := 1
	for gi := range c.groups {
		g := &c.groups[gi]
		bt = lcm(bt, g.tpb)
		if bt > c.cfg.MaxTokens {
			return nil, 0, fmt.Errorf("%w: a tier block holds whole blocks of every group, %d tokens or more, more than MaxTokens %d", ErrConfig, bt, c.cfg.MaxTokens)
		}
	}
	tg := &tierGroups{per: make([]int, len(c.groups)), parts: make([]int, len(c.groups))}
	gl := make([]tierval.GroupLayout, len(c.groups))
	for gi := range c.groups {
		g := &c.groups[gi]
		s := g.spec
		tg.per[gi] = bt / g.tpb
		tg.parts[gi] = tg.per[gi] * g.unit
		gl[gi] = tierval.GroupLayout{
			Part: tierval.PartUnits, Kind: uint8(s.Kind), DType: uint8(s.DType), Scales: uint8(s.Scales),
			Window: s.Window, Layers: len(s.Layers), KVHeads: s.KVHeads, HeadDim: s.HeadDim,
			Tensors: s.tensorsPerLayer(), UnitTokens: g.tpb, UnitBytes: g.unit,
		}
	}
	l, err := tierval.NewLayout(m.Name, gl)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	tg.layout = l
	return tg, bt, nil
}

// lcm returns the least common multiple of two positive ints.
func lcm(a, b int) int {
	x, y := a, b
	for y != 0 {
		x, y = y, x%y
	}
	return a / x * b
}

// present returns the units of group gi's part of block b of a value written from an
// entry whose groups held tokens from held on (p.held): all of the block's, or a
// window group's last ones that the entry still held (none where it held none).
func (t *pcTiers) present(p *tierPart, gi, b int) int {
	per := t.grp.per[gi]
	g := &t.c.groups[gi]
	if !g.windowed() {
		return per
	}
	if p.held == nil {
		return 0
	}
	first := (p.held[gi] + g.tpb - 1) / g.tpb // the first unit wholly held
	return min(max((b+1)*per-first, 0), per)
}

// writeBackGroups is writeBack on a cache of several groups: one grouped value per
// block, each group's units of it read from s's ranges.
func (t *pcTiers) writeBackGroups(ctx context.Context, s *Sequence, w *tierWrite) {
	bt, tg := t.bt, t.grp
	sizes := make([]int, len(t.c.groups))
	for pi := range w.parts {
		p := &w.parts[pi]
		keys := t.keys(p.ns, p.tokens, p.first)
		for j, key := range keys {
			b := p.first + j
			tokens := p.tokens[b*bt : (b+1)*bt]
			for gi := range sizes {
				sizes[gi] = t.present(p, gi, b) * t.c.groups[gi].unit
			}
			size := tg.layout.Size(len(tokens), sizes)
			for i, tier := range t.tiers {
				t.slots <- struct{}{}
				sctx, cancel := context.WithTimeout(ctx, t.wait)
				encode := tierval.EncodeGroups
				if t.inProc[i] {
					encode = tierval.EncodeGroupsInProcess
				}
				err := tier.Store(sctx, key, size, func(dst []byte) error {
					return encode(dst, key, tg.layout, tokens, sizes, func(gi int, part []byte) error {
						// A part is the group's last units of the block.
						g := &t.c.groups[gi]
						return s.bufs[g.first].readAt((b+1)*tg.per[gi]*g.unit-len(part), part)
					})
				})
				cancel()
				<-t.slots
				t.count(i, func(st *TierStats) {
					if err != nil {
						st.Drops++
					} else {
						st.StoreBytes += int64(size)
					}
				})
			}
		}
	}
}

// groupLoad is what a lookup's loads on a cache of several groups have found so far:
// per group, the first token from which the sequence holds the group's tokens without
// a gap up to the loaded blocks' end (a full group's: 0), and the most tokens that
// the window rule lets the lookup serve, with held as it was there.
type groupLoad struct {
	held     []int
	served   int
	atServed []int
	m        int  // the device's match, which s held before the loads
	gap      bool // a loaded block lacked some of a window group's units
}

// loadGroups is load on a cache of several groups (see the top of this file). No
// lock is held.
func (t *pcTiers) loadGroups(ns Namespace, s *Sequence, tokens []int32, m, limit int) int {
	bt := t.bt
	if limit/bt*bt <= m {
		return m
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.wait)
	defer cancel()
	b0 := m / bt
	all := t.keys(t.spaceNS(ns), tokens[:limit/bt*bt], b0)
	ld := groupLoad{held: s.helds(), served: m, m: m}
	ld.atServed = append([]int(nil), ld.held...)
	for i, tier := range t.tiers {
		b := ld.served / bt
		keys := all[b-b0:]
		if len(keys) == 0 || ctx.Err() != nil {
			break
		}
		was := ld.served
		_, full := t.loadFromGroups(ctx, i, tier, s, tokens, b, keys, &ld)
		if ld.served == was {
			t.count(i, func(st *TierStats) { st.Misses++ })
		} else {
			t.count(i, func(st *TierStats) { st.Hits += int64(ld.served - was) })
		}
		if s.n > ld.served {
			// Blocks past the last that the window rule serves (a window group's
			// units of one of them were not there): cut off, for the next tier to
			// be asked for.
			if err := s.Truncate(ld.served); err != nil {
				return min(m, s.n)
			}
			copy(ld.held, ld.atServed)
		}
		if full {
			break
		}
	}
	n := min(ld.served, s.n)
	if ld.gap && n > m {
		// Window units of blocks loaded without them lie below what the step at n
		// reads: given back now, never held unwritten.
		_ = s.dropDead(n) // NB: a failure damages s, which its next call reports

	}
	return n
}

// loadFromGroups is loadFrom on a cache of several groups: it loads from tier i the
// longest run of keys it holds, blocks b on, into s, as far as the budget takes it,
// and moves ld on block by block. It returns the blocks loaded and whether the budget
// cut the run; s holds the loaded blocks (and nothing past them) on return. It holds
// a load slot meanwhile.
func (t *pcTiers) loadFromGroups(ctx context.Context, i int, tier Tier, s *Sequence, tokens []int32, b int, keys []tierval.Key, ld *groupLoad) (int, bool) {
	if !t.takeLoad(ctx, i) {
		return 0, false
	}
	defer func() { <-t.loads }()
	bt, tg, groups := t.bt, t.grp, t.c.groups
	before := s.n
	run, short, ok := t.loadRun(ctx, i, tier, s, b, keys)
	if !ok {
		return 0, false
	}
	decode := tierval.DecodeGroups
	if t.inProc[i] {
		decode = tierval.DecodeGroupsInProcess
	}
	// lo[gi]: the first byte of group gi's range that s may write: past what it maps
	// from the device's hit, and at or past its Start.
	lo := make([]int, len(groups))
	for gi := range groups {
		lo[gi] = max(*s.frozenOf(gi), s.bufs[groups[gi].first].Start())
	}
	parts := make([][]byte, len(groups))
	got := 0
	for ; got < run; got++ {
		blk := b + got
		want := tokens[blk*bt : (blk+1)*bt]
		var invalid bool
		var size int
		err := tier.Load(ctx, keys[got], func(src []byte) error {
			if err := decode(src, keys[got], tg.layout, want, tg.parts, parts); err != nil {
				invalid = true
				return err
			}
			for gi := range groups {
				if len(parts[gi]) != tg.parts[gi] && !groups[gi].windowed() {
					invalid = true
					return fmt.Errorf("%w: %w: %d bytes of group %d (%v), which every value holds whole", tierval.ErrValue, tierval.ErrBlock, len(parts[gi]), gi, groups[gi].spec.Kind)
				}
			}
			size = len(src)
			for gi, part := range parts {
				if part == nil {
					continue
				}
				g := &groups[gi]
				off := (blk+1)*tg.per[gi]*g.unit - len(part) // its last units
				if skip := lo[gi] - off; skip > 0 {
					if skip >= len(part) {
						continue
					}
					part, off = part[skip:], lo[gi]
				}
				if err := s.bufs[g.first].writeAt(off, part); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.loadFailed(i, blk, err, invalid)
			break
		}
		t.count(i, func(st *TierStats) { st.LoadBytes += int64(size) })
		end := (blk + 1) * bt
		serves := true
		for gi := range groups {
			g := &groups[gi]
			if !g.windowed() {
				continue
			}
			// The part holds the group's tokens from from on; where that leaves a
			// gap after what s held before the block, s holds them from there on.
			from := end - len(parts[gi])/g.unit*g.tpb
			if from > max(blk*bt, ld.m) {
				ld.held[gi], ld.gap = from, true
			}
			serves = serves && g.serves(ld.held[gi], end)
		}
		if serves {
			ld.served = end
			copy(ld.atServed, ld.held)
		}
	}
	if keep := max(before, (b+got)*bt); keep < s.n {
		if err := s.Truncate(keep); err != nil {
			return max(s.n/bt-b, 0), short
		}
	}
	return got, short
}

// pickCutGroups is pickCut on a cache of several groups, for a leaf whose entry e
// eviction cuts to n tokens: the whole tier blocks cut off are mapped, before e's
// ranges shrink, into a holder that is written down and closed once no lock is held:
// it returns that holder as an entry to close, or nil. pc.mu is held.
func (t *pcTiers) pickCutGroups(e *pcEntry, leaf *radix.Node[*pcEntry], n int) *pcEntry {
	if !t.keep(e) || e.seq == nil || e.seq.err != nil {
		return nil
	}
	p, ok := t.part(e, leaf.Tokens(), (n+t.bt-1)/t.bt, e.n)
	if !ok {
		return nil
	}
	h := t.holderGroups(e.seq, &p)
	if h == nil {
		return nil
	}
	return &pcEntry{seq: h, closed: true, wb: &tierWrite{t: t, parts: []tierPart{p}}}
}

// holderGroups is holder on a cache of several groups: a sequence of the cache's own
// whose ranges map src's units of p's blocks (a window group's those p holds: present),
// read-only, at their offsets in src; nil (a drop, counted) when they can not be
// mapped. pc.mu is held; it maps, and copies nothing.
func (t *pcTiers) holderGroups(src *Sequence, p *tierPart) *Sequence {
	c := t.c
	bufs, err := c.groupRanges(func(g *group) int { return g.capac })
	if err == nil {
		for gi := range c.groups {
			g := &c.groups[gi]
			per := t.grp.per[gi]
			lo, hi := p.first*per, p.last*per
			if g.windowed() {
				if p.held == nil {
					continue
				}
				lo = max(lo, (p.held[gi]+g.tpb-1)/g.tpb) // as present says
			}
			if lo >= hi {
				continue
			}
			if err = bufs[g.first].shareRange(src.bufs[g.first], lo*g.unit, (hi-lo)*g.unit, backing.ReadOnly); err != nil {
				break
			}
		}
	}
	if err != nil {
		c.release(bufs)
		t.countDrops(p.last - p.first)
		return nil
	}
	c.mu.Lock()
	c.entries++
	c.mu.Unlock()
	return &Sequence{c: c, bufs: bufs, n: p.last * t.bt, gs: make([]groupState, len(c.groups))}
}
