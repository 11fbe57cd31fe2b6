package kv

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/backing"
)

// The step's side of map-ahead (see ahead.go): a batch step adopts the runs it
// crosses into before it commits what is left, and a step that is refused or fails
// afterwards gives back what it adopted, so that it changes nothing.

// adopt settles the runs of the batch's sequences that the step needs (the growth
// of their group crosses into them; the other groups' stay), and returns whether
// any adopted one.
func (a *ahead) adopt(batch []Growth) (bool, error) {
	adopted := false
	for _, g := range batch {
		s := g.Seq
		got := false
		for gi := range s.ahead {
			r := &s.ahead[gi]
			if !r.on || s.groupNeed(gi, s.n+g.Tokens) == 0 {
				continue
			}
			if !got {
				for gi := range s.c.groups {
					*s.preOf(gi) = rangeEnd(s.bufs[s.c.groups[gi].first])
				}
			}
			upto, _ := backing.AlignUp(s.c.groups[gi].extent(s.n+g.Tokens), s.c.gran)
			ok, err := a.settle(s, r, upto)
			if ok {
				got, s.adopted = true, true
			}
			if err != nil {
				return adopted, err
			}
		}
		if got {
			adopted = true
			s.refreshStats()
		}
	}
	return adopted, nil
}

// unadopt undoes the adoptions of a batch step that was refused or failed: the
// ranges of each sequence that adopted runs go back to what they committed before
// (pre), the granules adopted (and the rest of a run adopted in part, which no
// longer starts where they end) going idle to the pool (a backing call each, on a
// step that fails anyway), so that a refused step leaves no sequence holding more
// than its tokens need. A range that can not go back damages its sequence.
func (a *ahead) unadopt(batch []Growth) error {
	if a == nil {
		return nil
	}
	var errs []error
	for _, g := range batch {
		s := g.Seq
		if !s.adopted {
			continue
		}
		s.adopted = false
		var serrs []error
		for gi := range s.ahead {
			// NB: the rest of a run adopted in part lies past what the ranges keep;
			// the other runs start where they end, and stay.
			if r := &s.ahead[gi]; r.on && r.off != *s.preOf(gi) {
				if _, err := a.settle(s, r, -1); err != nil {
					serrs = append(serrs, err)
				}
			}
		}
		s.lockRanges()
		for gi := range s.c.groups {
			grp := &s.c.groups[gi]
			pre := *s.preOf(gi)
			for _, b := range grp.ranges(s.bufs) {
				if rangeEnd(b) > pre {
					if err := b.Resize(pre); err != nil {
						serrs = append(serrs, err)
					}
				}
			}
		}
		s.unlockRanges()
		if err := errors.Join(serrs...); err != nil {
			s.err = err
			errs = append(errs, fmt.Errorf("%w: sequence %d: giving back the runs it adopted: %w", ErrDamaged, s.id, err))
		}
		s.refreshStats()
	}
	return errors.Join(errs...)
}

// step adopts the runs that a batch step crosses into (it needs need bytes of new
// granules without them) and returns what the step still needs, and whether it
// adopted any.
func (a *ahead) step(batch []Growth, need int64) (int64, bool, error) {
	adopted, err := a.adopt(batch)
	if err != nil {
		return need, false, joinNonNil(err, a.unadopt(batch))
	}
	if !adopted {
		return need, false, nil
	}
	need = 0
	for _, g := range batch {
		need += g.Seq.need(g.Seq.n + g.Tokens)
	}
	return need, true, nil
}
