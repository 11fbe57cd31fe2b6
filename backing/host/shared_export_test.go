package host

import (
	"fmt"
	"math/bits"
	"sync"
	"time"
	"unsafe"
)

// SharedFaults counts the system calls of one Shared backing (mapCount excluded: it
// only explains an error) and makes chosen ones fail.
type SharedFaults struct {
	mu    sync.Mutex
	calls int // since armed
	fail  func(i int, name string) bool
	err   error
	fired bool
	log   []string
	hook  func(name string)
	pops  []int // the size of each populate since armed
}

// FailAt makes the n-th call from now fail with err (n >= 1).
func (f *SharedFaults) FailAt(n int, err error) {
	f.Fail(func(i int, _ string) bool { return i == n }, err)
}

// FailFrom makes the n-th call from now, and every one after it, fail with err.
func (f *SharedFaults) FailFrom(n int, err error) {
	f.Fail(func(i int, _ string) bool { return i >= n }, err)
}

// Fail makes every call for which fail(i, name) is true fail with err, where i counts
// the calls from now (from 1) and name is the seam's name for it ("mapFile",
// "move", "unmapTo", "release", "punch", ...).
func (f *SharedFaults) Fail(fail func(i int, name string) bool, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls, f.fail, f.err, f.fired, f.log, f.pops = 0, fail, err, false, nil, nil
}

// Reset disarms the fault and removes the hook.
func (f *SharedFaults) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls, f.fail, f.err, f.fired, f.log, f.hook, f.pops = 0, nil, nil, false, nil, nil, nil
}

// Populates returns the size of each populate call since the fault was armed (or
// reset), in order.
func (f *SharedFaults) Populates() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]int(nil), f.pops...)
}

// Before makes fn run before every system call from now, named as in Fail, so
// that a test can act at a chosen point of an operation. fn may call the backing
// only at calls the backing makes without its lock held (allocate in a commit
// that populates, say), or it deadlocks.
func (f *SharedFaults) Before(fn func(name string)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hook = fn
}

// Log returns the calls made since the fault was armed, failed ones marked with a
// '!'.
func (f *SharedFaults) Log() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.log...)
}

// Fired reports whether a call failed since the fault was armed.
func (f *SharedFaults) Fired() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fired
}

