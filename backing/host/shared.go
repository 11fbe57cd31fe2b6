package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"unsafe"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// SharedOptions configures a [Shared] backing. Only Authority is required.
type SharedOptions struct {
	// Granularity is the granule size in bytes: a power of two and a multiple of the
	// page size. 0 means 2 MiB. Every memfd granule mapped at a scattered file offset
	// costs one kernel mapping (vm.max_map_count), so small granules bound the
	// process's shared memory early: 64k mappings are 128 GiB at 2 MiB, 4 GiB at
	// 64 KiB.
	Granularity int
	// Authority is the ledger the pool charges: it owns every physical byte the pool
	// holds, mapped or idle (backing.ByBacking). It must take bytes on the host.
	Authority *accounting.Authority
	// Low is the number of idle resident granules the pool refills to in the
	// background after a commit takes it below Low (and once at start). 0, the
	// default, refills nothing: Prefill is then the only way to fill the pool.
	Low int
	// High is the most idle granules the pool keeps after a decommit; the rest go back
	// to the OS. 0 means 64; SharedNoPool (any negative value) keeps none.
	High int
	// Populate makes Commit populate the granules it creates (MADV_POPULATE_WRITE, or
	// a touch per page where the kernel lacks it), so that the first touch takes no
	// fault. Pooled granules are not populated again: they come out of the park with
	// the page tables they went in with (see Shared).
	Populate bool
	// Name is the memfd's name, shown in /proc/self/maps as /memfd:Name. "" means
	// "vmarena".
	Name string
}

// SharedNoPool as SharedOptions.High keeps no idle granule: every granule goes back
// to the OS when its last mapping goes.
const SharedNoPool = -1

const (
	sharedDefaultGranularity = 2 << 20
	sharedDefaultHigh        = 64
	sharedDefaultName        = "vmarena"
	sharedMaxName            = 249 // memfd_create(2): longer names fail with EINVAL
	sharedMaxSlots           = 1<<31 - 1
	sharedGrowStep           = 1 << 30 // the memfd grows by doubling, at most this much at once
)

// Shared is a host backing whose physical memory is a pool of granules in one memfd
// (Linux): a physical granule is a granule-sized, granule-aligned offset of the file,
// a slot. Commit maps slots into a reservation: it moves them there from the park
// (mremap, see below), or maps them (mmap MAP_SHARED|MAP_FIXED). Share maps the
// slots behind one reservation's range into another's, so that one physical granule
// may back any number of ranges. Each slot counts its mappings and goes back to the
// pool with its last one. Protect makes a reservation's committed granules read-only,
// or writable again, in place (mprotect).
//
// A slot is in one of three states:
//
//  1. Free: not ours. The file has a hole there (or ends before it); it holds no
//     memory and is charged nothing.
//  2. Idle: owned and charged, mapped in no reservation, kept in the pool for the
//     next commit. It is Resident when its pages are known to exist (Prefill,
//     Populate, SharedOptions.Populate).
//  3. Live: owned and charged, mapped in a reservation at least once.
//
// A commit takes idle slots first and creates new ones (Free to Live) only for the
// rest, charging the authority for all of them at once before anything is touched. It
// places the granules of one commit, and a granule after its predecessor in the
// reservation, at consecutive file offsets where it can, and maps each consecutive run
// with one call, so that the kernel merges them into one mapping.
//
// # The park
//
// A fresh mapping of existing pages still takes a minor fault per page on first
// touch, 0.5-0.6 ms per 2 MiB of 4 KiB pages, where rewriting mapped memory costs
// under 10 µs; but a mapping that moves (mremap) takes its page table entries along.
// So the backing keeps the whole memfd mapped in the park, address space of its own,
// one read-write mapping per chunk, where slot i has a fixed place. A commit moves
// each run of slots from the park into the reservation (mremap with MREMAP_FIXED and
// MREMAP_DONTUNMAP: the park keeps its mapping, without the entries), and a
// decommit or Unreserve that removes a granule's last mapping, a read-write one,
// moves it back to the slot's place while the pool keeps the granule. An idle
// granule thus waits with the page tables its last mapping built, all of them after
// Prefill, or after a sequence wrote every page: the commit that takes it costs a
// few µs and its first touch takes no fault. Granules whose last mapping was
// read-only, or that a move could not take (the kernel refuses MREMAP_DONTUNMAP of
// shared mappings before 5.13), go idle without page tables and are mapped afresh.
//
// Nothing is ever unmapped in a reservation or the park but as a whole, so no other
// mmap of the process can land in either.
//
// # Memory management
//
// Accounting is [backing.ByBacking] with SharedOptions.Authority: the authority's
// owned bytes are the bytes of every Idle and Live slot, and its mapped bytes those of
// every mapping (a slot mapped 64 times is owned once and mapped 64 times). Callers
// must not charge committed bytes again. Every reservation MUST be given back with
// Unreserve, and the backing with Close.
//
// The pool gives idle granules back to the OS (fallocate PUNCH_HOLE) above the High
// water mark, on Trim, and, while the governor has requests waiting for host memory
// (Authority.Acquire, CommitCtx), at once as they go idle, so that memory kept for
// this pool's future commits is not held against a caller that needs it now; and
// each time a request on the host starts to wait, the pool's reclaimer (see
// accounting.Authority.SetReclaimer) gives back every granule already idle, so that
// another pool's user is not starved by this one's spare granules. A
// granule that can not be given back (the punch fails) stays idle and owned; the
// next Trim tries again.
//
// Pooled granules keep their old contents: CommitZeroes is false, and a recommitted
// or shared range reads whatever was last written there. Granules new to the file
// read as zero.
//
// Bookkeeping costs 8 bytes per reserved granule and a few bytes per slot of the
// file, which only grows (sparse: holes cost nothing). The park costs address space,
// not memory: its chunks double from 1 GiB, so it spans at most twice the file.
// Reservations and park chunks of granules of 2 MiB or more are aligned to 2 MiB, so
// that the kernel moves whole page-table pages; a reservation may use up to 2 MiB of
// address space more than its size for that.
//
// # Limits
//
// Each run of consecutive slots mapped at consecutive addresses is one kernel
// mapping, and a process has at most vm.max_map_count of them (65530 by default).
// Idle granules cost none: the park stays one mapping per chunk (up to three with
// alignment padding), whatever moves in and out, since what comes back maps the same
// file offsets and merges.
// When mmap fails with ENOMEM and the process is near that limit, the error wraps
// [backing.ErrMapLimit] and unix.ENOMEM and names the count, the limit and the
// sysctl that raises it. Placing consecutive granules at consecutive offsets keeps
// the count low; granules shared piecemeal or recycled from a fragmented pool do not
// merge.
//
// # Concurrency
//
// A Shared is safe for concurrent use, with the usual rule of [backing.Backing]:
// calls on overlapping ranges (of one reservation, or the source and destination of a
// Share) must be serialized by the caller. Bookkeeping is under one mutex, held
// across mmap and mremap (which the kernel serializes per process anyway) but not
// across page population or fallocate, which run outside it on slots marked busy.
// Close must not run concurrently with any other call.
type Shared struct {
	_ sharedNoCopy

	g        int // granule size
	shift    int // log2(g)
	auth     *accounting.Authority
	low      int
	high     int // 0 when SharedNoPool
	populate bool
	sys      sharedSys

	mu        sync.Mutex
	fd        int
	closed    bool
	slots     []sharedSlot
	idle      sharedBits // Idle slots (not busy)
	free      sharedBits // Free slots
	nIdle     int
	nResident int   // Idle slots that are resident
	owned     int64 // bytes of Idle, Live and busy owned slots; in step with the authority
	mapped    int64 // bytes of mappings; in step with the authority
	live      int   // reservations not yet unreserved (Quarantined ones excluded)
	resv      map[*SharedReservation]struct{}
	park      []sharedChunk // see shared_park.go
	park0     int           // slots in the park's first chunk
	stray     []sharedSpan  // address space a failed step could not give back
	refilling bool
	refill    sync.WaitGroup
}

