package kv

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/internal/causes"
)

// The window's give-back off the token path (map-ahead, the default, on a Model with
// sliding-window or chunked-local groups): the step that moves a window past whole
// granules leaves them behind (arena.Buffer.LeaveBehind: they leave the ranges with
// no backing call and stay committed and charged), and the map-ahead worker gives
// them back (DecommitBehind), idle to the pool, where its next run takes them
// (granules that map a prefix's or a forked parent's are unmapped then). The step
// gives back itself, as without map-ahead, what LeaveBehind declines (a run the
// worker is giving back right now) and the granules of a sequence that maps a prefix
// cache's units: the cache's eviction counts on their mappings going when it is told
// they went (the windowGaveBack hook).
//
// A window group of a sequence has one record of what it left behind (seqBehind,
// in groupState), in one of these states, guarded by ahead.mu:
//
//  1. none: nothing left behind, or (bytes > 0) what a failed give-back kept, for
//     the next leave to queue again or the owner's settle to give back.
//  2. queued: in ahead.behind, for the worker. A later step's leave grows the
//     ranges' runs behind and the record's bytes.
//  3. dropping: a worker or a growth short of budget (drainBehind) gives it back,
//     outside every lock. Then none.
//
// Only the owner leaves granules behind and queues its record; only a worker or
// drainBehind moves queued to dropping and on; the owner settles the record
// (settleBehind: it waits out dropping, takes it off the queue and gives back what
// is left itself) before anything that changes its ranges but a step (Truncate,
// Close, ForkAt, Freeze, PrefixCache.Insert: see dropAhead).
//
// Accounting: the bytes left behind are owned and charged until given back, and
// Stats.Ahead shows them; no budget check counts them as the cache's own (freeing
// one may free nothing, where a prefix cache's entry maps its granules), but a
// growth that the budget would refuse first gives every record back and waits for
// those in flight (drainBehind), so that leaving behind never makes a growth of this
// cache refused where the step's own give-back would not have.

// behindState is the state of a window group's record of what it left behind.
type behindState uint8

const (
	behindNone behindState = iota
	behindQueued
	behindDropping
)

// seqBehind is what a window group of a sequence left behind, guarded by ahead.mu.
type seqBehind struct {
	state behindState
	bufs  []buffer // the group's ranges
	bytes int64    // left behind in them and not given back
	// owned is the part of bytes that the ranges committed themselves (not mapped
	// from another holder): the memory that giving them back may free.
	owned int64
}

// leave gives back the whole granules below off of s's ranges rs, those of window
// group gi: it leaves them behind for the worker where it can and gives back the
// rest itself (DecommitBelow). The caller holds the ranges (lockRanges). On error
// the ranges may differ: the caller damages the sequence.
func (a *ahead) leave(s *Sequence, gi int, rs []buffer, off int) error {
	rec := &s.gs[gi].behind
	causes.Lock(&a.mu, causes.WaitAhead)
	if rec.state != behindDropping && !a.stopped && !a.noLeave && s.pcl == nil {
		var bytes, owned int64
		for _, b := range rs {
			from, shared := b.Start(), b.Shared()
			left, err := b.LeaveBehind(off)
			if err != nil {
				a.mu.Unlock()
				return err
			}
			if left {
				n := int64(b.Start() - from)
				bytes += n
				owned += n - int64(shared-b.Shared())
			}
		}
		if bytes > 0 {
			rec.bufs = rs
			rec.bytes += bytes
			rec.owned += owned
			a.behindHeld.Add(owned)
		}
		if rec.bytes > 0 && rec.state == behindNone {
			// NB: no kick: a futex call on the step is what leaving behind saves.
			// The worker gives it back when it next wakes, for the run that a growing
			// sequence asks a unit of tokens before its next crossing, or to another
			// growth short of budget (drainBehind), or its owner's settle.
			rec.state = behindQueued
			a.behind = append(a.behind, rec)
		}
	}
	a.mu.Unlock()
	for _, b := range rs {
		// NB: a range that left its granules behind starts at off already: no call.
		if err := b.DecommitBelow(off); err != nil {
			return err
		}
	}
	return nil
}

// dropBehind gives back the first record queued, if any: the worker's work, and a
// short budget's (drainBehind). It returns the bytes given back (of mappings: what
// they free may be less, or more where theirs was a granule's last mapping) and
// whether it found one.
func (a *ahead) dropBehind() (int64, bool) {
	a.mu.Lock()
	if len(a.behind) == 0 {
		a.mu.Unlock()
		return 0, false
	}
	rec := a.behind[0]
	a.behind[0] = nil
	a.behind = a.behind[1:]
	rec.state = behindDropping
	a.behindOut++
	bufs := rec.bufs
	a.mu.Unlock()
	gave, _ := giveBackBehind(bufs) // NB: what failed stays with the record (none)
	a.mu.Lock()
	a.gaveBehind(rec, gave)
	rec.state = behindNone
	a.behindOut--
	a.cond.Broadcast()
	a.mu.Unlock()
	return gave, true
}

// giveBackBehind gives back the runs behind of bufs and returns their bytes.
func giveBackBehind(bufs []buffer) (int64, error) {
	var gave int64
	var errs []error
	for _, b := range bufs {
		n, err := b.DecommitBehind()
		gave += int64(n)
		if err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return gave, fmt.Errorf("kv: giving back a window's granules left behind: %w", err)
	}
	return gave, nil
}

// drainBehind gives back every record queued and waits for those given back
// meanwhile: a growth the budget would refuse first has them back. It reports
// whether any was given back, by it or meanwhile (what that frees is not known).
func (a *ahead) drainBehind() bool {
	if a == nil {
		return false
	}
	got := false
	for {
		n, ok := a.dropBehind()
		if !ok {
			break
		}
		got = got || n > 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for a.behindOut > 0 {
		got = true // NB: a give-back in flight; it lands before the wait ends
		a.cond.Wait()
	}
	return got
}

// settleBehind ends rec, a window group's record of s, before its owner changes the
// group's ranges: it waits while a worker gives it back, takes it off the queue, and
// gives back what is left itself.
func (a *ahead) settleBehind(rec *seqBehind) error {
	a.mu.Lock()
	for rec.state == behindDropping {
		a.cond.Wait()
	}
	if rec.state == behindQueued {
		for i, x := range a.behind {
			if x == rec {
				a.behind = append(a.behind[:i], a.behind[i+1:]...)
				break
			}
		}
		rec.state = behindNone
	}
	bufs, bytes := rec.bufs, rec.bytes
	a.mu.Unlock()
	if bytes == 0 {
		return nil
	}
	gave, err := giveBackBehind(bufs)
	a.mu.Lock()
	a.gaveBehind(rec, gave)
	a.mu.Unlock()
	return err
}

// gaveBehind counts gave bytes of rec given back: once nothing is left, its owned
// bytes leave Stats.Ahead (where some failed to go, they stay counted until the rest
// goes). a.mu must be held.
func (a *ahead) gaveBehind(rec *seqBehind, gave int64) {
	if rec.bytes -= gave; rec.bytes == 0 {
		a.behindHeld.Add(-rec.owned)
		rec.owned = 0
	}
}

// leftBehind returns the bytes windows left behind that are not given back yet.
func (a *ahead) leftBehind() int64 {
	if a == nil {
		return 0
	}
	return a.behindHeld.Load()
}
