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
// Probe finds the last value of a tier's run that carries the states, with no value
// read whole.

// probeScratch is a Probe's buffers for the prompt's block hashes and keys, kept in
// probeScratches between Probes so that one allocates nothing; and, for the peeks at
// values (lastStated), the value's layout and key, its parts' lengths, what the last
// peek found, and the function Peek calls, made once per scratch.
type probeScratch struct {
	hashes []blockhash.Hash
	keys   []tierval.Key

	grp    *tierGroups
	key    tierval.Key
	lens   []int
	stated bool
	use    func(head []byte) error
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
// group's part whole, which a load serves a hit after. A head PeekParts refuses is
// its error.
func (sc *probeScratch) peeked(head []byte) error {
	tg := sc.grp
	sc.lens = slices.Grow(sc.lens[:0], len(tg.parts))[:len(tg.parts)]
	if err := tierval.PeekParts(head, sc.key, tg.layout, tg.parts, sc.lens); err != nil {
		return err
	}
	for gi, n := range sc.lens {
		if n != tg.parts[gi] {
			return nil // a part missing: no states, or a block no load takes
		}
	}
	sc.stated = true
	return nil
}

// lastStated returns how many of keys, a run tier i holds, from the first, a load
// serves a hit after, on a model of recurrent groups and no window group: up to the
// last block whose value carries the states (0 for none), found by peeking at the
// values' heads from the last back, for a Probe. A value gone since Contains, or whose
// head is refused, serves nothing. Without states to find, from a tier that can not
// peek (TierPeeker), or where a peek fails otherwise (the tier's failure, or ctx's
// end), it is the whole run: an upper bound.
func (t *pcTiers) lastStated(ctx context.Context, i int, keys []tierval.Key, sc *probeScratch) int {
	if t.grp == nil || t.grp.states == 0 || t.grp.windows || t.peek[i] == nil {
		return len(keys)
	}
	sc.grp = t.grp
	for j := len(keys) - 1; j >= 0; j-- {
		sc.key, sc.stated = keys[j], false
		err := t.peek[i].Peek(ctx, keys[j], t.grp.layout.HeadSize(), sc.use)
		switch {
		case err == nil && sc.stated:
			return j + 1
		case err == nil, errors.Is(err, ErrTierMiss), errors.Is(err, tierval.ErrValue):
		default:
			return len(keys)
		}
	}
	return 0
}
