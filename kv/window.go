package kv

import "fmt"

// The states of a window group's bytes. In a SlidingWindow or ChunkedLocal group a
// token's bytes are in one of three states, per range:
//
//  1. Reserved, never held: past the committed end (tokens not yet appended).
//  2. Held: committed, from the group's first held token (groupState.held: the
//     first wholly at or past the range's Start, or later: see 3) on. A held token
//     keeps its address (the group's base never moves) and is read and written as
//     in a full group.
//  3. Dropped: below the first held token. Below Start the bytes were given back to
//     the pool by DecommitBelow and are Reserved again; the only dropped tokens
//     past Start are those below n in the unit that a holder of n tokens whose
//     step reads none of the group's (a chunk boundary) commits for token n's sake,
//     which are no holder's. Reading, writing or viewing a dropped token fails with
//     ErrDropped. A dropped token never becomes held again, but for Truncate(0),
//     which empties the group and starts it over from 0.
//
// The transitions:
//
//   - Append (and AppendBatch) of a sequence of n tokens moves the new tokens from 1
//     to 2 as in a full group and, once the step's growth is committed, the whole
//     units (granules; Blocked: blocks) below the unit of FirstLive(n) from 2 to 3.
//     NB: FirstLive of the length the step grows from, not the one it reaches: the
//     step's own tokens [n, n+k) are written after the append and read keys from
//     FirstLive(n) on (a prefill chunk longer than the window included), so the
//     tokens only the step's later queries skip go with the next append (vLLM gives
//     back a window's blocks by its computed tokens, before the step, likewise).
//     Need counts the step's commits before that give-back (the granules given back
//     go idle in the pool, where the next step finds them).
//   - Truncate to n keeps the held tokens below n. It is refused with ErrDropped
//     when the group has dropped a token the step at n reads (the window rule:
//     group.serves): the cache can not bring dropped tokens back, and recomputing
//     them is the caller's. A rollback of a few tokens within the granule that holds
//     FirstLive works. Where the step at n reads none of the group's tokens (a chunk
//     boundary) and the group holds none below n, its ranges are emptied and start
//     over at the unit that holds token n (restartGroup): its tokens there below n
//     are in state 3 though committed, and FirstHeld is n.
//   - ForkAt(n) is refused with ErrDropped in the same case. Otherwise the new
//     sequence's window group starts at the sharing unit (block, or granule) that
//     holds FirstLive(n): the whole units from there to the last whole one below n
//     are mapped from the parent (ShareRange of a middle range), the tail copied
//     where the parent still holds it, and the units below FirstLive(n) are never
//     committed in the child (StartAt). Its first held token is heldOn's.
//   - Close gives back everything held.
//
// A full or MLA group never drops a token. An MLA group has one tensor per layer, the
// latent, addressed as K: it has no V. A Recurrent group holds one state of
// StateBytes per layer, in one range, from the sequence's first token on; a fork
// copies it (never shares it), Truncate keeps it as it is (a state is a function of
// every token, which the cache does not keep: restoring an earlier state is the
// caller's) but for Truncate(0), which gives it back. Freeze works per group as
// ForkAt does (the prefix holds what a fork at its length would, and NewSequenceFrom
// starts a sequence on it as ForkAt would), on a model without recurrent groups.
// The prefix cache works on a model of one full or one MLA group (DeepSeek-V3/R1: one
// latent per layer, laid out as a full group's K and V are, so the one-group paths
// serve it) and on one of window groups beside full or MLA ones, by references per
// group and unit (prefixcache_groups.go), with events and tiers per group there
// (prefixcache_tier_groups.go). Map-ahead
// works on every group that holds tokens, each with a run of its own (see ahead.go),
// and leaves recurrent states out. A model with a Recurrent group has a prefix cache
// of checkpoints, states the server records (prefixcache_checkpoint.go).

// dropOff returns the byte offset below which g's ranges hold only tokens a sequence
// of n tokens no longer reads: the start of the sharing unit (block, or granule)
// that holds FirstLive(n). It is 0 for a group that reads every token.
func (g *group) dropOff(n int) int {
	if !g.windowed() {
		return 0
	}
	first := g.spec.FirstLive(n)
	if g.layout == Blocked {
		return first / g.tpb * g.blk
	}
	return first * g.row / g.unit * g.unit
}

// heldFrom returns the first token that lies wholly at or past start bytes: the first
// a range with that Start still holds.
func (g *group) heldFrom(start int) int { return g.writableFrom(start) }

// groupState is what a sequence of a cache on a Model keeps per group.
type groupState struct {
	frozen int // bytes at the start of each of the group's ranges that other holders may map
	held   int // the first token the group's ranges still hold (window groups)
	pre    int // while the running batch step resized them: the bytes committed before
	// behind is what a window group left behind for the map-ahead worker to give
	// back (see ahead_behind.go), guarded by the cache's ahead.mu.
	behind seqBehind
}