// sharedSlot is one granule-sized offset of the memfd.
type sharedSlot struct {
	refs     int32 // mappings; >0 means Live
	busy     bool  // owned and in flight: being created, populated or given back
	resident bool  // its pages are known to exist
}

// SharedReservation is a reserved address range of a Shared backing. It is a handle:
// the backing owns what it points to. Its zero value is not a reservation.
type SharedReservation struct {
	s    *Shared
	base unsafe.Pointer
	size int
	raw  unsafe.Pointer // as reserved, before alignment: what Unreserve unmaps
	rawN int

	// guarded by s.mu
	state sharedState
	maps  []sharedMap // per granule; 8 bytes of bookkeeping per reserved granule
	count int         // committed granules
}

type sharedState uint8

const (
	sharedLive        sharedState = iota
	sharedGone                    // unreserved
	sharedQuarantined             // a failed Unreserve left part of it behind
)

// sharedMap is what backs one granule of a reservation.
type sharedMap struct {
	at     uint32 // slot+1; 0 means Reserved
	ro     bool   // mapped read-only (shared so, or protected)
	shared bool   // shared read-only into the reservation: Protect never makes it writable
}

func (m sharedMap) slot() int { return int(m.at) - 1 }

// sharedNoCopy makes go vet report copies of a Shared.
type sharedNoCopy struct{}

func (*sharedNoCopy) Lock()   {}
func (*sharedNoCopy) Unlock() {}

// sharedSys is the syscall seam: every system call of the shared backing goes
// through one of these, so that tests can make the n-th one fail.
type sharedSys struct {
	memfd    func(name string) (int, error)                               // memfd_create, close-on-exec
	truncate func(fd int, size int64) error                               // ftruncate
	allocate func(fd int, off, n int64) error                             // fallocate(0): allocate the pages
	punch    func(fd int, off, n int64) error                             // fallocate(PUNCH_HOLE|KEEP_SIZE)
	closeFd  func(fd int) error                                           // close
	reserve  func(n int) (unsafe.Pointer, error)                          // mmap PROT_NONE private anonymous, no reserve
	mapFile  func(at unsafe.Pointer, n, fd int, off int64, ro bool) error // mmap MAP_SHARED|MAP_FIXED of the file
	unmapTo  func(at unsafe.Pointer, n int) error                         // mmap PROT_NONE anonymous MAP_FIXED over a range
	move     func(from, to unsafe.Pointer, n int) error                   // mremap MREMAP_FIXED|MREMAP_DONTUNMAP of a file mapping
	protect  func(at unsafe.Pointer, n int, ro bool) error                // mprotect PROT_READ, or PROT_READ|PROT_WRITE
	release  func(at unsafe.Pointer, n int) error                         // munmap
	populate func(at unsafe.Pointer, n int, write bool) error             // MADV_POPULATE_WRITE/READ, else a touch per page
	mapCount func() (count, limit int, err error)                         // mappings of the process, vm.max_map_count
}

