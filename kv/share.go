package kv

// Sharing: a new holder of a sequence's first n tokens (a fork, a frozen prefix, a
// sequence started on a prefix or on a cached entry) maps the whole sharing units
// (granules, or blocks) read-only and copies the tokens past them (shareGroups), and
// the holder they came from stops writing them (protect). Fork, ForkAt and Freeze
// (sequence.go), NewSequenceFrom (prefix.go) and the prefix cache's hits all share
// through these.

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/backing"
)

// startShared records that s, a new sequence, holds n tokens whose first fulls[gi]
// bytes of each of group gi's ranges are shared and whose window groups hold their
// tokens from held[gi] on (shareGroups' fulls and held).
func (s *Sequence) startShared(n int, fulls, held []int) {
	s.n = n
	for gi := range s.c.groups {
		*s.frozenOf(gi) = fulls[gi]
		if s.gs != nil {
			s.gs[gi].held = held[gi]
		}
	}
}

// readOnly makes [off, off+n) of each range read-only, in order. When one fails it
// gives write access back to those it protected, and returns the failure and what
// failed to give write access back (nil when each range is as it was).
func readOnly(bufs []buffer, off, n int) (err, restore error) {
	for i, b := range bufs {
		if err := b.protect(off, n, backing.ReadOnly); err != nil {
			var errs []error
			for _, q := range bufs[:i] {
				if rerr := q.protect(off, n, backing.ReadWrite); rerr != nil {
					errs = append(errs, rerr)
				}
			}
			return err, errors.Join(errs...)
		}
	}
	return nil, nil
}

// protect makes the first full bytes of each of s's ranges shared: never written
// from now on, and read-only in s's own mapping where the backing can protect memory
// in place. On error s is as it was.
func (s *Sequence) protect(full int) error {
	if full <= s.frozen {
		return nil
	}
	s.lockRanges()
	defer s.unlockRanges()
	return s.protectGroup(0, full)
}

// protectGroups is protect for each group gi of its first fulls[gi] bytes. On error
// s is as it was (or damaged, where write access could not be given back).
func (s *Sequence) protectGroups(fulls []int) error {
	if len(fulls) == 1 {
		return s.protect(fulls[0])
	}
	s.lockRanges()
	defer s.unlockRanges()
	was := make([]int, len(fulls))
	for gi, full := range fulls {
		was[gi] = *s.frozenOf(gi)
		if err := s.protectGroup(gi, full); err != nil {
			// Give back write access to what the groups before gi protected.
			for gj := range gi {
				if from, to := s.protectable(gj, was[gj]), *s.frozenOf(gj); s.c.protector && to > from {
					if rerr := setAccess(s.c.groups[gj].ranges(s.bufs), from, to-from, backing.ReadWrite); rerr != nil {
						s.err = rerr
						return errors.Join(err, fmt.Errorf("%w: restoring write access: %w", ErrDamaged, rerr))
					}
				}
				*s.frozenOf(gj) = was[gj]
			}
			return err
		}
	}
	return nil
}

// protectable returns where protecting group gi's ranges from frozen bytes on starts:
// at frozen, or at the ranges' Start where a window gave the bytes below back.
func (s *Sequence) protectable(gi, frozen int) int {
	return max(frozen, s.bufs[s.c.groups[gi].first].Start())
}

// protectGroup is protect for group gi's ranges, under the ranges' lock.
func (s *Sequence) protectGroup(gi, full int) error {
	frozen := s.frozenOf(gi)
	if full <= *frozen {
		return nil
	}
	if from := s.protectable(gi, *frozen); s.c.protector && full > from {
		if err, rerr := readOnly(s.c.groups[gi].ranges(s.bufs), from, full-from); rerr != nil {
			s.err = rerr
			return errors.Join(err, fmt.Errorf("%w: restoring write access: %w", ErrDamaged, rerr))
		} else if err != nil {
			return err
		}
	}
	*frozen = full
	s.guarded = s.guarded || s.c.protector
	return nil
}

