package host

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/vmarena/vmarena/backing"
)

// The pool: how slots are chosen for a commit, go idle, and go back to the OS.
//
// A slot is a granule-sized, granule-aligned offset of the memfd (a physical
// granule), in one of three states:
//
//  1. Free: not ours. The file has a hole there (or ends before it); it holds no
//     memory and is charged nothing.
//  2. Idle: owned and charged, mapped in no reservation, kept in the pool for the
//     next commit. It is Resident when its pages are known to exist (Prefill,
//     Populate, SharedOptions.Populate).
//  3. Live: owned and charged, mapped in a reservation at least once.
//
// The pool gives idle granules back to the OS (fallocate PUNCH_HOLE; a private one by
// mapping reserved memory over its place in the private park) by decay: those above
// Low leave gradually once unused, all of them within SharedOptions.Decay (5 s by
// default) after the load stops, while a busy pool keeps its working set (see
// shared_decay.go). Idle time is measured on the monotonic clock: a step of the wall
// clock changes no granule's age. It also gives them back above the High water mark,
// on Trim, and, while another owner's request waits for host memory, at once as they
// go idle, so that memory kept for this pool's future commits is not held against a
// caller that needs it now; each time such a request starts to wait, the pool's
// reclaimer (see accounting.Authority.SetReclaimer) gives back every granule already
// idle. While only this pool's own requests wait (CommitCtx, or a caller's
// Authority.AcquireFor), granules that go idle are handed to them instead, rather
// than given to the OS to be made again: the pool puts every idle granule's bytes
// idle on its authority (accounting.Authority.PutIdle), and the governor's FIFO queue
// serves them from those as from free budget, in the order they came; the pool takes
// an idle granule out for anything else only through Authority.TakeIdle. A granule
// that can not be given back (the punch fails) stays idle and owned; the next Trim
// tries again.
//
// Granules shared piecemeal or recycled from a fragmented pool do not merge into one
// kernel mapping: each run of slots mapped at consecutive addresses and file offsets
// is one, and a process has at most vm.max_map_count of them (65530 by default).

// pickIdle takes k idle slots (k <= nIdle) for a commit: the run at hint when it is
// all idle, else the first run of k idle slots, else the lowest k. s.mu must be held.
func (s *Shared) pickIdle(k, hint int) []sharedPick {
	if k == 0 {
		return nil
	}
	n := len(s.slots)
	start := -1
	if hint >= 0 && s.idle.all(hint, k, n) {
		start = hint
	} else {
		start = s.idle.run(k, n, false)
	}
	picks := make([]sharedPick, 0, k)
	i := max(start, 0)
	for len(picks) < k {
		i = s.idle.next(i, n)
		picks = append(picks, sharedPick{slot: i})
		s.takeIdle(i)
		i++
	}
	return picks
}

func (s *Shared) takeIdle(i int) {
	s.idle.clear(i)
	s.nIdle--
	if s.slots[i].resident {
		s.nResident--
	}
	s.slots[i].busy = true
}

// pickFresh takes k free slots, as one run: at hint when the slots there are free,
// else the first free run long enough, else at the end of the file, which it grows.
// Its bytes must already be charged. s.mu must be held.
func (s *Shared) pickFresh(k, hint int) ([]sharedPick, error) {
	n := len(s.slots)
	start := -1
	switch {
	case hint >= 0 && hint <= n && s.free.nextClear(hint, min(hint+k, n)) == min(hint+k, n):
		start = hint // free up to the end of the file, or beyond it
	default:
		start = s.free.run(k, n, true)
	}
	if err := s.growTo(start + k); err != nil {
		return nil, err
	}
	picks := make([]sharedPick, k)
	for j := range picks {
		i := start + j
		s.free.clear(i)
		s.slots[i] = sharedSlot{busy: true}
		picks[j] = sharedPick{slot: i, fresh: true}
	}
	return picks, nil
}

