package host

import (
	"context"
	"fmt"
	"slices"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// The commit transaction of a Shared backing: choose the granules (idle ones first),
// charge the new ones (waiting for the budget in CommitCtx), create and map them,
// populate them, and record them; a failed step undoes the steps before it.
//
// A commit takes idle slots first and creates new ones (Free to Live, or private) only
// for the rest, charging the authority for all of them at once before anything is
// touched. It places the granules of one commit, and a granule after its predecessor
// in the reservation, at consecutive file offsets where it can, and maps each
// consecutive run with one call, so that the kernel merges them into one mapping and
// the process's count of mappings (vm.max_map_count) stays low.

// Commit moves [off, off+size) of r from Reserved to Committed: idle pooled granules
// first, new ones for the rest. New granules are charged to the authority all at once
// before anything is touched; when the budget refuses, Commit returns the
// *accounting.BudgetError (errors.Is(err, accounting.ErrBudgetExceeded)) inside an
// *OpError and changes nothing. A pooled granule keeps its old contents.
func (s *Shared) Commit(r *SharedReservation, off, size int) error {
	return s.commit(context.Background(), r, off, size, false)
}

// CommitCtx is Commit that, when the budget refuses the new granules, waits in FIFO
// order with the device's other waiters (Authority.AcquireIdle) until ctx ends, then
// commits with the bytes it waited for. It holds nothing while it waits: the idle
// granules it would have taken stay in the pool, and it waits for the bytes of the
// whole range, so that waiting commits can not hold pieces each of them needs. The
// governor serves it from this pool's idle granules as from free budget: a granule
// that goes idle meanwhile is handed to the first waiting request of this pool rather
// than given to the OS and made again; only when another owner's request waits too
// do idle granules go back to the OS at once. When ctx ends first it returns
// ctx.Err() (wrapped) and the range is as it was.
func (s *Shared) CommitCtx(ctx context.Context, r *SharedReservation, off, size int) error {
	return s.commit(ctx, r, off, size, true)
}

// sharedPick is a slot chosen for a commit.
type sharedPick struct {
	slot  int
	fresh bool // Free before: created by this commit
}

func (s *Shared) commit(ctx context.Context, r *SharedReservation, off, size int, wait bool) error {
	op := "commit"
	if wait {
		op = "commit ctx"
	}
	if err := s.lockRange(op, r, off, size, false); err != nil {
		return err
	}
	gi, n := off>>s.shift, size>>s.shift
	if n == 0 {
		s.mu.Unlock()
		return nil
	}
	hint := -1
	priv := 0 // private granules to create, after the pooled ones
	if gi > 0 && r.maps[gi-1].at != 0 {
		hint = r.maps[gi-1].slot() + 1 // continue the file run of the granule before
	}
	// Idle private granules first (only a backing that makes them has any), then
	// idle memfd granules, then new ones.
	var pos []int
	k := s.claim(min(n, s.nIdle+s.nPrivIdle))
	if s.nPrivIdle > 0 {
		pos = s.takePrivIdle(min(k, s.nPrivIdle))
	}
	picks := s.pickIdle(k-len(pos), hint)
	if len(pos)+len(picks) < n {
		var fresh int
		var err error
		if picks, fresh, err = s.charge(ctx, op, r, off, size, n, picks, &pos, wait); err != nil {
			s.mu.Unlock()
			return s.undone(err, nil)
		}
		if s.huge.private() {
			priv = fresh
			fresh = 0
		} else if len(picks) > 0 {
			hint = picks[len(picks)-1].slot + 1
		}
		var more []sharedPick
		if fresh > 0 {
			more, err = s.pickFresh(fresh, hint)
		}
		if err != nil {
			s.unpick(picks)
			s.untakePrivIdle(pos)
			bytes := int64(fresh) << s.shift
			s.owned -= bytes
			s.auth.Release(bytes)
			s.mu.Unlock()
			return s.opErr(op, off, size, err, true) // growing the park maps memory
		}
		picks = append(picks, more...)
		slices.SortFunc(picks, func(a, b sharedPick) int { return a.slot - b.slot })
		if s.populate && len(more) > 0 {
			if give, err := s.allocateNew(op, r, off, size, picks, more); err != nil {
				s.mu.Unlock()
				return s.undone(err, give)
			}
		}
	}
	if len(pos) > 0 {
		give, err := s.commitPriv(op, r, gi, n, picks, pos, priv)
		s.mu.Unlock()
		if err != nil {
			return s.undone(err, give)
		}
		if s.populate && priv > 0 {
			return s.populatePriv(op, r, gi, n, priv)
		}
		return nil
	}
	slots := make([]int, len(picks))
	for k, p := range picks {
		slots[k] = p.slot
	}
	if done, err := s.place(r, gi, slots); err != nil {
		s.releasePriv(priv)
		give, err := s.undoMap(op, r, off, size, picks, done, err)
		s.mu.Unlock()
		return s.undone(err, give)
	}
	if priv > 0 {
		at := r.at(gi + len(picks))
		if err := s.sys.protect(at, priv<<s.shift, false); err != nil {
			s.releasePriv(priv)
			give, err := s.undoMap(op, r, off, size, picks, len(picks), err)
			s.mu.Unlock()
			return s.undone(err, give)
		}
		s.advise(at, priv<<s.shift)
	}
	s.record(r, gi, picks, false)
	s.recordPriv(r, gi+len(picks), priv, s.populate)
	if s.populate && priv > 0 {
		s.kick()
		s.mu.Unlock()
		return s.populatePriv(op, r, gi, n, priv)
	}
	populate := false
	if s.populate {
		for _, p := range picks {
			if p.fresh {
				populate = true
				s.slots[p.slot].busy = true // keeps Trim and Prefill off it
			}
		}
	}
	if !populate {
		s.kick()
	}
	s.mu.Unlock()
	if !populate {
		return nil
	}
	return s.populateNew(op, r, gi, picks)
}

// releasePriv gives back the bytes charged for n private granules that a commit did
// not make. s.mu must be held.
func (s *Shared) releasePriv(n int) {
	if b := int64(n) << s.shift; b > 0 {
		s.owned -= b
		s.auth.Release(b)
	}
}

// recordPriv marks granules [gi, gi+n) of r as private (their bytes are charged),
// resident when res is true (their pages are known to exist), and attributes their
// mapping. s.mu must be held.
func (s *Shared) recordPriv(r *SharedReservation, gi, n int, res bool) {
	for i := gi; i < gi+n; i++ {
		r.maps[i] = sharedMap{priv: true, res: res}
	}
	r.count += n
	s.nPriv += n
	if b := int64(n) << s.shift; b > 0 {
		s.mapped += b
		s.auth.Map(b)
	}
}

// populatePriv populates, outside the lock, the last priv granules of a commit of n
// granules at gi of r; on failure it undoes the whole commit. s.mu must not be held.
func (s *Shared) populatePriv(op string, r *SharedReservation, gi, n, priv int) error {
	err := s.sys.populate(r.at(gi+n-priv), priv<<s.shift, true)
	if err == nil {
		return nil
	}
	off, size := gi<<s.shift, n<<s.shift
	s.mu.Lock()
	err = s.opErr(op, off, size, err, false)
	if r.state != sharedLive {
		s.mu.Unlock()
		return err
	}
	parked := s.parkPriv(r, gi, n-priv) // the granules that came out of the park
	if uerr := s.sys.unmapTo(r.at(gi), size); uerr != nil {
		_ = s.unpark(r, parked)
		s.mu.Unlock()
		return fmt.Errorf("%w; undoing the commit failed, [%#x, +%#x) is left committed: %w",
			err, off, size, s.opErr(op, off, size, uerr, true))
	}
	s.putParked(parked)
	give := s.drop(r, gi, n)
	s.mu.Unlock()
	_, gerr := s.giveBack(give)
	return s.stayIdle(err, gerr)
}

// charge takes the bytes of fresh new granules for a commit of n granules that
// holds the idle picks and the idle private granules at *pos: at once, or, when
// wait is true and the budget refuses, in FIFO order with the device's other
// waiters until ctx ends. It returns the idle picks the commit keeps and how many
// granules it must create (and may change *pos). On error the commit holds nothing;
// when r was unreserved while the commit waited the error is errSharedGone. s.mu must
// be held; charge releases it while the commit waits and holds it again when it
// returns.
//
// NB: a commit holds nothing while it waits. Holding its idle granules while waiting
// for the rest would let commits that each hold some wait for each other forever; so
// it puts them back in the pool and waits for all n granules at once
// (Authority.AcquireIdle). The governor serves it from the pool's idle granules as
// from free budget, in its FIFO order: granules that go idle meanwhile are handed to
// the waiting commits, not first given to the OS to be made again, and idle granules
// and bytes another owner gives back serve it together.
func (s *Shared) charge(ctx context.Context, op string, r *SharedReservation, off, size, n int, picks []sharedPick, pos *[]int, wait bool) ([]sharedPick, int, error) {
	fresh := n - len(picks) - len(*pos)
	err := s.auth.TryAcquire(int64(fresh) << s.shift)
	if err == nil {
		s.owned += int64(fresh) << s.shift
		s.created += int64(fresh)
		return picks, fresh, nil
	}
	s.unpick(picks)
	s.untakePrivIdle(*pos)
	*pos = nil
	if !wait || !accounting.CanWait(err) {
		return nil, 0, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	s.mu.Unlock()
	idle, err := s.auth.AcquireIdle(ctx, int64(n)<<s.shift)
	s.mu.Lock()
	if err != nil {
		return nil, 0, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	k := int(idle >> s.shift) // idle granules of the pool that are this commit's now
	fresh = n - k
	if r.state != sharedLive {
		s.auth.PutIdle(idle)
		s.auth.Release(int64(fresh) << s.shift)
		return nil, 0, errSharedGone
	}
	if s.nPrivIdle > 0 {
		*pos = s.takePrivIdle(min(k, s.nPrivIdle))
	}
	picks = s.pickIdle(k-len(*pos), -1)
	s.owned += int64(fresh) << s.shift
	s.created += int64(fresh)
	return picks, fresh, nil
}

// allocateNew allocates the pages of the new slots more (one run) in the file before
// they are mapped: that and then populating the mapping costs 15% less than
// populating an empty shmem mapping, which faults one page at a time. On error
// (errSharedGone when r was unreserved meanwhile) the idle picks are back in the pool
// and it returns the new slots, which the caller gives back to the OS once it
// released s.mu (undone): the allocation may have been partial. s.mu must be held;
// allocateNew releases it while it allocates (the slots are busy) and holds it again
// when it returns.
func (s *Shared) allocateNew(op string, r *SharedReservation, off, size int, picks, more []sharedPick) ([]int, error) {
	s.mu.Unlock()
	err := s.sys.allocate(s.fd, int64(more[0].slot)<<s.shift, int64(len(more))<<s.shift)
	s.mu.Lock()
	if err == nil && r.state == sharedLive {
		for _, p := range more {
			s.slots[p.slot].resident = true
		}
		return nil, nil
	}
	for _, p := range picks {
		if !p.fresh {
			s.toIdle(p.slot)
		}
	}
	give := make([]int, len(more))
	for k, p := range more {
		give[k] = p.slot
	}
	if err == nil {
		return give, errSharedGone
	}
	return give, s.opErr(op, off, size, err, false)
}

// undoMap undoes a commit of picks at off of r whose mmap failed after done
// granules with err: it maps reserved memory over those and returns the idle picks
// to the pool. It returns the error to report and the new slots that the caller
// gives back to the OS once it released s.mu (undone). s.mu must be held.
func (s *Shared) undoMap(op string, r *SharedReservation, off, size int, picks []sharedPick, done int, err error) ([]int, error) {
	gi := off >> s.shift
	err = s.opErr(op, off, size, err, true)
	kept := 0
	if done > 0 {
		if uerr := s.sys.unmapTo(r.at(gi), done<<s.shift); uerr != nil {
			// NB: the mapped prefix can not be taken back: record it as committed,
			// which it is, so that Decommit or Unreserve frees it.
			kept = done
			err = fmt.Errorf("%w; undoing it failed, [%#x, +%#x) is left committed: %w",
				err, off, done<<s.shift, s.opErr(op, off, done<<s.shift, uerr, true))
		}
	}
	s.record(r, gi, picks[:kept], false)
	if !s.populate && !sharedMapAllocates {
		s.unpick(picks[kept:]) // new slots never touched: still holes
		return nil, err
	}
	// New slots were allocated in the file: punch them out again.
	var give []int
	for _, p := range picks[kept:] {
		if p.fresh {
			give = append(give, p.slot)
		} else {
			s.toIdle(p.slot)
		}
	}
	return give, err
}

// populateNew populates, outside the lock, the granules a commit of len(picks)
// granules at gi of r created. On failure it undoes the whole commit: the created
// granules go back to the OS, the pooled ones to the pool. s.mu must not be held.
func (s *Shared) populateNew(op string, r *SharedReservation, gi int, picks []sharedPick) error {
	var err error
	for k := 0; k < len(picks) && err == nil; {
		if !picks[k].fresh {
			k++
			continue
		}
		j := k + 1
		for j < len(picks) && picks[j].fresh {
			j++
		}
		err = s.sys.populate(r.at(gi+k), (j-k)<<s.shift, true)
		k = j
	}
	s.mu.Lock()
	for _, p := range picks {
		if p.fresh {
			sl := &s.slots[p.slot]
			sl.busy = false
			sl.resident = err == nil
		}
	}
	if err == nil {
		s.kick()
		s.mu.Unlock()
		return nil
	}
	n := len(picks)
	off, size := gi<<s.shift, n<<s.shift
	err = s.opErr(op, off, size, err, false)
	if uerr := s.sys.unmapTo(r.at(gi), size); uerr != nil {
		s.mu.Unlock()
		return fmt.Errorf("%w; undoing the commit failed, [%#x, +%#x) is left committed: %w",
			err, off, size, s.opErr(op, off, size, uerr, true))
	}
	var give []int
	for k, p := range picks {
		r.maps[gi+k] = sharedMap{}
		s.slots[p.slot].refs--
		if p.fresh {
			s.slots[p.slot].busy = true
			give = append(give, p.slot)
		} else {
			s.toIdle(p.slot)
		}
	}
	r.count -= n
	s.mapped -= int64(size)
	s.auth.Unmap(int64(size))
	s.mu.Unlock()
	_, gerr := s.giveBack(give)
	return s.stayIdle(err, gerr)
}

// undone ends a commit that failed with err and was undone: it gives the new slots
// give back to the OS and returns err, noting where that failed (stayIdle). A commit
// whose reservation was unreserved meanwhile (errSharedGone) panics then with
// backing.PanicUseAfterUnreserve. s.mu must not be held.
func (s *Shared) undone(err error, give []int) error {
	_, gerr := s.giveBack(give)
	if err == errSharedGone {
		panic(backing.PanicUseAfterUnreserve)
	}
	return s.stayIdle(err, gerr)
}

// stayIdle adds to err, the error of a commit that was undone, that giving its new
// granules back failed (gerr): they stay in the pool, idle and owned, which is a
// change a caller may need to know of.
func (s *Shared) stayIdle(err, gerr error) error {
	if gerr == nil {
		return err
	}
	return fmt.Errorf("%w; giving the new granules back failed, some stay idle in the pool: %w", err, gerr)
}

// mapSlots maps slots[k] at granule gi+k of r, one mmap per run of consecutive slots.
// It returns how many granules (a prefix) it mapped and the first error. s.mu must be
// held.
func (s *Shared) mapSlots(r *SharedReservation, gi int, slots []int, ro bool) (int, error) {
	for k := 0; k < len(slots); {
		j := k + 1
		for j < len(slots) && slots[j] == slots[j-1]+1 {
			j++
		}
		if err := s.sys.mapFile(r.at(gi+k), (j-k)<<s.shift, s.fd, int64(slots[k])<<s.shift, ro); err != nil {
			return k, err
		}
		s.adviseFile(r.at(gi+k), (j-k)<<s.shift)
		k = j
	}
	return len(slots), nil
}

// record marks granules gi.. of r as backed by picks (one reference each) and
// attributes the mappings. s.mu must be held.
func (s *Shared) record(r *SharedReservation, gi int, picks []sharedPick, ro bool) {
	for k, p := range picks {
		sl := &s.slots[p.slot]
		sl.busy = false
		sl.refs++
		r.maps[gi+k] = sharedMap{at: uint32(p.slot + 1), ro: ro, shared: ro}
	}
	r.count += len(picks)
	if n := int64(len(picks)) << s.shift; n > 0 {
		s.mapped += n
		s.auth.Map(n)
	}
}
