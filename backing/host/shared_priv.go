package host

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"time"
	"unsafe"

	"github.com/vmarena/vmarena/backing"
)

// Private granules and the private park, where idle ones wait.
//
// Which granules a commit creates: a new granule costs its page population, about
// 0.6 ms per 2 MiB of 4 KiB anonymous pages, twice that of 4 KiB shmem pages
// (fallocate and populate, then the punch), 0.06 ms as one anonymous transparent huge
// page. So, once at NewShared, from the system's settings then (SharedStats says which
// and, where it falls back, why):
//
//   - where shmem huge pages are allowed (/sys/kernel/mm/transparent_hugepage/
//     shmem_enabled is always, within_size, advise or force; never is the common
//     default), the granule is a multiple of the huge page and
//     SharedOptions.NoHugePages is not set, the park and every mapping of the memfd
//     ask for them (MADV_HUGEPAGE), and granules are memfd granules;
//   - else (on Linux, unless SharedOptions.NoPrivateGranules is set) a commit that
//     must create granules makes them private: anonymous memory of that reservation
//     alone (mprotect read-write), owned and charged like any granule, mapped once.
//     They are anonymous huge pages (MADV_HUGEPAGE) where those are allowed
//     (.../enabled is always or madvise), the granule is a multiple of the huge page
//     and NoHugePages is not set, and small pages otherwise; where the system would
//     give huge pages unasked (enabled is always) they refuse them (MADV_NOHUGEPAGE),
//     so that what SharedStats says is what the kernel does. On a virtual machine
//     that reports free memory in huge-page blocks they are small pages unless
//     SharedOptions.AlwaysHugePages is set (a fresh huge page takes host faults there);
//   - else (NoPrivateGranules, or Windows) granules are memfd granules of small
//     pages. A workload that shares most of what it commits, or that is short of
//     mappings, may prefer these (see SharedOptions.NoPrivateGranules).
//
// Only a private granule that becomes shared moves into the memfd: Share first copies
// it into a memfd granule (an idle one when the pool has one) and moves that over the
// same address (mremap), so that the source keeps its base and its contents and the
// granule is owned once, whatever maps it. The move takes no net memory: granules
// without an idle memfd granule to go to move one at a time, each private granule
// given back as soon as its copy replaced it, so that a Share is refused for budget
// only where not even one granule of it is free, and holds at most one granule more
// while it runs. NB: the copy runs outside the lock, so the source range must not be
// written while a Share from it runs (a write may be lost); a second Share of a
// granule being moved waits for the first.
//
// A private granule is anonymous memory: its pages belong to the mapping, not to a
// file, so it can not be mapped twice, but it can move. An idle one waits in the
// private park, address space of its own with room for High granules: a decommit
// moves the granule there with its pages and page tables (mremap with
// MREMAP_DONTUNMAP, which leaves the source mapped, empty), and a commit moves it
// out again into place. A huge page moves as one page-table entry, 512 small pages
// of an aligned 2 MiB as one page-table page, so either costs a few µs where a new
// granule costs its population. Granules move in runs: consecutive granules of a
// reservation go to consecutive places with one call, and consecutive places come out
// into consecutive granules with one call, so that a commit or decommit of k granules
// costs one move where the park is not fragmented. Moved anonymous memory does not
// merge with its neighbours, so each run (or granule) parked or come out of the park
// is a mapping of its own, one per granule at most: like memfd granules at scattered
// offsets, they count against vm.max_map_count.

// privAt returns the address of position p of the private park. s.mu must be held
// and the park reserved.
func (s *Shared) privAt(p int) unsafe.Pointer { return sharedAt(s.apark, p<<s.shift) }

// privPark reserves the private park, once. A pool that keeps no idle granule
// (High 0) has none: NB: its High granules would be no bytes, which mmap refuses;
// callers find no free place in it (s.high is 0) and go on without. s.mu must be
// held.
func (s *Shared) privPark() error {
	if s.apark != nil || s.high == 0 {
		return nil
	}
	align, pad := sharedAlignment(s.g)
	n := s.high << s.shift
	raw, err := s.sys.reserve(n + pad)
	if err != nil {
		return err
	}
	s.aparkRaw, s.aparkN = raw, n+pad
	s.apark = sharedAlign(raw, align)
	s.aidle.resize(s.high)
	s.aused.resize(s.high)
	s.ares.resize(s.high)
	s.asince = make([]time.Duration, s.high)
	return nil
}

