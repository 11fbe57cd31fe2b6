package kv

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kv/tierval"
)

// Peeking at the heads of tier values (TierPeeker): on a model of window or recurrent
// groups, a Probe finds the last block of a tier's run that a load serves a hit at,
// from the lengths of the values' parts, with no value read whole.

// probeScratch is a Probe's buffers for the prompt's block hashes and keys, kept in
// probeScratches between Probes so that one allocates nothing; and, for the peeks at
// values (lastServed), the tiers' part, the block a peek is for and its key, what each
// peek of the run found (per block: its state and its parts' lengths), and the
// function Peek calls, made once per scratch.
type probeScratch struct {
	hashes []blockhash.Hash
	keys   []tierval.Key

	t     *pcTiers
	at    int
	key   tierval.Key
	found []peekFound
	lens  []int // per block of the run, its parts' lengths: block j's at j×groups
	use   func(head []byte) error
}

// peekFound is what a probe knows of one block's value of a tier's run.
type peekFound uint8

const (
	peekNot    peekFound = iota // not peeked at
	peekBad                     // gone since Contains, or a head a load refuses
	peekOK                      // a value a load takes, without the states
	peekStated                  // a value a load takes, with every recurrent group's state
)

// probeScratches keeps the probes' buffers of every prefix cache: their sizes
// follow the prompts, not a cache.
var probeScratches = sync.Pool{New: func() any {
	sc := new(probeScratch)
	sc.use = sc.peeked
	return sc
}}

// peeked reads a peeked value's head (Peek's use) into block sc.at's lengths and
// state. A head PeekParts refuses is its error. A value whose full or MLA group's
// part is not whole, or with the states of only some recurrent groups, is one a load
// refuses (loadFromGroups): bad.
func (sc *probeScratch) peeked(head []byte) error {
	tg, groups := sc.t.grp, sc.t.c.groups
	lens := sc.lens[sc.at*len(groups) : (sc.at+1)*len(groups)]
	if err := tierval.PeekParts(head, sc.key, tg.layout, tg.parts, lens); err != nil {
		return err
	}
	states := 0
	for gi, n := range lens {
		g := &groups[gi]
		switch {
		case g.state > 0:
			if n == tg.parts[gi] {
				states++
			}
		case !g.windowed() && n != tg.parts[gi]:
			sc.found[sc.at] = peekBad
			return nil
		}
	}
	switch states {
	case 0:
		sc.found[sc.at] = peekOK
	case tg.states:
		sc.found[sc.at] = peekStated
	default:
		sc.found[sc.at] = peekBad
	}
	return nil
}

// peekAt returns what block j of keys, a run of tier i, holds, peeking at its head
// the first time it is asked; ok is false where the peek failed otherwise than by a
// value gone or refused (the tier's failure, ctx's end, or a Peek that returned
// without calling use, against TierPeeker's contract).
func (sc *probeScratch) peekAt(ctx context.Context, i int, keys []tierval.Key, j int) (peekFound, bool) {
	if sc.found[j] != peekNot {
		return sc.found[j], true
	}
	sc.at, sc.key = j, keys[j]
	err := sc.t.peek[i].Peek(ctx, keys[j], sc.t.grp.layout.HeadSize(), sc.use)
	switch {
	case err == nil && sc.found[j] == peekNot:
		return peekNot, false // no head read: its lengths are not this value's
	case err == nil:
	case errors.Is(err, ErrTierMiss), errors.Is(err, tierval.ErrValue):
		sc.found[j] = peekBad
	default:
		return peekNot, false
	}
	return sc.found[j], true
}

// lastServed returns how many of keys, a run tier i holds of the prompt's blocks b on,
// from the first, a lookup whose device match is m serves a hit after (loadGroups):
// up to the last block at whose end every window group holds what the step reads
// (servesAt: the parts' lengths in the heads of that block's value and of the blocks
// before it that the step reads) and, with recurrent groups, whose value carries the
// states; blocks past a value gone since Contains or refused are not served. It is 0
// where none serves. On one group, on groups with neither windows nor states, from a
// tier that can not peek (TierPeeker), or where a peek fails otherwise (the tier's
// failure, or ctx's end), it is the whole run: an upper bound. It peeks at each value
// at most once: at the last block and back, and, with window groups, at the blocks
// whose tokens the step at a candidate reads.
//
// NB: it needs no more of the lookup's sequence than m: what it holds of a window
// group before the run's blocks is what the step at m or at an earlier tier's last
// served block reads (the step there was served), and a step further on reads no
// less far on (FirstLive never decreases), so only the run's own blocks can leave a
// gap that a step past them reads.
func (t *pcTiers) lastServed(ctx context.Context, i int, keys []tierval.Key, b, m int, sc *probeScratch) int {
	tg := t.grp
	if tg == nil || tg.states == 0 && !tg.windows || t.peek[i] == nil {
		return len(keys)
	}
	groups := t.c.groups
	sc.t = t
	sc.found = slices.Grow(sc.found[:0], len(keys))[:len(keys)]
	clear(sc.found)
	sc.lens = slices.Grow(sc.lens[:0], len(keys)*len(groups))[:len(keys)*len(groups)]
	clear(sc.lens) // no length of an earlier Probe's values is read as this one's
	// The scratch outlives the cache in probeScratches.
	defer func() { sc.t = nil }()
	for j := len(keys) - 1; j >= 0; j-- {
		f, ok := sc.peekAt(ctx, i, keys, j)
		switch {
		case !ok:
			return len(keys)
		case f == peekBad || tg.states > 0 && f != peekStated:
			continue
		}
		serves, bad, ok := t.windowsServe(ctx, i, keys, b, m, j, sc)
		switch {
		case !ok:
			return len(keys)
		case serves:
			return j + 1
		case bad >= 0:
			j = bad // a load stops at block bad: none past it serves
		}
	}
	return 0
}

// windowsServe reports whether every window group holds what the step at the end of
// block j of keys (the prompt's block b+j) reads, for lastServed: no block of the run
// from the first whose tokens the step reads leaves a gap past where the step reads
// from (partFrom). bad is a block among them whose value is gone or refused (-1 for
// none), at which a load stops; ok is false where a peek failed otherwise.
func (t *pcTiers) windowsServe(ctx context.Context, i int, keys []tierval.Key, b, m, j int, sc *probeScratch) (serves bool, bad int, ok bool) {
	bt, groups := t.bt, t.c.groups
	end := (b + j + 1) * bt
	for gi := range groups {
		g := &groups[gi]
		if !g.windowed() {
			continue
		}
		first := g.spec.FirstLive(end)
		if first == end {
			continue // the step reads none of the group's tokens
		}
		// NB: a block that ends at or below first can not leave a gap past it.
		for k := max(0, first/bt-b); k < j; k++ {
			f, ok := sc.peekAt(ctx, i, keys, k)
			switch {
			case !ok:
				return false, -1, false
			case f == peekBad:
				return false, k, true
			}
			if from, gap := t.partFrom(gi, b+k, sc.lens[k*len(groups)+gi], m); gap && from > first {
				return false, -1, true
			}
		}
		if from, gap := t.partFrom(gi, b+j, sc.lens[j*len(groups)+gi], m); gap && from > first {
			return false, -1, true
		}
	}
	return true, -1, true
}