var (
	_ backing.Backing[*SharedReservation]   = (*Shared)(nil)
	_ backing.Sharer[*SharedReservation]    = (*Shared)(nil)
	_ backing.Waiter[*SharedReservation]    = (*Shared)(nil)
	_ backing.Populator[*SharedReservation] = (*Shared)(nil)
	_ backing.Protector[*SharedReservation] = (*Shared)(nil)
	_ backing.Copier[*SharedReservation]    = (*Shared)(nil)
	_ backing.Pool                          = (*Shared)(nil)
	_ backing.HostAccessible                = (*Shared)(nil)
	_ backing.Zeroer                        = (*Shared)(nil)
)

// NewShared returns a Shared backing with an empty pool and an empty memfd. The
// backing MUST be closed with Close once every reservation is unreserved. Where the
// system has no memfd it returns an error wrapping errors.ErrUnsupported; bad options
// yield an error wrapping ErrSharedOptions.
func NewShared(opts SharedOptions) (*Shared, error) {
	if !sharedSupported {
		return nil, fmt.Errorf("host: shared backing (memfd) is not supported on this system: %w", errors.ErrUnsupported)
	}
	return newShared(opts, sharedDefaultSys())
}

func newShared(opts SharedOptions, sys sharedSys) (*Shared, error) {
	page := os.Getpagesize()
	if opts.Granularity == 0 {
		opts.Granularity = max(sharedDefaultGranularity, page)
	}
	if opts.High == 0 {
		opts.High = sharedDefaultHigh
	}
	high := max(opts.High, 0)
	if opts.Name == "" {
		opts.Name = sharedDefaultName
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrSharedOptions}, args...)...)
	}
	switch g := opts.Granularity; {
	case !backing.IsPowerOfTwo(g) || g%page != 0:
		return nil, bad("granularity %d is not a power of two and a multiple of the %d-byte page", g, page)
	case g > 1<<30:
		return nil, bad("granularity %d is above 1 GiB", g)
	case opts.Authority == nil:
		return nil, bad("no authority: the pool must charge what it owns")
	case opts.Authority.Device() != accounting.HostKey:
		return nil, bad("authority %q takes bytes on %v, not on the host", opts.Authority.Name(), opts.Authority.Device())
	case opts.Low < 0:
		return nil, bad("negative low water mark %d", opts.Low)
	case opts.Low > high:
		return nil, bad("low water mark %d above the high water mark %d", opts.Low, high)
	case len(opts.Name) > sharedMaxName:
		return nil, bad("memfd name of %d bytes (at most %d)", len(opts.Name), sharedMaxName)
	}
	for i := 0; i < len(opts.Name); i++ {
		if opts.Name[i] == 0 {
			return nil, bad("memfd name %q contains a NUL byte", opts.Name)
		}
	}
	fd, err := sys.memfd(opts.Name)
	if err != nil {
		return nil, fmt.Errorf("host: memfd_create %q: %w", opts.Name, err)
	}
	s := &Shared{
		g:        opts.Granularity,
		shift:    backing.Log2(opts.Granularity),
		auth:     opts.Authority,
		low:      opts.Low,
		high:     high,
		populate: opts.Populate,
		sys:      sys,
		fd:       fd,
		resv:     make(map[*SharedReservation]struct{}),
		park0:    max(sharedParkFirst>>backing.Log2(opts.Granularity), 1),
	}
	s.mu.Lock()
	s.kick()
	s.mu.Unlock()
	opts.Authority.SetReclaimer(s.reclaim)
	return s, nil
}

// reclaim gives every idle granule back when a request on the device waits for
// memory (the governor calls it): idle granules hold budget that the waiter, perhaps
// another pool's user, can not otherwise have.
func (s *Shared) reclaim(int64) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	// Close waits for this like for a refill, so the memfd outlives the give-back.
	s.refill.Add(1)
	victims := s.victims(s.nIdle)
	s.mu.Unlock()
	defer s.refill.Done()
	_, _ = s.giveBack(victims)
}

// Granularity returns the granule size in bytes.
func (s *Shared) Granularity() int { return s.g }

// Device returns the host.
func (s *Shared) Device() accounting.DeviceKey { return accounting.HostKey }

// Accounting returns ByBacking with the backing's authority.
func (s *Shared) Accounting() backing.PhysicalAccounting { return backing.ByBacking(s.auth) }

// HostAccessible reports true: committed memory may be read and written at Base+off.
func (s *Shared) HostAccessible() bool { return true }