// takePrivIdle takes k idle private granules (k <= nPrivIdle) out of the pool and
// returns their positions, which stay in use until moved out or given back. It
// takes consecutive positions where it can (the first run of k, else the longest
// runs), so that a commit moves them out with few calls. s.mu must be held.
func (s *Shared) takePrivIdle(k int) []int {
	if k <= 0 {
		return nil
	}
	pos := make([]int, 0, k)
	for len(pos) < k {
		p, m := s.aidle.span(k-len(pos), s.high)
		if m == 0 {
			break
		}
		for q := p; q < p+m; q++ {
			s.aidle.clear(q)
			s.nPrivIdle--
			pos = append(pos, q)
		}
	}
	return pos
}

// untakePrivIdle puts back the granules at pos, taken by takePrivIdle. s.mu must be
// held.
func (s *Shared) untakePrivIdle(pos []int) {
	for _, p := range pos {
		s.aidle.set(p)
		s.nPrivIdle++
		s.asince[p] = s.elapsed()
	}
	s.startDecay()
	if len(pos) > 0 {
		s.auth.PutIdle(int64(len(pos)) << s.shift)
	}
}

// putParked puts the private granules that parkPriv parked idle on the authority,
// once the unmap that follows it succeeded (until then unpark may take them back).
// s.mu must be held.
func (s *Shared) putParked(parked [][2]int) {
	if len(parked) > 0 {
		s.auth.PutIdle(int64(len(parked)) << s.shift)
	}
}

// parkPriv moves into the private park the private granules of [gi, gi+n) of r that
// the pool keeps (below High, no waiters), so that their pages and page tables wait
// for the next commit; their mapping in r is dropped from the bookkeeping here (the
// caller unmaps the range as usual). Each run of consecutive granules it parks goes
// with one move, to the first run of free places that holds it (else the longest,
// and the rest to the next), so that a decommit of k granules costs one call where
// the park is not fragmented, and the run, one mapping in the park, comes out again
// with one call. A move that fails changes nothing but that the granule goes back
// to the OS with the unmap; a run whose move fails is moved again granule by
// granule. It returns the granules it parked, as pairs of the granule's index in r
// and its place in the park, for unpark. s.mu must be held.
//
// NB: a move leaves the granule's place in r mapped read-write and empty (what
// MREMAP_DONTUNMAP leaves of private memory): the caller's unmap must follow, or
// unpark undo the moves. Since Linux 6.17 a move may span several mappings, and
// one that fails (ENOMEM at vm.max_map_count) may have moved some of them: a
// granule moved again after its run failed (but for errSharedSpan, which moved
// nothing) may be empty, so it is not known resident, and its contents are forfeit
// even to unpark (a decommit forfeits them anyway; only an unmap that fails after
// such a move loses them); where moving one again fails too, pages it left in a
// free place stay there, uncharged, until that place is used again.
func (s *Shared) parkPriv(r *SharedReservation, gi, n int) (parked [][2]int) {
	if s.nPriv == 0 || s.nIdle+s.nPrivIdle >= s.high || s.auth.OthersWait() {
		return nil
	}
	if s.privPark() != nil {
		return nil
	}
	for i := gi; i < gi+n; {
		room := s.high - s.nIdle - s.nPrivIdle
		if room <= 0 {
			break
		}
		if m := r.maps[i]; !m.priv || m.ro {
			i++ // a protected one goes back to the OS: the park holds writable ones
			continue
		}
		j := i + 1
		for j < gi+n && j-i < room && r.maps[j].priv && !r.maps[j].ro {
			j++
		}
		p, k := s.aused.spanClear(j-i, s.high)
		if k == 0 {
			break
		}
		whole := true // what a move moves, it moves whole
		if k > 1 {
			err := s.sys.move(r.at(i), s.privAt(p), k<<s.shift)
			if err == nil {
				for q := range k {
					s.parked(r, i+q, p+q, r.maps[i+q].res)
					parked = append(parked, [2]int{i + q, p + q})
				}
				i += k
				continue
			}
			whole = errors.Is(err, errSharedSpan)
		}
		for q := range k {
			if s.sys.move(r.at(i+q), s.privAt(p+q), s.g) == nil {
				s.parked(r, i+q, p+q, whole && r.maps[i+q].res)
				parked = append(parked, [2]int{i + q, p + q})
			}
		}
		i += k
	}
	return parked
}

