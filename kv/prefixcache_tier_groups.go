package kv

import (
	"context"
	"errors"
	"fmt"
	"math"

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
// one of its Misses, the blocks cut off being asked of the next tier. Probe finds the
// same end from the lengths of the parts in the heads of the run's values
// (prefixcache_tier_peek.go), with no value read whole.
//
// Write-down is as on one group: eviction takes an entry whole where every unit of
// its own gives memory back (shrinkGroups), its blocks from its parent's on copied out
// of its ranges before they close; where a cut stops short of that (a unit another
// entry or a live sequence maps), the whole tier blocks it cuts off are mapped into a
// holder first (pickCutGroups) and copied from it.
//
// Recurrent groups beside the others (Qwen3-Next: see prefixcache_checkpoint.go). A
// state after n tokens is a function of all n, so a value carries each recurrent
// group's state (tierval.PartState) only where the entry written down held a checkpoint
// at its block's end, all of them or none; a tier block is the least common multiple of
// the other groups' blocks, and a server that wants its checkpoints to go down
// checkpoints at their ends (Sequence.Checkpoint). A write-down holds the checkpoints
// it copies until its stores ended: an eviction's holder's as checkpoint.writes
// (holdStates), so that the eviction counts their memory given back at the pick, as it
// does the holder's granules (it closes the holder before it returns); a
// write-through's as a live sequence does (holdStatesLive), so that their memory counts
// as given back only once it ended, nothing waiting for it. A checkpoint that eviction
// takes while its entry keeps its units (trimCheckpoints) goes down with the tier block
// ending at it, from a holder (pickTrim), unless a write-down took it already
// (checkpoint.down). A value without states never replaces one the tier holds (asked
// with Contains first): the units of a block's tokens are the same, and the tier's
// value may have them; a value a load refuses is deleted, so that it does not stay for
// want of one with states to replace it. A load serves a block's end only where its
// value has the states and the window rule holds there; it writes the states of each
// such block into the new sequence's recurrent ranges (the last one's stay), so that
// the sequence starts on the states after exactly its match, and a hit with no such
// block serves the device's match, whose states a checkpoint gave. A lookup that starts
// on a tier's states records no checkpoint: a server that wants the device to keep them
// for the next prompt checkpoints at the match (Sequence.Checkpoint), as after any
// prefill step.
//
// A write-through (TierWriteThrough) starts at the insert: an entry here is never
// lazy, and holds ranges of its own from then on; a longer entry that displaces it
// inherits what it stored.

// newTiersOf is newTiers for c: on a cache of several groups with tiers, with their
// part (newTierGroups) and its tier block.
func newTiersOf(c *Cache, opts PrefixCacheOptions) (*pcTiers, error) {
	if !c.multi || len(opts.Tiers) == 0 {
		return newTiers(c, opts, nil, c.tpb)
	}
	grp, bt, err := newTierGroups(c.cfg.Model, c.cfg.Layout, c.cfg.MaxTokens, c.groups)
	if err != nil {
		return nil, err
	}
	return newTiers(c, opts, grp, bt)
}

// loadFor is load, or loadGroups on a cache of several groups.
func (t *pcTiers) loadFor(ctx context.Context, ns Namespace, s *Sequence, tokens []int32, m, limit int) int {
	if t.grp != nil {
		return t.loadGroups(ctx, ns, s, tokens, m, limit)
	}
	return t.load(ctx, ns, s, tokens, m, limit)
}

// writeDown is writeBack, or writeBackGroups on a cache of several groups: what an
// entry's close and a write-through call. NB: the other write-downs (a lazy entry's,
// one a miss's spare makes) are of one group's caches only, and call writeBack.
func (t *pcTiers) writeDown(ctx context.Context, s *Sequence, w *tierWrite) {
	if w.dropped {
		t.letStates(w)
		return
	}
	if t.grp != nil {
		t.writeBackGroups(ctx, s, w)
		return
	}
	t.writeBack(ctx, s, w)
}

// tierGroups is the tiers' part on a cache of several groups: the value layout, per
// group its units in a tier block and the bytes of its part (a recurrent group's: no
// units, and its state's bytes), and the recurrent groups' count.
type tierGroups struct {
	layout *tierval.Layout
	per    []int // units of the group in one tier block (a recurrent group: 0)
	parts  []int // bytes of the group's part of one value: per × unit, or the state
	states int   // recurrent groups: their parts are present in a value, all or none
	// windows: a group is a window group, so a value may hold only some of its units
	// (and whether a block serves depends on the blocks before it).
	windows bool
}

// newTierGroups returns the tiers' part of a cache of model m's groups in layout, of
// at most maxTokens a sequence, and its tier block's tokens, or an error matching
// ErrConfig: a layout other than Blocked, or a tier block past maxTokens.
func newTierGroups(m Model, layout Layout, maxTokens int, groups []group) (*tierGroups, int, error) {
	if layout != Blocked {
		return nil, 0, fmt.Errorf("%w: tiers store whole blocks, and only the Blocked layout lays a block out as one contiguous unit (layout %v)", ErrConfig, layout)
	}
	bt := 1
	for gi := range groups {
		g := &groups[gi]
		if g.state > 0 {
			continue // no units: a value carries its state after the block, or none
		}
		bt = lcm(bt, g.tpb)
		if bt > maxTokens {
			return nil, 0, fmt.Errorf("%w: a tier block holds whole blocks of every group, %d tokens or more, more than MaxTokens %d", ErrConfig, bt, maxTokens)
		}
	}
	tg := &tierGroups{per: make([]int, len(groups)), parts: make([]int, len(groups))}
	gl := make([]tierval.GroupLayout, len(groups))
	for gi := range groups {
		g := &groups[gi]
		s := g.spec
		if g.state > 0 {
			tg.parts[gi] = g.state
			tg.states++
			gl[gi] = tierval.GroupLayout{
				Part: tierval.PartState, Kind: uint8(s.Kind), DType: uint8(s.DType), Scales: uint8(s.Scales),
				Layers: len(s.Layers), Tensors: s.tensorsPerLayer(), UnitBytes: g.state,
			}
			continue
		}
		tg.per[gi] = bt / g.tpb
		tg.parts[gi] = tg.per[gi] * g.unit
		tg.windows = tg.windows || g.windowed()
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
// block, each group's units of it read from s's ranges, and with recurrent groups
// their states where the part holds a checkpoint at the block's end. A value without
// states never replaces one the tier holds (the tier's may have them; the units of
// a block's tokens are the same). It ends the part's holds on checkpoints.
func (t *pcTiers) writeBackGroups(ctx context.Context, s *Sequence, w *tierWrite) {
	defer t.letStates(w)
	bt, tg := t.bt, t.grp
	sizes := make([]int, len(t.c.groups))
	for pi := range w.parts {
		p := &w.parts[pi]
		keys := t.keys(p.ns, p.tokens, p.first)
		cks := p.cks
		for j, key := range keys {
			b := p.first + j
			tokens := p.tokens[b*bt : (b+1)*bt]
			for len(cks) > 0 && cks[0].n < (b+1)*bt {
				cks = cks[1:]
			}
			var ck *checkpoint
			if len(cks) > 0 && cks[0].n == (b+1)*bt {
				ck = cks[0]
			}
			for gi := range sizes {
				g := &t.c.groups[gi]
				switch {
				case g.state == 0:
					sizes[gi] = t.present(p, gi, b) * g.unit
				case ck != nil:
					sizes[gi] = g.state
				default:
					sizes[gi] = 0
				}
			}
			size := tg.layout.Size(len(tokens), sizes)
			for i, tier := range t.tiers {
				t.slots <- struct{}{}
				sctx, cancel := context.WithTimeout(ctx, t.wait)
				if tg.states > 0 && ck == nil {
					if n, err := tier.Contains(sctx, []tierval.Key{key}); err == nil && n == 1 {
						cancel()
						<-t.slots
						continue
					}
				}
				encode := tierval.EncodeGroups
				if t.inProc[i] {
					encode = tierval.EncodeGroupsInProcess
				}
				err := tier.Store(sctx, key, size, func(dst []byte) error {
					return encode(dst, key, tg.layout, tokens, sizes, func(gi int, part []byte) error {
						g := &t.c.groups[gi]
						if g.state > 0 {
							return ck.bufs[g.first].readAt(0, part)
						}
						// A part is the group's last units of the block.
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
func (t *pcTiers) loadGroups(parent context.Context, ns Namespace, s *Sequence, tokens []int32, m, limit int) int {
	if !t.asks(m, limit) {
		return m
	}
	bt := t.bt
	ctx, cancel := t.loadContext(parent)
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
			if !callerEnded(ctx) { // a cancel is neither the tier's miss nor its drop
				t.count(i, func(st *TierStats) { st.Misses++ })
			}
		} else {
			t.count(i, func(st *TierStats) { st.Hits += int64(ld.served - was) })
		}
		if s.n > ld.served {
			// Blocks past the last that the window rule serves (a window group's
			// units of one of them were not there): cut off, for the next tier to
			// be asked for.
			if err := s.Truncate(ld.served); err != nil {
				t.statesAt(s, ld.served, min(m, s.n), err)
				return min(m, s.n)
			}
			copy(ld.held, ld.atServed)
		}
		if full {
			break
		}
	}
	n := min(ld.served, s.n)
	t.statesAt(s, ld.served, n, nil)
	if ld.gap && n > m {
		// Window units of blocks loaded without them lie below what the step at n
		// reads: given back now, never held unwritten.
		_ = s.dropDead(n) // NB: a failure damages s, which its next call reports

	}
	return n
}

// statesAt damages s, a lookup's new sequence whose loads wrote the recurrent states
// after served tokens, where a failed truncate (err, or one inside a load) leaves it
// to start on n tokens other than served: its states would not be those after its
// tokens. Nothing is done on a cache without recurrent groups, or where n is served.
func (t *pcTiers) statesAt(s *Sequence, served, n int, err error) {
	if t.grp.states == 0 || n == served || s.err != nil {
		return
	}
	if err == nil {
		err = errors.New("a load left the sequence short")
	}
	s.err = fmt.Errorf("%w: %d tokens under the states after %d: %w", ErrDamaged, n, served, err)
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
		var invalid, stated bool
		var size int
		err := tier.Load(ctx, keys[got], func(src []byte) error {
			if err := decode(src, keys[got], tg.layout, want, tg.parts, parts); err != nil {
				invalid = true
				return err
			}
			states := 0
			for gi := range groups {
				g := &groups[gi]
				if g.state > 0 && parts[gi] != nil {
					states++
				}
				if len(parts[gi]) != tg.parts[gi] && !g.windowed() && g.state == 0 {
					invalid = true
					return fmt.Errorf("%w: %w: %d bytes of group %d (%v), which every value holds whole", tierval.ErrValue, tierval.ErrBlock, len(parts[gi]), gi, g.spec.Kind)
				}
			}
			if states != 0 && states != tg.states {
				invalid = true
				return fmt.Errorf("%w: %w: the states of %d recurrent groups of %d, which a value holds all or none of", tierval.ErrValue, tierval.ErrBlock, states, tg.states)
			}
			size = len(src)
			for gi, part := range parts {
				g := &groups[gi]
				if part == nil || g.state > 0 {
					continue
				}
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
			if states == 0 || !t.servesAt(ld, blk, parts) {
				return nil
			}
			// The states after the block: s starts on them where the block serves
			// (the last such block's states are the ones s keeps).
			for gi, part := range parts {
				if g := &groups[gi]; g.state > 0 {
					if err := s.bufs[g.first].writeAt(0, part); err != nil {
						return err
					}
				}
			}
			stated = true
			return nil
		})
		if err != nil {
			t.loadFailed(ctx, i, blk, err, invalid)
			if invalid && tg.states > 0 {
				// A value without states never replaces one the tier holds (see
				// writeBackGroups), so a refused one would stay: deleted, so that a
				// write-down may put a good one there.
				_ = tier.Delete(ctx, keys[got])
			}
			break
		}
		t.count(i, func(st *TierStats) { st.LoadBytes += int64(size) })
		serves := t.servesAt(ld, blk, parts)
		end := (blk + 1) * bt
		for gi := range groups {
			g := &groups[gi]
			if !g.windowed() {
				continue
			}
			// Where the part leaves a gap after what s held before the block, s
			// holds the group's tokens from the part's first on.
			if from, gap := t.partFrom(gi, blk, len(parts[gi]), ld.m); gap {
				ld.held[gi], ld.gap = from, true
			}
		}
		if serves && (tg.states == 0 || stated) {
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

// servesAt reports whether a lookup whose loads found ld so far serves a hit at the
// end of block blk once it holds that block's value, whose group parts are parts (only
// their lengths are read): every window group holds, without a gap, what the step
// there reads (the window rule). A part that leaves a gap after what s held before
// the block moves the group's first held token to where the part starts.
func (t *pcTiers) servesAt(ld *groupLoad, blk int, parts [][]byte) bool {
	end := (blk + 1) * t.bt
	for gi := range t.c.groups {
		g := &t.c.groups[gi]
		if !g.windowed() {
			continue
		}
		held := ld.held[gi]
		if from, gap := t.partFrom(gi, blk, len(parts[gi]), ld.m); gap {
			held = from
		}
		if !g.serves(held, end) {
			return false
		}
	}
	return true
}

// partFrom returns the first token of window group gi's part of n bytes in the
// value of block blk (a part is the group's last units of the block), and whether it
// leaves a gap after what a lookup's sequence, which holds the device's match of m
// tokens, held before the block: a part that starts past the block's first token
// and past m.
func (t *pcTiers) partFrom(gi, blk, n, m int) (from int, gap bool) {
	g := &t.c.groups[gi]
	from = (blk+1)*t.bt - n/g.unit*g.tpb
	return from, from > max(blk*t.bt, m)
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
	t.holdStates(e, &p)
	return &pcEntry{seq: h, closed: true, wb: &tierWrite{t: t, parts: []tierPart{p}}}
}

// pickTrim is pick for the checkpoints cks that eviction takes from leaf's entry e
// while e keeps its units (trimCheckpoints): the tier block ending at each of them
// (each on a tier block's end) goes down with its states, from a holder that maps
// those blocks' units, as a cut's blocks do (pickCutGroups). It returns that holder as
// an entry to close, or nil. pc.mu is held.
func (t *pcTiers) pickTrim(e *pcEntry, leaf *radix.Node[*pcEntry], cks []*checkpoint) *pcEntry {
	if t == nil || t.grp == nil || !t.keep(e) || e.seq == nil || e.seq.err != nil {
		return nil
	}
	bt, tokens, ns, held := t.bt, leaf.Tokens(), t.spaceNS(e.ns), e.seq.helds()
	var parts []tierPart
	span := tierPart{first: math.MaxInt, held: held}
	for _, ck := range cks {
		if ck.n%bt != 0 || ck.n > e.n || ck.bufs == nil || ck.down {
			continue // off a block's end, or written down already
		}
		b := ck.n/bt - 1
		parts = append(parts, tierPart{tokens: tokens[:(b+1)*bt], first: b, last: b + 1, ns: ns, held: held, cks: []*checkpoint{ck}})
		span.first, span.last = min(span.first, b), max(span.last, b+1)
	}
	if len(parts) == 0 {
		return nil
	}
	h := t.holderGroups(e.seq, &span)
	if h == nil {
		return nil
	}
	for _, p := range parts {
		holdWrite(p.cks[0])
	}
	return &pcEntry{seq: h, closed: true, wb: &tierWrite{t: t, parts: parts}}
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