// CommitZeroes reports false: a pooled granule keeps its last contents.
func (s *Shared) CommitZeroes() bool { return false }

// Reserve moves size bytes of address space from Unreserved to Reserved (mmap
// PROT_NONE, MAP_NORESERVE) and commits nothing. With granules of 2 MiB or more the
// base is 2 MiB-aligned (see Shared). The reservation MUST be given back with
// Unreserve.
func (s *Shared) Reserve(size int) (*SharedReservation, error) {
	if err := backing.CheckReserve(size, s.g); err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.open()
	defer s.mu.Unlock()
	r := &SharedReservation{s: s, size: size}
	if size > 0 {
		if size>>s.shift > sharedMaxSlots {
			return nil, &backing.OpError{Op: "reserve", Size: size, Kind: backing.ErrOutOfMemory,
				Err: fmt.Errorf("host: more than %d granules in one reservation", sharedMaxSlots)}
		}
		align, pad := sharedAlignment(s.g)
		raw, err := s.sys.reserve(size + pad)
		if err != nil {
			return nil, s.opErr("reserve", 0, size, err, true)
		}
		r.raw, r.rawN = raw, size+pad
		r.base = sharedAlign(raw, align)
		r.maps = make([]sharedMap, size>>s.shift)
	}
	s.resv[r] = struct{}{}
	s.live++
	return r, nil
}

// Base returns the first address of the reservation (nil's: 0, for an empty one).
func (s *Shared) Base(r *SharedReservation) uintptr {
	r.s.mu.Lock() // r's own backing guards its state, also for a foreign r
	defer r.s.mu.Unlock()
	r.check()
	return uintptr(r.base)
}

// Size returns the reserved size in bytes.
func (s *Shared) Size(r *SharedReservation) int {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	r.check()
	return r.size
}

// check panics when r was unreserved (or quarantined). r.s.mu must be held.
func (r *SharedReservation) check() {
	if r.state != sharedLive {
		panic(backing.PanicUseAfterUnreserve)
	}
}

// use returns an error unless r is a reservation of s. s.mu must be held; when r was
// unreserved, use releases it and panics (so callers must not defer the unlock).
func (s *Shared) use(op string, r *SharedReservation) error {
	if r == nil || r.s != s {
		return &backing.OpError{Op: op, Kind: backing.ErrForeignReservation,
			Err: errors.New("host: not a reservation of this shared backing")}
	}
	if r.state != sharedLive {
		s.mu.Unlock()
		panic(backing.PanicUseAfterUnreserve)
	}
	return nil
}

// open panics when s was closed. s.mu must be held; open releases it before it
// panics (so callers must not defer the unlock).
func (s *Shared) open() {
	if s.closed {
		s.mu.Unlock()
		panic(PanicSharedClosed)
	}
}

// want returns an error unless every granule of [off, off+size) of r is committed
// (true) or reserved (false). s.mu must be held and the range checked.
func (r *SharedReservation) want(op string, off, size int, committed bool) error {
	sh := r.s.shift
	for i := off >> sh; i < (off+size)>>sh; i++ {
		if (r.maps[i].at != 0) != committed {
			kind := backing.ErrCommitted
			if committed {
				kind = backing.ErrNotCommitted
			}
			return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind,
				Err: fmt.Errorf("host: granule at %#x", i<<sh)}
		}
	}
	return nil
}

// at returns the address of granule i of r.
func (r *SharedReservation) at(i int) unsafe.Pointer { return sharedAt(r.base, i<<r.s.shift) }

// prepare validates a range call on r under s.mu: r is s's and live, the range lies
// in it, and its granules are all committed or all reserved.
func (s *Shared) prepare(op string, r *SharedReservation, off, size int, committed bool) error {
	if err := s.use(op, r); err != nil {
		return err
	}
	if err := backing.CheckRange(op, off, size, r.size, s.g); err != nil {
		return err
	}
	return r.want(op, off, size, committed)
}

// opErr wraps a failed system call of op. An ENOMEM from mmap is checked against the
// process's mapping limit, so that reaching vm.max_map_count says so.
func (s *Shared) opErr(op string, off, size int, err error, mmap bool) error {
	kind := error(nil)
	if sharedNoMemory(err) {
		kind = backing.ErrOutOfMemory
		if mmap {
			if n, limit, cerr := s.sys.mapCount(); cerr == nil && limit > 0 && n+sharedMapSlack >= limit {
				kind = backing.ErrMapLimit
				err = &sharedMapLimitError{count: n, limit: limit, errno: err}
			}
		}
	}
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: err}
}

// sharedMapSlack is how close to vm.max_map_count the mapping count must be for an
// ENOMEM to be blamed on the limit: one MAP_FIXED may split a mapping in three, and
// other threads map concurrently.
const sharedMapSlack = 64

// Commit moves [off, off+size) of r from Reserved to Committed: idle pooled granules
// first, new ones for the rest. New granules are charged to the authority all at once
// before anything is touched; when the budget refuses, Commit returns the
// *accounting.BudgetError (errors.Is(err, accounting.ErrBudgetExceeded)) inside an
// *OpError and changes nothing. A pooled granule keeps its old contents.
func (s *Shared) Commit(r *SharedReservation, off, size int) error {
	return s.commit(context.Background(), r, off, size, false)
}