// frozenOf returns where s keeps the frozen bytes of group gi: Sequence.frozen in a
// one-group cache.
func (s *Sequence) frozenOf(gi int) *int {
	if s.gs == nil {
		return &s.frozen
	}
	return &s.gs[gi].frozen
}

// preOf returns where s keeps what group gi committed before the running step.
func (s *Sequence) preOf(gi int) *int {
	if s.gs == nil {
		return &s.pre
	}
	return &s.gs[gi].pre
}

// heldOf returns the first token group gi still holds.
func (s *Sequence) heldOf(gi int) int {
	if s.gs == nil {
		return 0
	}
	return s.gs[gi].held
}

// rangeEnd returns the end of b's committed bytes.
func rangeEnd(b buffer) int { return b.Start() + b.Committed() }

// dropDead gives back, in each window group, the whole units that hold only tokens
// that no step of s from n tokens on reads. A failure damages s: its ranges may no
// longer be alike.
func (s *Sequence) dropDead(n int) error {
	gave := false
	defer func() {
		if h := s.c.hooks(); gave && h != nil {
			h.windowGaveBack(s) // what s mapped of a prefix cache's units there
		}
	}()
	for gi := range s.c.groups {
		g := &s.c.groups[gi]
		if !g.windowed() {
			continue
		}
		rs := g.ranges(s.bufs)
		off := g.dropOff(n)
		if off/s.c.gran*s.c.gran <= rs[0].Start() {
			continue
		}
		s.lockRanges()
		var err error
		if s.c.ahead != nil {
			err = s.c.ahead.leave(s, gi, rs, off)
		} else {
			for _, b := range rs {
				if err = b.DecommitBelow(off); err != nil {
					break
				}
			}
		}
		s.unlockRanges()
		if err != nil {
			s.err = err
			return fmt.Errorf("%w: giving back a window's granules: %w", ErrDamaged, err)
		}
		gave = true
		s.gs[gi].held = max(s.gs[gi].held, g.heldFrom(rs[0].Start()))
	}
	return nil
}

// serves is the window rule: it reports whether a holder of a sequence's first n
// tokens whose first held token of g is held has every token of g that the next step,
// at n, reads: [FirstLive(n), n). That is none at all where FirstLive(n) is n (a chunk
// boundary, a sliding window of one token, n = 0), which every holder serves,
// whatever its window gave back; a full or MLA group holds every token. Every fork,
// freeze, truncate, insert and prefix-cache hit of n tokens asks it (windowCheck,
// holdsWindow, lastServed), and nothing else states the rule.
func (g *group) serves(held, n int) bool {
	first := g.spec.FirstLive(n)
	return first == n || held <= first
}

// lastServed returns the most tokens m <= n for which g.serves(held, m). Where the
// step at n reads a token below held, so does the step at every m below n that reads
// any (FirstLive never decreases), so m is the last length below n whose step reads
// none of g's tokens: the chunk that holds n starts there (FirstLive(n), a fixed point
// of FirstLive), and a sliding window of more than one token has none but 0.
func (g *group) lastServed(held, n int) int {
	if g.serves(held, n) {
		return n
	}
	if m := g.spec.FirstLive(n); g.serves(held, m) && g.spec.FirstLive(m) == m {
		return m
	}
	return 0
}

// heldOn returns the first token of g that a new holder of a source's first n tokens
// holds, its ranges starting at start bytes, where the source held g's tokens from
// srcHeld on: those below srcHeld (and so, where srcHeld is past n, every one below n:
// the step at n reads none of them) are no holder's again, though a unit it commits
// for token n's sake spans them.
func (g *group) heldOn(start, srcHeld, n int) int {
	if !g.windowed() {
		return 0
	}
	return max(g.heldFrom(start), min(srcHeld, n))
}

// helds returns the first token s holds of each group (nil in a one-group cache).
func (s *Sequence) helds() []int {
	if s.gs == nil {
		return nil
	}
	held := make([]int, len(s.gs))
	for gi := range s.gs {
		held[gi] = s.gs[gi].held
	}
	return held
}

// windowCheck returns an ErrDropped error when a holder of s's first n tokens would
// need a token a window group of s has dropped (serves): op names the operation.
func (s *Sequence) windowCheck(op string, n int) error {
	if s.gs == nil {
		return nil
	}
	for gi := range s.c.groups {
		g := &s.c.groups[gi]
		if held := s.gs[gi].held; !g.serves(held, n) {
			return fmt.Errorf("%w: %s at %d tokens: group %d (%v, window %d) reads from token %d, but holds only the tokens from %d on",
				ErrDropped, op, n, gi, g.spec.Kind, g.spec.Window, g.spec.FirstLive(n), held)
		}
	}
	return nil
}