func (f *SharedFaults) call(name string) error {
	f.mu.Lock()
	hook := f.hook
	f.mu.Unlock()
	if hook != nil {
		hook(name)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.fail != nil && f.fail(f.calls, name) {
		f.fired = true
		f.log = append(f.log, "!"+name)
		return f.err
	}
	f.log = append(f.log, name)
	return nil
}

func (f *SharedFaults) wrap(sys sharedSys) sharedSys {
	in := sys
	return sharedSys{
		memfd: func(name string) (int, error) {
			if err := f.call("memfd"); err != nil {
				return -1, err
			}
			return in.memfd(name)
		},
		truncate: func(fd int, size int64) error {
			if err := f.call("truncate"); err != nil {
				return err
			}
			return in.truncate(fd, size)
		},
		allocate: func(fd int, off, n int64) error {
			if err := f.call("allocate"); err != nil {
				return err
			}
			return in.allocate(fd, off, n)
		},
		punch: func(fd int, off, n int64) error {
			if err := f.call("punch"); err != nil {
				return err
			}
			return in.punch(fd, off, n)
		},
		closeFd: func(fd int) error {
			if err := f.call("close"); err != nil {
				return err
			}
			return in.closeFd(fd)
		},
		reserve: func(n int) (unsafe.Pointer, error) {
			if err := f.call("reserve"); err != nil {
				return nil, err
			}
			return in.reserve(n)
		},
		mapFile: func(at unsafe.Pointer, n, fd int, off int64, ro bool) error {
			if err := f.call("mapFile"); err != nil {
				return err
			}
			return in.mapFile(at, n, fd, off, ro)
		},
		unmapTo: func(at unsafe.Pointer, n int) error {
			if err := f.call("unmapTo"); err != nil {
				return err
			}
			return in.unmapTo(at, n)
		},
		move: func(from, to unsafe.Pointer, n int) error {
			if err := f.call("move"); err != nil {
				return err
			}
			return in.move(from, to, n)
		},
		protect: func(at unsafe.Pointer, n int, ro bool) error {
			if err := f.call("protect"); err != nil {
				return err
			}
			return in.protect(at, n, ro)
		},
		release: func(at unsafe.Pointer, n int) error {
			if err := f.call("release"); err != nil {
				return err
			}
			return in.release(at, n)
		},
		populate: func(at unsafe.Pointer, n int, write bool) error {
			if err := f.call("populate"); err != nil {
				return err
			}
			f.mu.Lock()
			f.pops = append(f.pops, n)
			f.mu.Unlock()
			return in.populate(at, n, write)
		},
		advise: func(at unsafe.Pointer, n int, huge bool) error {
			if err := f.call("advise"); err != nil {
				return err
			}
			return in.advise(at, n, huge)
		},
		discard: func(at unsafe.Pointer, n int) error {
			if err := f.call("discard"); err != nil {
				return err
			}
			return in.discard(at, n)
		},
		granule:  in.granule,
		mapCount: in.mapCount,
	}
}

// NewSharedFaulty is NewShared with every system call going through the returned
// SharedFaults.
func NewSharedFaulty(opts SharedOptions) (*Shared, *SharedFaults, error) {
	f := &SharedFaults{}
	s, err := newShared(opts, f.wrap(sharedDefaultSys()))
	return s, f, err
}

// SetSharedMapCount replaces how s counts the process's mappings and reads
// vm.max_map_count. It must be called before s is used concurrently.
func SetSharedMapCount(s *Shared, fn func() (count, limit int, err error)) { s.sys.mapCount = fn }

// SharedMapCount is the real count of mappings and vm.max_map_count.
func SharedMapCount() (count, limit int, err error) { return sharedDefaultSys().mapCount() }

// SharedSlots returns, per granule of r, the memfd slot backing it (-1: reserved) and
// whether it is mapped read-only.
func SharedSlots(r *SharedReservation) (slots []int, ro []bool) {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	for _, m := range r.maps {
		slots = append(slots, m.slot())
		ro = append(ro, m.ro)
	}
	return slots, ro
}

// SharedPrivate returns, per granule of r, whether it is a private granule.
func SharedPrivate(r *SharedReservation) []bool {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	out := make([]bool, len(r.maps))
	for i, m := range r.maps {
		out[i] = m.priv
	}
	return out
}

// SharedQuarantined reports whether a failed Unreserve quarantined r.
func SharedQuarantined(r *SharedReservation) bool {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	return r.state == sharedQuarantined
}

// SharedWords returns the committed bytes [off, off+n) of r as 64-bit words, for
// benchmarks that read memory in place. off and n must be multiples of 8.
func SharedWords(r *SharedReservation, off, n int) []uint64 {
	// Safety: the caller keeps [off, off+n) committed while it uses the slice; the
	// reservation is page-aligned, so off aligns the words.
	return unsafe.Slice((*uint64)(sharedAt(r.base, off)), n/8)
}

// SharedGone reports whether r was unreserved (Complete).
func SharedGone(r *SharedReservation) bool {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	return r.state == sharedGone
}

// SharedFd returns the memfd (-1 after Close).
func SharedFd(s *Shared) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fd
}

// SharedRefs returns the reference count of slot i.
func SharedRefs(s *Shared, i int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return int(s.slots[i].refs)
}

// SetSharedParkChunk makes the first chunk of s's park n slots (each next one
// doubles), so that tests reach chunk boundaries with a few granules. It must be
// called before s maps anything.
func SetSharedParkChunk(s *Shared, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.park) > 0 {
		panic("SetSharedParkChunk after the park was mapped")
	}
	s.park0 = n
}

// SharedParkChunk is one chunk of the park: the address it maps slot First at, and
// its number of slots.
type SharedParkChunk struct {
	Base         uintptr
	First, Slots int
}

// SharedPark returns the chunks of s's park.
func SharedPark(s *Shared) []SharedParkChunk {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]SharedParkChunk, len(s.park))
	for k, c := range s.park {
		out[k] = SharedParkChunk{Base: uintptr(c.base), First: s.chunkFirst(k), Slots: s.park0 << k}
	}
	return out
}

// SharedParkAt returns the address of slot i in s's park.
func SharedParkAt(s *Shared, i int) uintptr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return uintptr(s.parkAt(i))
}

// SharedWaitRefill waits for the background refill to finish.
func SharedWaitRefill(s *Shared) { s.refill.Wait() }

