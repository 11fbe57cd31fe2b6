package host

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/vmarena/vmarena/backing"
)

// Sharing on a Shared backing: Share maps the slots behind one reservation's range
// into another's; a private granule is first adopted into the memfd.

// Share moves [dstOff, dstOff+size) of dst from Reserved to Committed by mapping the
// physical granules committed at [srcOff, srcOff+size) of src (the same memfd
// offsets, MAP_SHARED|MAP_FIXED), read-only or read-write. Each granule gains one
// reference and the mapped bytes are attributed to the authority; nothing new is
// owned. prot applies to the new mapping only. ReadWrite is refused with
// ErrSharedReadOnly (which matches backing.ErrReadOnly) when a source granule is
// read-only in src, shared so or protected: read-only memory never yields a writable
// mapping. A private source granule is first moved into the memfd, which copies
// it, one granule at a time where the pool has no idle memfd granule for it, so
// that the move holds at most one granule more than before (see shared_priv.go):
// the source range must not be written meanwhile, and a Share that finds a granule
// being moved by another waits for it.
// On error nothing changed.
func (s *Shared) Share(dst *SharedReservation, dstOff int, src *SharedReservation, srcOff, size int, prot backing.Protection) error {
	const op = "share"
	var runs []sharedAdoption // undone if the Share fails
	// fail ends a Share that failed with err while s.mu is held: it undoes the
	// adoptions of runs, releases s.mu and gives their new granules back.
	fail := func(err error) error {
		give, err := s.undoAdopt(op, src, runs, err)
		s.mu.Unlock()
		return s.undone(err, give)
	}
	for {
		if err := s.lockUse(op, dst, src); err != nil {
			return err // NB: refused on the first pass only, before any adoption
		}
		if err := s.checkShare(op, dst, dstOff, src, srcOff, size, prot); err != nil {
			return fail(err)
		}
		i, j := srcOff>>s.shift, (srcOff+size)>>s.shift
		if slices.ContainsFunc(src.maps[i:j], func(m sharedMap) bool { return m.adopting }) {
			// NB: another Share is moving some of them into the memfd: wait for it
			// and look again (they may be memfd granules now, or private again).
			if s.testAdoptWait != nil {
				s.testAdoptWait()
			}
			s.adoptDone.Wait()
			s.mu.Unlock()
			continue
		}
		// Private granules move into the memfd first, one run at a time.
		for i < j && !src.maps[i].priv {
			i++
		}
		if i == j {
			break
		}
		k := i + 1
		for k < j && src.maps[k].priv {
			k++
		}
		a, give, err := s.adopt(op, src, i, k)
		runs = append(runs, a)
		s.mu.Unlock()
		if err != nil {
			err = s.undone(err, give) // adopt's own new granules go first
			s.mu.Lock()
			return fail(err)
		}
	}
	n := size >> s.shift
	if n == 0 {
		s.mu.Unlock()
		return nil
	}
	si, di := srcOff>>s.shift, dstOff>>s.shift
	slots := make([]int, n)
	picks := make([]sharedPick, n)
	for k := range slots {
		slots[k] = src.maps[si+k].slot()
		picks[k] = sharedPick{slot: slots[k]}
	}
	ro := prot == backing.ReadOnly
	done, err := s.mapSlots(dst, di, slots, ro)
	if err == nil {
		s.record(dst, di, picks, ro)
		s.mu.Unlock()
		return nil
	}
	err = s.opErr(op, dstOff, size, err, true)
	if done > 0 {
		if uerr := s.sys.unmapTo(dst.at(di), done<<s.shift); uerr != nil {
			// NB: as in commit, what can not be undone is recorded as what it is
			// (and the source's granules stay in the memfd, shared).
			s.record(dst, di, picks[:done], ro)
			s.mu.Unlock()
			return fmt.Errorf("%w; undoing it failed, [%#x, +%#x) is left shared: %w",
				err, dstOff, done<<s.shift, s.opErr(op, dstOff, done<<s.shift, uerr, true))
		}
	}
	return fail(err)
}

// checkShare validates the arguments of a Share. s.mu must be held.
func (s *Shared) checkShare(op string, dst *SharedReservation, dstOff int, src *SharedReservation, srcOff, size int, prot backing.Protection) error {
	if prot != backing.ReadOnly && prot != backing.ReadWrite {
		return &backing.OpError{Op: op, Offset: dstOff, Size: size, Kind: ErrSharedArgument,
			Err: fmt.Errorf("host: unknown protection %d", prot)}
	}
	if err := backing.CheckRange(op, srcOff, size, src.size, s.g); err != nil {
		return err
	}
	if err := backing.CheckRange(op, dstOff, size, dst.size, s.g); err != nil {
		return err
	}
	if err := src.want(op, srcOff, size, true); err != nil {
		return err
	}
	if err := dst.want(op, dstOff, size, false); err != nil {
		return err
	}
	if prot == backing.ReadWrite {
		for i := srcOff >> s.shift; i < (srcOff+size)>>s.shift; i++ {
			if src.maps[i].ro {
				return &backing.OpError{Op: op, Offset: dstOff, Size: size, Kind: ErrSharedReadOnly,
					Err: fmt.Errorf("host: source granule at %#x is read-only in its reservation", i<<s.shift)}
			}
		}
	}
	return nil
}