// parked books granule i of r, just moved to place p of the private park, as idle,
// resident when res is true, and drops its mapping in r. s.mu must be held.
func (s *Shared) parked(r *SharedReservation, i, p int, res bool) {
	s.aused.set(p)
	s.aidle.set(p)
	if res {
		s.ares.set(p)
	} else {
		s.ares.clear(p)
	}
	s.nPrivIdle++
	s.asince[p] = s.elapsed()
	s.startDecay()
	r.maps[i] = sharedMap{}
	r.count--
	s.nPriv--
	s.mapped -= int64(s.g)
	s.auth.Unmap(int64(s.g))
}

// unpark undoes parkPriv after the unmap that was to follow failed: it moves each
// parked granule back into its place in r, contents and all. Where a move fails,
// the place is still mapped read-write and empty (see parkPriv): the granule's
// bytes are copied there, and its place in the park is given back to the OS, so
// that nothing changed; where that fails too, its pages stay idle in the park and
// the copy is charged anew. Only a budget that refuses the copy leaves the place
// mapped (and recorded reserved), its contents safe in the park. It returns the
// first error of what it could not undo. s.mu must be held.
//
// NB: it moves granule by granule, also those parked as one run: it runs only after
// a failed unmap, and a single granule's move either happens or not, where a run's
// may fail partway (see parkPriv) and leave some granules to be moved again empty.
func (s *Shared) unpark(r *SharedReservation, parked [][2]int) error {
	var err error
	for _, ip := range parked {
		i, p := ip[0], ip[1]
		if !s.aidle.has(p) {
			continue // taken meanwhile (not while s.mu is held, but be safe)
		}
		merr := s.sys.move(s.privAt(p), r.at(i), s.g)
		if merr == nil {
			s.aidle.clear(p)
			s.aused.clear(p)
			s.nPrivIdle--
			s.recordPriv(r, i, 1, s.ares.has(p))
			continue
		}
		copy(sharedBytes(r.at(i), s.g), sharedBytes(s.privAt(p), s.g))
		if uerr := s.sys.unmapTo(s.privAt(p), s.g); uerr == nil {
			// The copy takes over the parked granule's charge.
			s.aidle.clear(p)
			s.aused.clear(p)
			s.nPrivIdle--
			s.recordPriv(r, i, 1, true) // the copy wrote every page
			continue
		}
		s.auth.PutIdle(int64(s.g)) // it stays in the park (see putParked)
		if aerr := s.auth.TryAcquire(int64(s.g)); aerr != nil {
			if err == nil {
				err = fmt.Errorf("host: granule at %#x is parked, its contents safe, but its place is left mapped, holding a copy: %w", i<<s.shift, aerr)
			}
			continue
		}
		s.owned += int64(s.g)
		s.recordPriv(r, i, 1, true)
		if err == nil {
			err = fmt.Errorf("host: granule at %#x is back as a copy; its parked pages stay idle in the pool: %w",
				i<<s.shift, s.opErr("decommit", i<<s.shift, s.g, merr, true))
		}
	}
	return err
}