// growTo makes the file hold at least n slots, growing it by doubling (at most
// sharedGrowStep at once): a sparse file costs nothing until its pages are touched.
// The park grows first, so that every slot of the file has its place there. s.mu
// must be held.
func (s *Shared) growTo(n int) error {
	have := len(s.slots)
	if n <= have {
		return nil
	}
	if n > sharedMaxSlots {
		return fmt.Errorf("host: the memfd would need more than %d granules", sharedMaxSlots)
	}
	want := min(max(n, 2*have, 1), have+max(sharedGrowStep>>s.shift, 1), sharedMaxSlots)
	want = max(want, n)
	if err := s.growPark(want); err != nil {
		return err
	}
	if err := s.sys.truncate(s.fd, int64(want)<<s.shift); err != nil {
		return err
	}
	s.slots = append(s.slots, make([]sharedSlot, want-have)...)
	s.idle.resize(want)
	s.free.resize(want)
	for i := have; i < want; i++ {
		s.free.set(i)
	}
	return nil
}

// unpick returns slots taken for a commit that did not happen: idle ones to the
// pool, fresh ones (never mapped, so still holes) to Free with their bytes released.
// s.mu must be held.
func (s *Shared) unpick(picks []sharedPick) {
	var fresh int64
	for _, p := range picks {
		if p.fresh {
			s.slots[p.slot] = sharedSlot{}
			s.free.set(p.slot)
			fresh += int64(s.g)
		} else {
			s.toIdle(p.slot)
		}
	}
	if fresh > 0 {
		s.owned -= fresh
		s.auth.Release(fresh)
	}
}

// toIdle puts an owned, unmapped slot in the pool, and its bytes idle on the
// authority, where they serve the next waiting commit. s.mu must be held.
func (s *Shared) toIdle(i int) {
	sl := &s.slots[i]
	sl.busy = false
	s.idle.set(i)
	s.nIdle++
	if sl.resident {
		s.nResident++
	}
	sl.since = s.elapsed()
	s.startDecay()
	s.auth.PutIdle(int64(s.g))
}

// claim asks the governor for k of the pool's idle granules and returns how many the
// caller may take out of the pool (pickIdle, victims, takePrivIdle): the idle granules
// that the governor served a waiting commit from are that commit's (see charge).
// Every granule that goes idle is put idle on the authority (toIdle, untakePrivIdle,
// putParked), and every one taken out of the pool but for a waiting commit's is
// claimed first, so that the pool holds at least the authority's idle bytes. s.mu
// must be held.
func (s *Shared) claim(k int) int {
	if k <= 0 {
		return 0
	}
	return int(s.auth.TakeIdle(int64(k)<<s.shift) >> s.shift)
}

// drop unmaps granules [gi, gi+n) of r from the bookkeeping (the caller unmapped
// them): one reference less per slot, and the slots whose last mapping went to the
// pool, or, past the High water mark or while the governor has waiters, out of it
// (marked busy and returned, for giveBack). s.mu must be held.
func (s *Shared) drop(r *SharedReservation, gi, n int) []int {
	var give []int
	waiters := -1 // unknown
	dropped, priv := 0, 0
	for i := gi; i < gi+n; i++ {
		m := r.maps[i]
		if !m.committed() {
			continue
		}
		r.maps[i] = sharedMap{}
		dropped++
		if m.priv {
			priv++ // its pages went with its mapping
			continue
		}
		sl := &s.slots[m.slot()]
		sl.refs--
		if sl.refs > 0 {
			continue
		}
		if waiters < 0 {
			waiters = 0
			if s.auth.OthersWait() {
				waiters = 1
			}
		}
		if waiters == 0 && s.nIdle+s.nPrivIdle < s.high {
			s.toIdle(m.slot())
		} else {
			sl.busy = true
			give = append(give, m.slot())
		}
	}
	r.count -= dropped
	if b := int64(dropped) << s.shift; b > 0 {
		s.mapped -= b
		s.auth.Unmap(b)
	}
	s.nPriv -= priv
	s.releasePriv(priv)
	return give
}