// CheckShared verifies the bookkeeping of s against itself and its reservations, and
// the authority against the bookkeeping (the authority must be s's alone). It
// must be called while no operation is in flight.
func CheckShared(s *Shared) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.slots)
	refs := make([]int32, n)
	var mapped int64
	live, priv := 0, 0
	for r := range s.resv {
		if r.state == sharedLive {
			live++
		}
		c := 0
		for i, m := range r.maps {
			if m.priv {
				if m.at != 0 || m.shared {
					return fmt.Errorf("reservation %p granule %d is private but maps slot %d (shared=%v)", r, i, m.slot(), m.shared)
				}
				c++
				priv++
				continue
			}
			if m.at == 0 {
				continue
			}
			c++
			if m.slot() >= n {
				return fmt.Errorf("reservation %p granule %d maps slot %d of %d", r, i, m.slot(), n)
			}
			refs[m.slot()]++
		}
		if c != r.count {
			return fmt.Errorf("reservation %p counts %d committed granules, has %d", r, r.count, c)
		}
		mapped += int64(c) << s.shift
	}
	if live != s.live {
		return fmt.Errorf("%d live reservations counted, %d found", s.live, live)
	}
	idle, resident, owned := 0, 0, 0
	for i := range s.slots {
		sl := s.slots[i]
		isIdle, isFree := s.idle.has(i), s.free.has(i)
		switch {
		case sl.busy:
			return fmt.Errorf("slot %d is busy with no operation in flight", i)
		case sl.refs != refs[i]:
			return fmt.Errorf("slot %d has %d references, %d mappings", i, sl.refs, refs[i])
		case isIdle && isFree:
			return fmt.Errorf("slot %d is both idle and free", i)
		case sl.refs > 0 && (isIdle || isFree):
			return fmt.Errorf("slot %d is mapped %d times but idle=%v free=%v", i, sl.refs, isIdle, isFree)
		case sl.refs == 0 && !isIdle && !isFree:
			return fmt.Errorf("slot %d is unmapped, neither idle nor free", i)
		case isFree && sl.resident:
			return fmt.Errorf("slot %d is free and resident", i)
		}
		if isIdle {
			idle++
			if sl.resident {
				resident++
			}
		}
		if !isFree {
			owned++
		}
	}
	count := 0
	for _, w := range s.idle {
		count += bits.OnesCount64(w)
	}
	switch {
	case count != idle || idle != s.nIdle:
		return fmt.Errorf("idle: %d bits, %d slots, %d counted", count, idle, s.nIdle)
	case resident != s.nResident:
		return fmt.Errorf("resident: %d slots, %d counted", resident, s.nResident)
	case priv != s.nPriv:
		return fmt.Errorf("private: %d granules mapped, %d counted", priv, s.nPriv)
	}
	parked, idlePriv := 0, 0
	for _, w := range s.aused {
		parked += bits.OnesCount64(w)
	}
	for _, w := range s.aidle {
		idlePriv += bits.OnesCount64(w)
	}
	for p := s.aidle.next(0, len(s.aidle)*64); p < len(s.aidle)*64; p = s.aidle.next(p+1, len(s.aidle)*64) {
		if !s.aused.has(p) {
			return fmt.Errorf("private park position %d is idle but holds no granule", p)
		}
	}
	switch {
	case parked != idlePriv || idlePriv != s.nPrivIdle:
		return fmt.Errorf("private park: %d positions used, %d idle, %d counted", parked, idlePriv, s.nPrivIdle)
	case int64(owned+priv+parked)<<s.shift != s.owned:
		return fmt.Errorf("owned: %d slots, %d private, %d parked, %d bytes counted", owned, priv, parked, s.owned)
	case mapped != s.mapped:
		return fmt.Errorf("mapped: %d bytes found, %d counted", mapped, s.mapped)
	}
	if sharedPark && n > 0 && (len(s.park) == 0 || s.chunkFirst(len(s.park)) < n) {
		return fmt.Errorf("the park's %d chunks do not cover the file's %d slots", len(s.park), n)
	}
	if st := s.auth.Stats(); st.Owned != s.owned || st.Mapped != s.mapped {
		return fmt.Errorf("authority owns %d and maps %d bytes; the pool owns %d and maps %d",
			st.Owned, st.Mapped, s.owned, s.mapped)
	}
	return nil
}