// givePriv gives the private granules at pos (taken out of the pool) back to the OS:
// it maps fresh reserved memory over their places in the park, one call per run of
// consecutive places (granule by granule where that fails). A granule whose place
// can not be remapped stays idle and owned. It returns the bytes given back and the
// first error. It sorts pos. s.mu must be held.
func (s *Shared) givePriv(pos []int) (int64, error) {
	var err error
	var n int64
	slices.Sort(pos)
	for k := 0; k < len(pos); {
		m := 1
		for k+m < len(pos) && pos[k+m] == pos[k]+m {
			m++
		}
		run := pos[k : k+m]
		k += m
		if m > 1 && s.sys.unmapTo(s.privAt(run[0]), m<<s.shift) == nil {
			for _, p := range run {
				s.aused.clear(p)
			}
			n += int64(m) << s.shift
			continue
		}
		for _, p := range run {
			if uerr := s.sys.unmapTo(s.privAt(p), s.g); uerr != nil {
				if err == nil {
					err = s.opErr("trim", 0, s.g, uerr, true)
				}
				s.untakePrivIdle([]int{p})
				continue
			}
			s.aused.clear(p)
			n += int64(s.g)
		}
	}
	if n > 0 {
		s.owned -= n
		s.auth.Release(n)
	}
	return n, err
}

// commitPriv ends a commit of n granules at gi of r in a backing of private
// granules: the idle memfd granules picks go first, then the idle private granules
// at pos, moved out of the park, then priv new private granules (already charged).
// On error the commit is undone and it returns the new slots that the caller gives
// back to the OS once it released s.mu (undone); on success the caller populates the
// new private granules (populatePriv) once it released s.mu. s.mu must be held.
func (s *Shared) commitPriv(op string, r *SharedReservation, gi, n int, picks []sharedPick, pos []int, priv int) ([]int, error) {
	off, size := gi<<s.shift, n<<s.shift
	slots := make([]int, len(picks))
	for k, p := range picks {
		slots[k] = p.slot
	}
	if done, err := s.place(r, gi, slots); err != nil {
		s.releasePriv(priv)
		s.untakePrivIdle(pos)
		return s.undoMap(op, r, off, size, picks, done, err)
	}
	s.record(r, gi, picks, false)
	fail := func(k int, err error) ([]int, error) {
		// Undo what is recorded: the positions not reached go back to the pool,
		// and so do the granules that came out of it (parked again).
		s.untakePrivIdle(pos[k:])
		s.releasePriv(priv)
		err = s.opErr(op, off, size, err, true)
		parked := s.parkPriv(r, gi, n)
		if uerr := s.sys.unmapTo(r.at(gi), size); uerr != nil {
			_ = s.unpark(r, parked)
			return nil, fmt.Errorf("%w; undoing the commit failed, [%#x, +%#x) is left committed: %w",
				err, off, size, s.opErr(op, off, size, uerr, true))
		}
		s.putParked(parked)
		return s.drop(r, gi, n), err
	}
	at := gi + len(picks)
	for k := 0; k < len(pos); {
		// A run of consecutive places moves with one call (its destinations are
		// consecutive too); where that fails, granule by granule.
		m := 1
		for k+m < len(pos) && pos[k+m] == pos[k]+m {
			m++
		}
		whole := true // what a move moves, it moves whole
		if m > 1 {
			err := s.sys.move(s.privAt(pos[k]), r.at(at+k), m<<s.shift)
			if err == nil {
				for q := k; q < k+m; q++ {
					res := s.ares.has(pos[q])
					s.aused.clear(pos[q])
					s.recordPriv(r, at+q, 1, res)
				}
				k += m
				continue
			}
			whole = errors.Is(err, errSharedSpan)
		}
		if err := s.commitPrivEach(r, at, pos, k, k+m, whole); err != nil {
			return fail(err.k, err.err)
		}
		k += m
	}
	if priv > 0 {
		at := r.at(gi + n - priv)
		if err := s.sys.protect(at, priv<<s.shift, false); err != nil {
			return fail(len(pos), err)
		}
		s.advise(at, priv<<s.shift)
		s.recordPriv(r, gi+n-priv, priv, s.populate)
	}
	s.kick()
	return nil, nil
}

// sharedPrivFail says where commitPrivEach failed with err: pos[k:] are not
// recorded and go back to the pool (k is past the granule that failed where that
// one was given back to the OS, its bytes released).
type sharedPrivFail struct {
	k   int
	err error
}