// setAccess sets [off, off+n) of each range to prot, and returns the failures.
func setAccess(bufs []buffer, off, n int, prot backing.Protection) error {
	var errs []error
	for _, b := range bufs {
		if err := b.protect(off, n, prot); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// shareGroups makes each dst range hold the first n tokens of its src range: the
// whole sharing units (granules, or blocks) mapped read-only, the tokens past them
// copied; dst ranges must be empty, and on error they are left for the caller to
// close. fulls[gi] gets the bytes group gi shares per range, counted from 0, and
// held[gi], where held is not nil, the first token dst holds of a window group
// (heldOn), src holding them from srcHeld[gi] on (nil: from 0). A window
// group's dst ranges start at the unit that holds its FirstLive(n) (dropOff): the
// parent's whole units from there on are mapped, the ones below never committed. NB:
// where the step at n reads none of a window group's tokens (serves) src may hold
// none of them below n: the unit that holds token n is then committed for the step's
// sake, its tokens below n copied only where src still commits them (the new holder
// holds none of them: heldOn).
func (c *Cache) shareGroups(dst, src []buffer, srcHeld []int, n int, fulls, held []int) error {
	return c.shareGroupsFrom(dst, src, srcHeld, n, fulls, held, false, nil, stateSrc{})
}

// shareGroupsFrom is shareGroups; with keep, a window group's dst ranges start where
// its src ranges do where that is at or below its dropOff(n), and where below
// (another holder of src's first below.n tokens, or nil) holds whole units of a
// window group under that, up to it, those are mapped from below first. A recurrent
// group's states come from st (see stateSrc): src's, a checkpoint's, or none.
func (c *Cache) shareGroupsFrom(dst, src []buffer, srcHeld []int, n int, fulls, held []int, keep bool, below *Sequence, st stateSrc) error {
	for gi := range c.groups {
		g := &c.groups[gi]
		full, size, lo := g.shareable(n), g.extent(n), g.dropOff(n)
		d, sr := g.ranges(dst), g.ranges(src)
		if g.state > 0 {
			if done, err := st.copyIn(g, d, n); done || err != nil {
				fulls[gi] = 0
				if err != nil {
					return err
				}
				continue
			}
		}
		var bl []buffer
		if keep && g.windowed() && sr[0].Start() <= lo {
			// Where src holds nothing below n that the step at n reads and its window
			// starts past lo, there is nothing of it to keep.
			lo = sr[0].Start()
			if below != nil && lo <= g.shareable(below.n) {
				if bl = g.ranges(below.bufs); bl[0].Start() >= lo {
					bl = nil
				}
			}
		}
		for i := range d {
			if bl != nil {
				b0 := bl[i].Start()
				if err := d[i].StartAt(b0); err != nil {
					return err
				}
				if err := d[i].shareRange(bl[i], b0, lo-b0, backing.ReadOnly); err != nil {
					return err
				}
			} else if lo > 0 {
				if err := d[i].StartAt(lo); err != nil {
					return err
				}
			}
			// NB: nothing whole to share (n = 0, say) may lie below what a window
			// of src still holds, which the arena refuses to share from.
			if full > lo {
				if err := d[i].shareRange(sr[i], lo, full-lo, backing.ReadOnly); err != nil {
					return err
				}
			}
			if err := d[i].Resize(size); err != nil {
				return err
			}
			if sr[i].Start() > full {
				continue // src gave the tail's unit back: the step at n reads none of it
			}
			if err := g.copyTail(d[i], sr[i], n); err != nil {
				return err
			}
		}
		fulls[gi] = full
		if held != nil && g.windowed() {
			h := 0
			if srcHeld != nil {
				h = srcHeld[gi]
			}
			if bl != nil && h <= g.heldFrom(lo) {
				h = below.gs[gi].held // below's units lie under src's first
			}
			held[gi] = g.heldOn(d[0].Start(), h, n)
		}
	}
	return nil
}