// CommitCtx is Commit that, when the budget refuses the new granules, waits in FIFO
// order with the device's other waiters (Authority.Acquire) until ctx ends, then
// commits with the bytes it waited for. It holds nothing while it waits: the idle
// granules it would have taken go back to the OS (as with any waiter queued) and it
// waits for the bytes of the whole range, so that waiting commits can not hold
// pieces each of them needs. When ctx ends first it returns ctx.Err() (wrapped)
// and the range is as it was.
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
	s.mu.Lock()
	if err := s.prepare(op, r, off, size, false); err != nil {
		s.mu.Unlock()
		return err
	}
	gi, n := off>>s.shift, size>>s.shift
	if n == 0 {
		s.mu.Unlock()
		return nil
	}
	hint := -1
	if gi > 0 && r.maps[gi-1].at != 0 {
		hint = r.maps[gi-1].slot() + 1 // continue the file run of the granule before
	}
	picks := s.pickIdle(min(n, s.nIdle), hint)
	if len(picks) < n {
		var fresh int
		var err error
		if picks, fresh, err = s.charge(ctx, op, r, off, size, n, picks, wait); err != nil {
			return err
		}
		if len(picks) > 0 {
			hint = picks[len(picks)-1].slot + 1
		}
		more, err := s.pickFresh(fresh, hint)
		if err != nil {
			s.unpick(picks)
			bytes := int64(fresh) << s.shift
			s.owned -= bytes
			s.auth.Release(bytes)
			s.mu.Unlock()
			return s.opErr(op, off, size, err, true) // growing the park maps memory
		}
		picks = append(picks, more...)
		slices.SortFunc(picks, func(a, b sharedPick) int { return a.slot - b.slot })
		if s.populate {
			if err := s.allocateNew(op, r, off, size, picks, more); err != nil {
				return err
			}
		}
	}
	slots := make([]int, n)
	for k, p := range picks {
		slots[k] = p.slot
	}
	if done, err := s.place(r, gi, slots); err != nil {
		return s.undoMap(op, r, off, size, picks, done, err)
	}
	s.record(r, gi, picks, false)
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