// giveBack punches the given busy, owned, unmapped slots out of the file, one
// fallocate per run, and releases their bytes. A slot whose punch fails goes back to
// the pool, owned. It returns the bytes given back and the first error. s.mu must
// not be held.
func (s *Shared) giveBack(slots []int) (int64, error) {
	if len(slots) == 0 {
		return 0, nil
	}
	slices.Sort(slots)
	var firstErr error
	ok := make([]bool, len(slots))
	for k := 0; k < len(slots); {
		j := k + 1
		for j < len(slots) && slots[j] == slots[j-1]+1 {
			j++
		}
		err := s.sys.punch(s.fd, int64(slots[k])<<s.shift, int64(j-k)<<s.shift)
		if err != nil && firstErr == nil {
			firstErr = s.opErr("trim", slots[k]<<s.shift, (j-k)<<s.shift, err, false)
		}
		for ; k < j; k++ {
			ok[k] = err == nil
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	for k, i := range slots {
		if ok[k] {
			s.slots[i] = sharedSlot{}
			s.free.set(i)
			n += int64(s.g)
		} else {
			// The punch may have dropped some pages: no longer known resident.
			s.slots[i].resident = false
			s.toIdle(i)
		}
	}
	if n > 0 {
		s.owned -= n
		s.auth.Release(n)
	}
	return n, firstErr
}

// sharedPopulatePiece is the most the pool's prefill populates in one call. The
// kernel holds the process's mmap lock for reading across one MADV_POPULATE_WRITE,
// and a commit's move (mremap) or mprotect needs it for writing: a decode step that
// commits while a prefill populates a whole 2 MiB granule waits for all of it. In
// pieces it waits for one (BenchmarkMoveBesidePopulate: a 2 MiB mremap took 156-250
// µs at the median beside a thread populating 2 MiB granules whole, 34-40 µs beside
// 64 KiB pieces and 15-17 µs alone), for a few more system calls on the prefill's
// side. A huge page is made whole by its first piece's fault: no gain there.
const sharedPopulatePiece = 64 << 10

// prefillPopulate populates the granule at at for writing, sharedPopulatePiece at a
// time (see there). s.mu must not be held.
func (s *Shared) prefillPopulate(at unsafe.Pointer) error {
	for off := 0; off < s.g; off += sharedPopulatePiece {
		if err := s.sys.populate(sharedAt(at, off), min(sharedPopulatePiece, s.g-off), true); err != nil {
			return err
		}
	}
	return nil
}

// Prefill makes at least n idle granules resident in the pool: it populates idle
// granules that are not, then creates new ones, one at a time within the budget. It
// allocates a granule's pages in the file (fallocate) and populates its place in the
// park (MADV_POPULATE_WRITE), so that its page tables are built too and the commit
// that takes it moves them along: its first touch takes no fault at all. When the budget refuses it returns the *accounting.BudgetError inside an
// *OpError; the granules made resident so far stay. n may exceed High: the surplus
// stays until a decommit or Trim gives it back.
func (s *Shared) Prefill(n int) error {
	if n < 0 {
		return &backing.OpError{Op: "prefill", Size: n, Kind: backing.ErrInvalidRange,
			Err: fmt.Errorf("host: negative granule count %d", n)}
	}
	s.fixGranule(0)
	for {
		more, err := s.prefillOne(n, false)
		if err != nil || !more {
			return err
		}
	}
}

// prefillOne makes one more idle granule resident, if fewer than n are. It reports
// whether it did (and more may be needed). background calls stop quietly once the
// backing is closed and clear s.refilling when done. s.mu must not be held.
func (s *Shared) prefillOne(n int, background bool) (bool, error) {
	s.mu.Lock()
	if background && s.closed {
		s.refilling = false
		s.mu.Unlock()
		return false, nil
	}
	if s.closed {
		s.mu.Unlock()
		panic(PanicSharedClosed)
	}
	if s.nResident+s.privResident() >= n {
		if background {
			s.refilling = false
		}
		s.mu.Unlock()
		return false, nil
	}
	if s.huge.private() {
		// Idle private granules that may lack pages first, then new ones.
		ok, err := s.populatePrivIdle()
		if !ok && err == nil {
			ok, err = s.prefillPriv(background)
		} else if err != nil && background {
			s.refilling = false
		}
		if ok || err != nil {
			s.mu.Unlock()
			return ok, err
		}
		// The private park is full: memfd granules for the rest.
	}
	slot, fresh := -1, false
	for i := s.idle.next(0, len(s.slots)); i < len(s.slots); i = s.idle.next(i+1, len(s.slots)) {
		if !s.slots[i].resident {
			slot = i
			break
		}
	}
	if slot >= 0 && s.claim(1) == 0 {
		slot = -1 // the idle granules are a waiting commit's
	}
	if slot >= 0 {
		s.takeIdle(slot)
	} else {
		fail := func(err error) (bool, error) {
			if background {
				s.refilling = false
			}
			s.mu.Unlock()
			return false, &backing.OpError{Op: "prefill", Size: s.g, Err: err}
		}
		if err := s.auth.TryAcquire(int64(s.g)); err != nil {
			return fail(err)
		}
		s.owned += int64(s.g)
		s.created++
		picks, err := s.pickFresh(1, -1)
		if err != nil {
			s.owned -= int64(s.g)
			s.auth.Release(int64(s.g))
			err = s.opErr("prefill", 0, s.g, err, true) // growing the park maps memory
			if background {
				s.refilling = false
			}
			s.mu.Unlock()
			return false, err
		}
		slot, fresh = picks[0].slot, true
	}
	at := s.parkAt(slot)
	s.mu.Unlock()
	err := s.sys.allocate(s.fd, int64(slot)<<s.shift, int64(s.g))
	if err == nil && sharedPark { // without a park, allocate made the pages
		err = s.prefillPopulate(at)
	}
	if err != nil {
		err = s.opErr("prefill", slot<<s.shift, s.g, err, false)
		if fresh {
			s.giveBack([]int{slot}) // it may hold part of its pages
		} else {
			s.mu.Lock()
			s.toIdle(slot)
			s.mu.Unlock()
		}
		if background {
			s.mu.Lock()
			s.refilling = false
			s.mu.Unlock()
		}
		return false, err
	}
	s.mu.Lock()
	s.slots[slot].resident = true
	s.toIdle(slot)
	s.mu.Unlock()
	return true, nil
}

// kick starts the background refill when the pool has fewer than Low idle resident
// granules. s.mu must be held.
func (s *Shared) kick() {
	if s.low == 0 || s.refilling || s.closed || s.nResident+s.privResident() >= s.low {
		return
	}
	s.refilling = true
	s.refill.Add(1)
	go func() {
		defer s.refill.Done()
		for {
			// NB: errors (a refused budget, say) end this refill quietly; the next
			// commit below Low tries again, and Prefill reports them.
			if more, _ := s.prefillOne(s.low, true); !more {
				return
			}
		}
	}()
}

// Trim gives idle granules back to the OS until at most keep remain: idle private
// granules first (mapping reserved memory over their place in the park), then memfd
// granules (fallocate PUNCH_HOLE), those not known resident first, then from the end
// of the file. It returns
// the bytes given back; a granule whose punch fails stays in the pool and the first
// error is returned.
func (s *Shared) Trim(keep int) (int64, error) {
	if keep < 0 {
		return 0, &backing.OpError{Op: "trim", Size: keep, Kind: backing.ErrInvalidRange,
			Err: fmt.Errorf("host: negative granule count %d", keep)}
	}
	s.fixGranule(0)
	s.lock()
	k := s.claim(max(s.nIdle+s.nPrivIdle-keep, 0))
	pos := s.takePrivIdle(min(k, s.nPrivIdle)) // the cheapest to make again
	n, err := s.givePriv(pos)
	victims := s.victims(k - len(pos))
	s.mu.Unlock()
	m, gerr := s.giveBack(victims)
	if err == nil {
		err = gerr
	}
	if s.log != nil && (n+m > 0 || err != nil) {
		s.log.Info("host: pool trim", "gave_back_bytes", n+m, "keep", keep, "err", err)
	}
	return n + m, err
}

// victims takes k idle slots out of the pool for giveBack, non-resident first, then
// from the highest offset down. s.mu must be held.
func (s *Shared) victims(k int) []int {
	var out []int
	for pass := 0; pass < 2 && len(out) < k; pass++ {
		for i := s.idle.prev(len(s.slots)); i >= 0 && len(out) < k; i = s.idle.prev(i) {
			if pass == 1 || !s.slots[i].resident {
				s.takeIdle(i)
				out = append(out, i)
			}
		}
	}
	return out
}

// PoolStats returns a snapshot of the pool. It may be called after Close. Every idle
// granule waits in the park; Resident counts those whose pages are known to exist,
// which hold the page tables their last mapping built (all of them after Prefill).
func (s *Shared) PoolStats() backing.PoolStats {
	s.fixGranule(0)
	s.mu.Lock()
	defer s.mu.Unlock()
	return backing.PoolStats{
		Granule:  s.g,
		Owned:    s.owned,
		Idle:     int64(s.nIdle+s.nPrivIdle) << s.shift,
		Mapped:   s.mapped,
		Resident: int64(s.nResident+s.privResident()) << s.shift,
		Low:      s.low,
		High:     s.high,

		Created:   s.created,
		GivenBack: s.created - s.owned>>s.shift,
	}
}