// PopulateByTouch reports whether this kernel lacks MADV_POPULATE_WRITE.
var PopulateByTouch = populateByTouch

// SharedPopulatePiece is the most one populate of the pool's prefill asks for.
const SharedPopulatePiece = sharedPopulatePiece

// SetSharedClock makes s read the time from now (for the decay of idle granules),
// its epoch now's reading at the call. It must be called before s is used
// concurrently.
func SetSharedClock(s *Shared, now func() time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clock, s.epoch = now, now()
}

// SharedDecay runs one pass of the scavenger at s's clock and reports whether idle
// granules above the floor remain.
func SharedDecay(s *Shared) bool { return s.decayPass(s.clock()) }

// WallStep returns t with its wall-clock reading moved by d, a whole number of
// seconds, and its monotonic reading unchanged: what time.Now returns after
// someone set the system's clock. Package time builds no such value (a monotonic
// reading comes only from time.Now, and Add moves both readings), so WallStep
// writes the wall field of a copy of t; it fails unless t carries a monotonic
// reading and the result reads as intended (the same instant for Sub, a wall
// reading d apart), so that a change in time.Time's layout fails the test that
// uses it rather than fooling it.
func WallStep(t time.Time, d time.Duration) (time.Time, error) {
	type timeLayout struct {
		wall uint64 // hasMonotonic (bit 63), seconds since 1885 (bits 30-62), nanoseconds
		ext  int64  // the monotonic reading
		loc  *time.Location
	}
	const hasMonotonic, nsecShift = 1 << 63, 30
	if unsafe.Sizeof(t) != unsafe.Sizeof(timeLayout{}) || d%time.Second != 0 {
		return t, fmt.Errorf("WallStep: time.Time is not laid out as assumed, or %v is no whole number of seconds", d)
	}
	u := t
	// Safety: time.Time is {wall uint64; ext int64; loc *Location} (time/time.go);
	// the checks below reject a result that does not read as intended.
	p := (*timeLayout)(unsafe.Pointer(&u))
	if p.wall&hasMonotonic == 0 {
		return t, fmt.Errorf("WallStep: %v has no monotonic reading", t)
	}
	p.wall += uint64(int64(d/time.Second)) << nsecShift
	if u.Sub(t) != 0 || u.UnixNano()-t.UnixNano() != int64(d) {
		return t, fmt.Errorf("WallStep: the result reads %v after by Sub and %v by the wall clock", u.Sub(t), time.Duration(u.UnixNano()-t.UnixNano()))
	}
	return u, nil
}

// SetSharedAdoptWait makes fn run (under s's lock: it must not call s) whenever a
// Share starts to wait for another Share's move of a private granule into the
// memfd. It must be called before s is used concurrently.
func SetSharedAdoptWait(s *Shared, fn func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.testAdoptWait = fn
}

// SetSharedSmallTHP makes s, which must make private granules of small pages,
// refuse huge pages on them (MADV_NOHUGEPAGE) as it does where THP is "always",
// whatever this system's mode. It must be called before s is used concurrently.
func SetSharedSmallTHP(s *Shared, v bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.huge != sharedPrivSmall {
		panic("SetSharedSmallTHP: not a backing of private small granules")
	}
	s.smallTHP = v
}

// SharedHugeMode is how NewShared picks its new granules on a system whose
// transparent huge pages are described by the arguments (shmemWhy and anonWhy:
// why each kind may have none, "" where it may; pmd: the huge page size, 0 where
// unknown; reporting: hugeReporting's answer). It returns the mode's name
// ("memfd", "shmem-huge", "private-huge" or "private"), and why not huge pages
// and why not private granules.
func SharedHugeMode(opts SharedOptions, shmemWhy, anonWhy string, pmd int, reporting string) (mode, noHuge, noPriv string) {
	h, noHuge, noPriv := sharedHugeModeOf(opts, hugeMode{pmd: pmd, why: shmemWhy}, hugeMode{pmd: pmd, why: anonWhy},
		func() string { return reporting })
	return [...]string{sharedSmall: "memfd", sharedShmemHuge: "shmem-huge", sharedPrivHuge: "private-huge", sharedPrivSmall: "private"}[h], noHuge, noPriv
}

// ErrSharedSpan is what the move seam returns where the kernel refuses a range over
// several mappings whole (before Linux 6.17).
var ErrSharedSpan = errSharedSpan