// adopt moves the private granules [i, j) of r into the memfd: it copies each into
// a memfd granule (an idle one where the pool has one, else a new one, allocated and
// populated in the park), then moves those over the same addresses of r (mremap,
// see the park), so that r keeps its base and its contents and the private pages go
// back to the OS. A move takes no net memory, but while a granule and its copy both
// exist both are charged: so that a move is never refused while one granule of the
// budget is free, and never holds more than that, new memfd granules are made and
// moved one at a time, each private granule released as soon as its copy replaced
// it (idle memfd granules, already owned, go as many at once as the pool holds).
// Where the budget has not even one granule free, idle private granules, which can
// not serve the move, go back to the OS first to make room. It returns what moved,
// which unadopt undoes: on error, the granules that moved before it (the rest of
// [i, j) is as it was), and the new slots that the caller gives back to the OS once
// it released s.mu (undone); errSharedGone when r was unreserved meanwhile. s.mu
// must be held; adopt releases it while it copies (the slots are busy) and holds it
// again when it returns.
func (s *Shared) adopt(op string, r *SharedReservation, i, j int) (sharedAdoption, []int, error) {
	moved := sharedAdoption{i: i}
	for at := i; at < j; {
		n := min(j-at, max(s.nIdle, 1))
		a, give, err := s.adoptRun(op, r, at, at+n)
		moved.picks = append(moved.picks, a.picks...)
		moved.ro = append(moved.ro, a.ro...)
		if err != nil {
			return moved, give, err
		}
		at += n
	}
	return moved, nil, nil
}

// adoptRun is adopt of [i, j) at once: every granule of the run that the pool has
// no idle memfd granule for is charged anew while it is copied. s.mu must be held;
// adoptRun releases it while it copies and holds it again when it returns.
func (s *Shared) adoptRun(op string, r *SharedReservation, i, j int) (sharedAdoption, []int, error) {
	k := j - i
	off, size := i<<s.shift, k<<s.shift
	picks := s.pickIdle(s.claim(min(k, s.nIdle)), -1)
	if fresh := k - len(picks); fresh > 0 {
		b := int64(fresh) << s.shift
		err := s.auth.TryAcquire(b)
		if err != nil && s.nPrivIdle > 0 {
			// NB: idle private granules can not become memfd granules: where they
			// hold the budget the move needs, they go back to the OS for it (a
			// commit would have taken them; the Share can not).
			if n, _ := s.givePriv(s.takePrivIdle(s.claim(min(fresh, s.nPrivIdle)))); n > 0 {
				err = s.auth.TryAcquire(b)
			}
		}
		if err != nil {
			s.unpick(picks)
			return sharedAdoption{}, nil, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
		}
		s.owned += b
		s.created += int64(fresh)
		more, err := s.pickFresh(fresh, -1)
		if err != nil {
			s.unpick(picks)
			s.owned -= b
			s.auth.Release(b)
			return sharedAdoption{}, nil, s.opErr(op, off, size, err, true)
		}
		picks = append(picks, more...)
	}
	slices.SortFunc(picks, func(a, b sharedPick) int { return a.slot - b.slot })
	ro := make([]bool, k) // protected (Protect): the memfd granule must be too
	at := make([]unsafe.Pointer, k)
	ready := make([]bool, k)
	for n, p := range picks {
		at[n] = s.parkAt(p.slot)
		ready[n] = s.slots[p.slot].resident
		r.maps[i+n].adopting = true
	}
	s.mu.Unlock()
	var err error
	for n, p := range picks {
		if !ready[n] {
			if err = s.sys.allocate(s.fd, int64(p.slot)<<s.shift, int64(s.g)); err == nil {
				err = s.sys.populate(at[n], s.g, true)
			}
			if err != nil {
				err = s.opErr(op, off, size, err, false)
				break
			}
		}
		copy(sharedBytes(at[n], s.g), sharedBytes(r.at(i+n), s.g))
	}
	s.mu.Lock()
	for n := range k {
		r.maps[i+n].adopting = false
		// NB: a Protect may have changed the private granule's access while the
		// lock was free: the memfd granule takes the access it has now.
		ro[n] = r.maps[i+n].ro
	}
	s.adoptDone.Broadcast()
	done := 0
	if err == nil && r.state == sharedLive {
		slots := make([]int, k)
		for n, p := range picks {
			slots[n] = p.slot
		}
		done, err = s.place(r, i, slots)
		if err != nil {
			err = s.opErr(op, off, size, err, true)
		}
	}
	for n, p := range picks[:done] {
		sl := &s.slots[p.slot]
		sl.busy, sl.refs, sl.resident = false, 1, true
		r.maps[i+n] = sharedMap{at: uint32(p.slot + 1)}
		if ro[n] {
			// The move brought the park's access (read-write): protect it again.
			// Where that fails, the Share fails and unadopt makes it private and
			// read-only again.
			if perr := s.sys.protect(r.at(i+n), s.g, true); perr != nil && err == nil {
				err = s.opErr(op, (i+n)<<s.shift, s.g, perr, true)
			} else if perr == nil {
				r.maps[i+n].ro = true
			}
		}
	}
	s.nPriv -= done
	s.adopted += int64(done)
	s.releasePriv(done)
	var give []int
	for _, p := range picks[done:] {
		if p.fresh {
			give = append(give, p.slot)
		} else {
			s.slots[p.slot].resident = false // its pages may be half written
			s.toIdle(p.slot)
		}
	}
	moved := sharedAdoption{i: i, picks: picks[:done], ro: ro[:done]}
	if r.state != sharedLive {
		return moved, give, errSharedGone
	}
	return moved, give, err
}