// commitPrivEach moves the idle private granules at pos[from:to] out of the park
// one at a time, pos[k] to granule at+k of r, and records them; a granule that can
// not move is given back and made anew in its place. res says whether their pages
// may be known to exist (not after a run move failed but with errSharedSpan: it may
// have moved some of them already, see parkPriv). s.mu must be held.
func (s *Shared) commitPrivEach(r *SharedReservation, at int, pos []int, from, to int, res bool) *sharedPrivFail {
	for k := from; k < to; k++ {
		p := pos[k]
		i := at + k
		res := res && s.ares.has(p)
		err := s.sys.move(s.privAt(p), r.at(i), s.g)
		if err != nil {
			res = false
			// The granule stays parked: give it back and make a new one in its
			// place, with its bytes.
			if err = s.sys.unmapTo(s.privAt(p), s.g); err != nil {
				return &sharedPrivFail{k, err}
			}
			s.aused.clear(p) // its pages are gone; its bytes stay charged for the new one
			if err = s.sys.protect(r.at(i), s.g, false); err != nil {
				s.releasePriv(1)
				return &sharedPrivFail{k + 1, err}
			}
			s.advise(r.at(i), s.g)
		}
		s.aused.clear(p)
		s.recordPriv(r, i, 1, res)
	}
	return nil
}

// prefillPriv makes one idle private granule in the private park, populated (one
// huge page), if the park has room; it reports whether it did. s.mu must be held;
// prefillPriv releases it while it populates and holds it again when it returns.
func (s *Shared) prefillPriv(background bool) (bool, error) {
	fail := func(err error) (bool, error) {
		if background {
			s.refilling = false
		}
		return false, err
	}
	if err := s.privPark(); err != nil {
		return fail(s.opErr("prefill", 0, s.g, err, true))
	}
	p := s.aused.nextClear(0, s.high)
	if p == s.high {
		return false, nil
	}
	if err := s.auth.TryAcquire(int64(s.g)); err != nil {
		return fail(&backing.OpError{Op: "prefill", Size: s.g, Err: err})
	}
	s.owned += int64(s.g)
	s.created++
	s.aused.set(p) // taken: no other prefill or park move uses it meanwhile
	at := s.privAt(p)
	perr := s.sys.protect(at, s.g, false)
	if perr == nil {
		s.advise(at, s.g)
	}
	s.mu.Unlock()
	err := perr
	if err == nil {
		err = s.prefillPopulate(at)
	}
	s.mu.Lock()
	if err != nil {
		err = s.opErr("prefill", 0, s.g, err, true)
		// NB: where the mprotect failed its place is still reserved: nothing to
		// undo. A place left inaccessible must not go idle: a commit would take it
		// as a writable granule.
		if perr == nil && s.sys.unmapTo(at, s.g) != nil {
			// Its pages may stay: keep it, owned and idle (writable), for the next Trim.
			s.ares.clear(p)
			s.untakePrivIdle([]int{p})
		} else {
			s.aused.clear(p)
			s.releasePriv(1)
		}
		return fail(err)
	}
	s.ares.set(p)
	s.untakePrivIdle([]int{p})
	return true, nil
}

// sharedAdoption is what adopt moved into the memfd: picks[k] now backs granule
// i+k of the source, whose access was ro[k] before.
type sharedAdoption struct {
	i     int
	picks []sharedPick
	ro    []bool
}

// undoAdopt undoes the adoptions of runs in r after the Share that made them
// failed with err (see unadopt). It returns
// err, joined with what could not be undone, and the new slots that the caller
// gives back to the OS once it released s.mu (undone). s.mu must be held.
func (s *Shared) undoAdopt(op string, r *SharedReservation, runs []sharedAdoption, err error) ([]int, error) {
	var give []int
	var uerr error
	if len(runs) > 0 && r.state == sharedLive { // NB: r may be nil or foreign when runs is empty
		for _, a := range runs {
			g, e := s.unadopt(op, r, a)
			give = append(give, g...)
			if uerr == nil {
				uerr = e
			}
		}
	}
	if uerr != nil {
		err = fmt.Errorf("%w; undoing the move into the memfd failed: %w", err, uerr)
	}
	return give, err
}