// charge takes the bytes of fresh new granules for a commit of n granules that
// holds the idle picks: at once, or, when wait is true and the budget refuses, in
// FIFO order with the device's other waiters until ctx ends. It returns the idle
// picks the commit keeps and how many granules it must create. s.mu must be held; on
// error it is released and nothing is held.
//
// NB: a commit holds nothing while it waits. Holding its idle picks while waiting for
// the rest would let commits that each hold some wait for each other forever; so it
// gives them back (a pool with waiters keeps nothing idle anyway) and waits for all n
// granules at once.
func (s *Shared) charge(ctx context.Context, op string, r *SharedReservation, off, size, n int, picks []sharedPick, wait bool) ([]sharedPick, int, error) {
	fresh := n - len(picks)
	err := s.auth.TryAcquire(int64(fresh) << s.shift)
	if err == nil {
		s.owned += int64(fresh) << s.shift
		return picks, fresh, nil
	}
	if !wait || !accounting.CanWait(err) {
		s.unpick(picks)
		s.mu.Unlock()
		return nil, 0, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	idle := make([]int, len(picks))
	for k, p := range picks {
		idle[k] = p.slot
	}
	s.mu.Unlock()
	s.giveBack(idle) // a slot whose punch fails just stays idle
	bytes := int64(n) << s.shift
	if err := s.auth.Acquire(ctx, bytes); err != nil {
		return nil, 0, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	s.mu.Lock()
	if r.state != sharedLive {
		s.auth.Release(bytes)
		s.mu.Unlock()
		panic(backing.PanicUseAfterUnreserve)
	}
	s.owned += bytes
	return nil, n, nil
}

// allocateNew allocates the pages of the new slots more (one run) in the file before
// they are mapped: that and then populating the mapping costs 15% less than
// populating an empty shmem mapping, which faults one page at a time. s.mu must be
// held; it is released meanwhile (the slots are busy), and on error for good, with
// the commit undone.
func (s *Shared) allocateNew(op string, r *SharedReservation, off, size int, picks, more []sharedPick) error {
	s.mu.Unlock()
	err := s.sys.allocate(s.fd, int64(more[0].slot)<<s.shift, int64(len(more))<<s.shift)
	s.mu.Lock()
	if err == nil && r.state == sharedLive {
		for _, p := range more {
			s.slots[p.slot].resident = true
		}
		return nil
	}
	for _, p := range picks {
		if !p.fresh {
			s.toIdle(p.slot)
		}
	}
	s.mu.Unlock()
	give := make([]int, len(more))
	for k, p := range more {
		give[k] = p.slot
	}
	_, gerr := s.giveBack(give) // the allocation may have been partial
	if err == nil {
		panic(backing.PanicUseAfterUnreserve) // r was unreserved meanwhile
	}
	return s.stayIdle(s.opErr(op, off, size, err, false), gerr)
}

// undoMap undoes a commit of picks at off of r whose mmap failed after done
// granules: it maps reserved memory over those and returns the picks, idle ones to
// the pool, new ones to the OS. s.mu must be held; it is released.
func (s *Shared) undoMap(op string, r *SharedReservation, off, size int, picks []sharedPick, done int, err error) error {
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
	if !s.populate {
		s.unpick(picks[kept:]) // new slots never touched: still holes
		s.mu.Unlock()
		return err
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
	s.mu.Unlock()
	_, gerr := s.giveBack(give)
	return s.stayIdle(err, gerr)
}

// populateNew populates, outside the lock, the granules a commit of len(picks)
// granules at gi of r created. On failure it undoes the whole commit: the created
// granules go back to the OS, the pooled ones to the pool.
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

// Decommit moves [off, off+size) of r from Committed to Reserved by mapping fresh
// PROT_NONE anonymous memory over it (the range stays reserved), and drops one
// reference per physical granule: a granule whose last mapping went returns to the
// pool, or to the OS (see Shared). A read-write last mapping that the pool keeps is
// first moved into the park with its page tables (see Shared). The contents seen
// through r are forfeit; other mappings of the granules keep them. On error nothing
// changed (but where page tables wait).
func (s *Shared) Decommit(r *SharedReservation, off, size int) error {
	s.mu.Lock()
	if err := s.prepare("decommit", r, off, size, true); err != nil {
		s.mu.Unlock()
		return err
	}
	if size == 0 {
		s.mu.Unlock()
		return nil
	}
	s.parkLast(r, off>>s.shift, size>>s.shift)
	if err := s.sys.unmapTo(sharedAt(r.base, off), size); err != nil {
		s.mu.Unlock()
		return s.opErr("decommit", off, size, err, true)
	}
	give := s.drop(r, off>>s.shift, size>>s.shift)
	s.mu.Unlock()
	s.giveBack(give) // a failed punch keeps the granule in the pool, which is no error of Decommit
	return nil
}

// Unreserve unmaps the whole range of r (munmap), dropping one reference per
// committed granule, and moves it to Unreserved. The outcome is honest:
//
//   - Complete, with the committed bytes as Unmapped. Last mappings the pool keeps
//     go to the park first, as in Decommit.
//   - Failed when nothing changed: r is still valid and Unreserve may be called again.
//   - Quarantined when a step failed midway: if munmap fails, Unreserve decommits the
//     committed runs one by one and tries munmap again; the bytes decommitted are
//     Unmapped, those still mapped are Residual (still owned, mapped and charged), and
//     r is unusable.
//
// A foreign reservation is Failed with ErrForeignReservation.
func (s *Shared) Unreserve(r *SharedReservation) accounting.ReleaseOutcome {
	s.mu.Lock()
	if err := s.use("unreserve", r); err != nil {
		s.mu.Unlock()
		return accounting.FailedRelease(0, err)
	}
	held := int64(r.count) << s.shift
	n := len(r.maps)
	if r.size == 0 {
		s.forget(r, sharedGone)
		s.mu.Unlock()
		return accounting.Released(0)
	}
	s.parkLast(r, 0, n)
	err := s.sys.release(r.raw, r.rawN)
	if err == nil {
		give := s.drop(r, 0, n)
		s.forget(r, sharedGone)
		s.mu.Unlock()
		s.giveBack(give)
		return accounting.Released(held)
	}
	// munmap failed (at vm.max_map_count, say: a range inside a larger mapping must
	// split it). Decommit run by run, which merges mappings rather than splitting
	// them, and try again.
	err = s.opErr("unreserve", 0, r.size, err, true)
	var give []int
	var unmapped int64
	for i := 0; i < n; {
		if r.maps[i].at == 0 {
			i++
			continue
		}
		j := i + 1
		for j < n && r.maps[j].at != 0 {
			j++
		}
		if uerr := s.sys.unmapTo(r.at(i), (j-i)<<s.shift); uerr != nil {
			err = errors.Join(err, s.opErr("unreserve", i<<s.shift, (j-i)<<s.shift, uerr, true))
			return s.quarantine(r, give, unmapped, held, err)
		}
		give = append(give, s.drop(r, i, j-i)...)
		unmapped += int64(j-i) << s.shift
		i = j
	}
	if rerr := s.sys.release(r.raw, r.rawN); rerr != nil {
		return s.quarantine(r, give, unmapped, held, errors.Join(err, s.opErr("unreserve", 0, r.size, rerr, true)))
	}
	s.forget(r, sharedGone)
	s.mu.Unlock()
	s.giveBack(give)
	return accounting.Released(held)
}

// quarantine ends a failed Unreserve: Failed if nothing changed, else r is
// Quarantined with what it still maps. s.mu must be held; it is released.
func (s *Shared) quarantine(r *SharedReservation, give []int, unmapped, held int64, err error) accounting.ReleaseOutcome {
	if unmapped == 0 {
		s.mu.Unlock()
		return accounting.FailedRelease(held, err)
	}
	s.live--
	r.state = sharedQuarantined
	s.mu.Unlock()
	s.giveBack(give)
	return accounting.Outcome(unmapped, held-unmapped, true, err)
}

// forget ends r's life as a live reservation. s.mu must be held.
func (s *Shared) forget(r *SharedReservation, state sharedState) {
	r.state = state
	s.live--
	delete(s.resv, r)
}

// Share moves [dstOff, dstOff+size) of dst from Reserved to Committed by mapping the
// physical granules committed at [srcOff, srcOff+size) of src (the same memfd
// offsets, MAP_SHARED|MAP_FIXED), read-only or read-write. Each granule gains one
// reference and the mapped bytes are attributed to the authority; nothing new is
// owned. prot applies to the new mapping only (a read-only mapping may be shared on
// read-write: the physical granule is the same). On error nothing changed.
func (s *Shared) Share(dst *SharedReservation, dstOff int, src *SharedReservation, srcOff, size int, prot backing.Protection) error {
	const op = "share"
	s.mu.Lock()
	if err := s.use(op, dst); err != nil {
		s.mu.Unlock()
		return err
	}
	if err := s.use(op, src); err != nil {
		s.mu.Unlock()
		return err
	}
	defer s.mu.Unlock()
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
	n := size >> s.shift
	if n == 0 {
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
		return nil
	}
	err = s.opErr(op, dstOff, size, err, true)
	if done > 0 {
		if uerr := s.sys.unmapTo(dst.at(di), done<<s.shift); uerr != nil {
			// NB: as in commit, what can not be undone is recorded as what it is.
			s.record(dst, di, picks[:done], ro)
			return fmt.Errorf("%w; undoing it failed, [%#x, +%#x) is left shared: %w",
				err, dstOff, done<<s.shift, s.opErr(op, dstOff, done<<s.shift, uerr, true))
		}
	}
	return err
}

// Protect sets the access of the committed range [off, off+size) of r to prot with one
// mprotect over the range (nothing at all when every granule has it already). The
// physical granules, their contents and their other mappings are untouched. ReadWrite
// is refused with ErrSharedReadOnly (which matches backing.ErrReadOnly) on a range
// holding a granule shared into r read-only. A store through Base(r) into a read-only
// range raises SIGSEGV: the process dies unless the goroutine runs under
// runtime/debug.SetPanicOnFault(true), where it becomes a recoverable panic; CopyIn
// refuses instead. The access lasts until the granule is decommitted; a read-only
// last mapping goes idle without its page tables (see Shared). On error nothing
// changed, but where mprotect failed midway and restoring a run's old access failed
// too: that run is then recorded read-only, which CopyIn honours, and the error says
// so.
func (s *Shared) Protect(r *SharedReservation, off, size int, prot backing.Protection) error {
	const op = "protect"
	s.mu.Lock()
	if err := s.use(op, r); err != nil {
		s.mu.Unlock()
		return err
	}
	defer s.mu.Unlock()
	if prot != backing.ReadOnly && prot != backing.ReadWrite {
		return &backing.OpError{Op: op, Offset: off, Size: size, Kind: ErrSharedArgument,
			Err: fmt.Errorf("host: unknown protection %d", prot)}
	}
	if err := backing.CheckRange(op, off, size, r.size, s.g); err != nil {
		return err
	}
	if err := r.want(op, off, size, true); err != nil {
		return err
	}
	ro := prot == backing.ReadOnly
	gi, gj := off>>s.shift, (off+size)>>s.shift
	same := true
	for i := gi; i < gj; i++ {
		m := r.maps[i]
		if !ro && m.shared {
			return &backing.OpError{Op: op, Offset: off, Size: size, Kind: ErrSharedReadOnly,
				Err: fmt.Errorf("host: granule at %#x is shared read-only into this reservation", i<<s.shift)}
		}
		same = same && m.ro == ro
	}
	if same {
		return nil
	}
	if err := s.sys.protect(r.at(gi), size, ro); err != nil {
		// NB: mprotect may fail after changing part of the range (a split refused
		// at vm.max_map_count): give each run its old access back.
		err = s.opErr(op, off, size, err, true)
		for i := gi; i < gj; {
			j := i + 1
			for j < gj && r.maps[j].ro == r.maps[i].ro {
				j++
			}
			if rerr := s.sys.protect(r.at(i), (j-i)<<s.shift, r.maps[i].ro); rerr != nil {
				for k := i; k < j; k++ {
					r.maps[k].ro = true
				}
				err = fmt.Errorf("%w; restoring the access of [%#x, +%#x) failed, it is recorded read-only: %w",
					err, i<<s.shift, (j-i)<<s.shift, s.opErr(op, i<<s.shift, (j-i)<<s.shift, rerr, true))
			}
			i = j
		}
		return err
	}
	for i := gi; i < gj; i++ {
		r.maps[i].ro = ro
	}
	return nil
}

// Populate makes [off, off+size) of r resident (MADV_POPULATE_WRITE, or
// MADV_POPULATE_READ on read-only mappings; a touch per page where the kernel has
// neither), so that later accesses take no fault. The contents are kept. The
// physical granules are known resident from then on, also after they go idle.
func (s *Shared) Populate(r *SharedReservation, off, size int) error {
	type span struct{ i, j int }
	s.mu.Lock()
	if err := s.prepare("populate", r, off, size, true); err != nil {
		s.mu.Unlock()
		return err
	}
	var spans []span
	gi, gj := off>>s.shift, (off+size)>>s.shift
	for i := gi; i < gj; {
		j := i + 1
		for j < gj && r.maps[j].ro == r.maps[i].ro {
			j++
		}
		spans = append(spans, span{i, j})
		i = j
	}
	ro := make([]bool, len(spans))
	for k, sp := range spans {
		ro[k] = r.maps[sp.i].ro
	}
	s.mu.Unlock()
	for k, sp := range spans {
		if err := s.sys.populate(r.at(sp.i), (sp.j-sp.i)<<s.shift, !ro[k]); err != nil {
			return s.opErr("populate", sp.i<<s.shift, (sp.j-sp.i)<<s.shift, err, false)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if r.state == sharedLive {
		for i := gi; i < gj; i++ {
			if m := r.maps[i]; m.at != 0 {
				s.slots[m.slot()].resident = true
			}
		}
	}
	return nil
}

// span checks a byte range of r for CopyIn/CopyOut: inside r and wholly committed,
// and, for a write, mapped read-write. s.mu must be held.
func (s *Shared) span(op string, r *SharedReservation, off, n int, write bool) error {
	if err := s.use(op, r); err != nil {
		return err
	}
	if off < 0 || n < 0 || off > r.size-n {
		kind := backing.ErrOutOfRange
		if off < 0 || n < 0 {
			kind = backing.ErrInvalidRange
		}
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: kind,
			Err: fmt.Errorf("host: reservation is %d bytes", r.size)}
	}
	if n == 0 {
		return nil
	}
	lo := backing.AlignDown(off, s.g)
	hi, _ := backing.AlignUp(off+n, s.g)
	if err := r.want(op, lo, hi-lo, true); err != nil {
		return err
	}
	if write {
		for i := lo >> s.shift; i < hi>>s.shift; i++ {
			if r.maps[i].ro {
				return &backing.OpError{Op: op, Offset: off, Size: n, Kind: ErrSharedReadOnly,
					Err: fmt.Errorf("host: granule at %#x", i<<s.shift)}
			}
		}
	}
	return nil
}

// CopyIn copies src into the committed memory of r at off. Writing through a
// read-only mapping (shared read-only, or protected) fails with ErrSharedReadOnly,
// which matches backing.ErrReadOnly, rather than fault.
func (s *Shared) CopyIn(r *SharedReservation, off int, src []byte) error {
	s.mu.Lock()
	err := s.span("copy in", r, off, len(src), true)
	s.mu.Unlock()
	if err != nil || len(src) == 0 {
		return err
	}
	copy(sharedBytes(sharedAt(r.base, off), len(src)), src)
	return nil
}

// CopyOut copies the committed memory of r at off into dst.
func (s *Shared) CopyOut(dst []byte, r *SharedReservation, off int) error {
	s.mu.Lock()
	err := s.span("copy out", r, off, len(dst), false)
	s.mu.Unlock()
	if err != nil || len(dst) == 0 {
		return err
	}
	copy(dst, sharedBytes(sharedAt(r.base, off), len(dst)))
	return nil
}

// Close gives the memfd and every idle granule back to the OS and releases their
// bytes from the authority. Every reservation must have been unreserved first;
// otherwise Close returns an error wrapping ErrSharedInUse and changes nothing.
// Granules still mapped by Quarantined reservations stay owned, mapped and charged:
// they are still held. Any use of s after Close panics with PanicSharedClosed, except
// PoolStats and the constant accessors.
func (s *Shared) Close() error {
	s.mu.Lock()
	s.open()
	if s.live > 0 {
		n := s.live
		s.mu.Unlock()
		return fmt.Errorf("%w: %d to unreserve first", ErrSharedInUse, n)
	}
	s.closed = true
	s.mu.Unlock()
	s.auth.SetReclaimer(nil)
	s.refill.Wait()

	s.mu.Lock()
	gone, err := s.releasePark()
	stranded := !gone
	for i := range s.slots {
		if s.slots[i].refs > 0 {
			stranded = true
			break
		}
	}
	if stranded {
		// The quarantined mappings (or the park, if it could not be unmapped) keep
		// the file alive, and with it every page in it: punch the idle ones out
		// explicitly.
		victims := s.victims(s.nIdle)
		s.mu.Unlock()
		_, gerr := s.giveBack(victims)
		err = errors.Join(err, gerr)
		s.mu.Lock()
	}
	if !stranded {
		// Closing the last reference to the file frees all its pages at once.
		var idle int64
		for i := s.idle.next(0, len(s.slots)); i < len(s.slots); i = s.idle.next(i+1, len(s.slots)) {
			s.idle.clear(i)
			s.free.set(i)
			s.slots[i] = sharedSlot{}
			idle += int64(s.g)
		}
		s.nIdle, s.nResident = 0, 0
		if idle > 0 {
			s.owned -= idle
			s.auth.Release(idle)
		}
	}
	if cerr := s.sys.closeFd(s.fd); cerr != nil {
		err = errors.Join(err, fmt.Errorf("host: close memfd: %w", cerr))
	}
	s.fd = -1
	s.mu.Unlock()
	return err
}
