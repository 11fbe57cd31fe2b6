package kv

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kv/tierval"
)

// Peeking at the heads of tier values (TierPeeker): on a model of recurrent groups, a
// Probe and a load find the last value of a tier's run that carries the states, with
// no value read whole.

// probeScratch is a Probe's buffers for the prompt's block hashes and keys, kept in
// probeScratches between Probes so that one allocates nothing; and, for the peeks at
// values (lastStated, which a load calls too), the value's layout and key, its parts'
// lengths, what the last peek found, and the function Peek calls, made once per
// scratch.
type probeScratch struct {
	hashes []blockhash.Hash
	keys   []tierval.Key

	grp         *tierGroups
	key         tierval.Key
	lens        []int
	stated, bad bool
	use         func(head []byte) error
}

// probeScratches keeps the probes' buffers of every prefix cache: their sizes
// follow the prompts, not a cache.
var probeScratches = sync.Pool{New: func() any {
	sc := new(probeScratch)
	sc.use = sc.peeked
	return sc
}}

// peeked reads a peeked value's head (Peek's use), on a model with no window group:
// stated is whether the value carries every recurrent group's state and every other
// group's part whole, which a load serves a hit after; bad whether it is one a load
// refuses (a group's part short, or the states of only some groups: see
// loadFromGroups). A head PeekParts refuses is its error.
func (sc *probeScratch) peeked(head []byte) error {
	tg := sc.grp
	sc.lens = slices.Grow(sc.lens[:0], len(tg.parts))[:len(tg.parts)]
	if err := tierval.PeekParts(head, sc.key, tg.layout, tg.parts, sc.lens); err != nil {
		return err
	}
	states := 0
	for gi, n := range sc.lens {
		switch {
		case tg.per[gi] == 0 && n == tg.parts[gi]:
			states++ // a recurrent group's state
		case tg.per[gi] == 0:
			// none
		case n != tg.parts[gi]:
			sc.bad = true
			return nil
		}
	}
	sc.stated = states == tg.states
	sc.bad = states != 0 && !sc.stated
	return nil
}

// lastStated returns, for a run keys of tier i's blocks, how many of them from the
// first a load serves a hit after (serve) and how many it reads (reach), on a model
// of recurrent groups and no window group: serve is up to the last block whose value
// carries the states (0 for none), which it finds by peeking at the values' heads
// from the last back; reach is serve, or past it up to the last value a load refuses
// (so that the load counts it, and deletes it for a good one to take its place). A
// value gone since Contains is passed over. Without states to find, from a tier that
// can not peek (TierPeeker), or where a peek fails otherwise (the tier's failure, or
// ctx's end), both are the whole run, as without peeking: an upper bound for a
// Probe, and a load that reads the run and counts what fails.
func (t *pcTiers) lastStated(ctx context.Context, i int, keys []tierval.Key, sc *probeScratch) (serve, reach int) {
	if t.grp == nil || t.grp.states == 0 || t.grp.windows || t.peek[i] == nil {
		return len(keys), len(keys)
	}
	sc.grp = t.grp
	for j := len(keys) - 1; j >= 0; j-- {
		sc.key, sc.stated, sc.bad = keys[j], false, false
		err := t.peek[i].Peek(ctx, keys[j], t.grp.layout.HeadSize(), sc.use)
		switch {
		case err == nil && sc.stated:
			return j + 1, max(j+1, reach)
		case err == nil && sc.bad, errors.Is(err, tierval.ErrValue):
			reach = max(reach, j+1)
		case err == nil, errors.Is(err, ErrTierMiss):
		default:
			return len(keys), len(keys)
		}
	}
	return 0, reach
}