// unadopt moves the memfd granules that adopt placed in r back to private granules,
// contents and access as they were: each is copied into a free place of the private
// park (charged anew, made read-write, read-only again where it was), which is
// moved over its place in r. The memfd granules, mapped by nobody now, go idle, or
// are returned (busy) for giveBack where adopt made them new. A granule that can
// not move back stays a memfd granule mapped by r alone, recorded as it is, and the
// first error says so. s.mu must be held.
func (s *Shared) unadopt(op string, r *SharedReservation, a sharedAdoption) (give []int, err error) {
	left := func(i int, cause error) {
		if err != nil {
			return
		}
		how := ""
		if a.ro[i-a.i] && !r.maps[i].ro {
			how = ", writable"
		}
		err = fmt.Errorf("host: granule at %#x is left in the memfd%s: %w", i<<s.shift, how,
			s.opErr(op, i<<s.shift, s.g, cause, true))
	}
	for k, pk := range a.picks {
		i := a.i + k
		if r.maps[i].slot() != pk.slot || s.slots[pk.slot].refs != 1 {
			continue // mapped elsewhere too: it stays shared, as the caller's error says
		}
		if perr := s.privPark(); perr != nil {
			left(i, perr)
			continue
		}
		p := s.aused.nextClear(0, s.high)
		if p == s.high {
			left(i, fmt.Errorf("host: the private park is full"))
			continue
		}
		if cerr := s.auth.TryAcquire(int64(s.g)); cerr != nil {
			left(i, cerr)
			continue
		}
		s.owned += int64(s.g)
		s.aused.set(p) // taken
		at := s.privAt(p)
		merr := s.sys.protect(at, s.g, false)
		made := merr == nil // its place is writable and may hold pages
		if merr == nil {
			s.advise(at, s.g)
			copy(sharedBytes(at, s.g), sharedBytes(r.at(i), s.g))
			if a.ro[k] {
				merr = s.sys.protect(at, s.g, true) // the move carries the access
			}
		}
		if merr == nil {
			merr = s.sys.move(at, r.at(i), s.g)
		}
		if merr != nil {
			switch {
			case !made, s.sys.unmapTo(at, s.g) == nil:
				// Its place is reserved (again, or still where the mprotect failed).
				s.aused.clear(p)
				s.releasePriv(1)
			default:
				// NB: its pages may stay: keep it, owned and idle, for the next
				// Trim. The park holds writable granules only (a commit takes them
				// as such): a read-only copy is made writable again first (should
				// even that fail, it stays idle as it is).
				if a.ro[k] {
					_ = s.sys.protect(at, s.g, false)
				}
				s.ares.clear(p)
				s.untakePrivIdle([]int{p})
			}
			left(i, merr)
			continue
		}
		s.aused.clear(p) // its place in the park is left empty
		sl := &s.slots[pk.slot]
		sl.refs = 0
		if pk.fresh {
			sl.busy = true
			give = append(give, pk.slot)
		} else {
			s.toIdle(pk.slot)
		}
		r.maps[i] = sharedMap{priv: true, ro: a.ro[k], res: true} // the copy wrote every page
		s.nPriv++
		s.adopted--
	}
	return give, err
}

// privResident returns how many idle private granules are known resident. s.mu
// must be held.
func (s *Shared) privResident() int {
	n := 0
	for k, w := range s.aidle {
		n += bits.OnesCount64(w & s.ares[k])
	}
	return n
}

// populatePrivIdle populates one idle private granule that is not known resident, if
// the pool has one, and reports whether it did. s.mu must be held; it releases it
// while it populates (the granule is taken out of the pool meanwhile) and holds it
// again when it returns.
func (s *Shared) populatePrivIdle() (bool, error) {
	p := -1
	for k, w := range s.aidle {
		if v := w &^ s.ares[k]; v != 0 {
			p = k*64 + bits.TrailingZeros64(v)
			break
		}
	}
	if p < 0 || p >= s.high || s.claim(1) == 0 {
		return false, nil
	}
	s.aidle.clear(p) // taken: no commit, trim or decay takes it meanwhile
	s.nPrivIdle--
	at := s.privAt(p)
	s.mu.Unlock()
	err := s.prefillPopulate(at)
	s.mu.Lock()
	if err == nil {
		s.ares.set(p)
	}
	s.untakePrivIdle([]int{p})
	if err != nil {
		return false, s.opErr("prefill", 0, s.g, err, false)
	}
	return true, nil
}
