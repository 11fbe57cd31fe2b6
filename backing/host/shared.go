package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"
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
	// 64 KiB. On Windows it must be at least 64 KiB, the allocation granularity
	// (each granule is a section view of its own).
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
	// "vmarena". Windows sections have no name.
	Name string
	// Decay is how long an idle granule may stay unused before the pool gives it
	// back to the OS: idle granules above Low leave gradually, the longest idle
	// first, all of them by Decay after the load stops (see Shared). 0 means 5 s;
	// SharedNoDecay (any negative value) keeps idle granules up to High for good.
	Decay time.Duration
	// NoHugePages turns huge pages off: every granule is a memfd granule of small
	// pages. Otherwise, with granules a multiple of the huge page (2 MiB on x86-64),
	// the backing takes the fastest new memory the system allows (see Shared):
	// memfd huge pages where shmem_enabled allows them, else anonymous huge pages for
	// the granules a reservation commits for itself. SharedStats says which, and why.
	NoHugePages bool
	// AlwaysHugePages asks for huge pages also on a virtual machine that reports its
	// free memory to the host in huge-page blocks, where a fresh huge page costs more
	// than small pages (SharedStats.NoHugePages says so when it applies); a pool that
	// keeps its granules (a large High, a long Decay) may still want them there.
	AlwaysHugePages bool
	// Logger receives the pool's events: trims and reclaims that give granules back
	// (Info), decay passes that do (Debug), and, at construction, a fallback the
	// system forces (no MADV_POPULATE_WRITE, or small pages where the granule would
	// take huge pages). nil logs nothing. Quarantines are logged by the governor (see
	// accounting.GovernorOptions).
	Logger *slog.Logger
}

// SharedNoPool as SharedOptions.High keeps no idle granule: every granule goes back
// to the OS when its last mapping goes.
const SharedNoPool = -1

// SharedNoDecay as SharedOptions.Decay turns decay off: idle granules stay until the
// High water mark, Trim or a waiter takes them.
const SharedNoDecay = -1

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
// # New granules and huge pages
//
// A new granule costs its page population: about 0.3 ms per 2 MiB of 4 KiB shmem
// pages (fallocate and populate), 0.06 ms as one anonymous transparent huge page.
// So, unless SharedOptions.NoHugePages is set and when the granule is a multiple of
// the huge page:
//
//   - where shmem huge pages are allowed (/sys/kernel/mm/transparent_hugepage/
//     shmem_enabled is always, within_size, advise or force), the park and every
//     mapping of the memfd ask for them (MADV_HUGEPAGE), and granules are memfd
//     granules as above;
//   - else, where anonymous huge pages are allowed (.../enabled is always or
//     madvise), a commit that must create granules makes them private: anonymous
//     memory of that reservation alone (mprotect read-write, MADV_HUGEPAGE), owned
//     and charged like any granule, mapped once, never pooled (a decommit gives it
//     back to the OS at once, which costs a few µs for a huge page). Only a granule
//     that becomes shared moves into the memfd: Share from a private granule first
//     copies it into a memfd granule (an idle one when the pool has one) and moves
//     that over the same address (mremap), so that the source keeps its base and
//     its contents and the granule is owned once, whatever maps it;
//   - else granules are memfd granules of small pages.
//
// A virtual machine that reports its free memory to the host in huge-page blocks
// gets small pages unless SharedOptions.AlwaysHugePages is set: there a fresh huge
// page takes host faults (see BENCHMARKS.md). SharedStats says which of these the
// backing does and, where it falls back, why.
//
// A commit takes idle slots first and creates new ones (Free to Live, or private)
// only for the rest, charging the authority for all of them at once before anything is touched. It
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
// The pool gives idle granules back to the OS (fallocate PUNCH_HOLE; a private one
// by mapping reserved memory over its place in the private park) by decay: those
// above Low leave gradually once unused, all of them within SharedOptions.Decay
// (5 s by default) after the load stops, while a busy pool keeps its working set
// (see shared_decay.go). It also gives them back above the High water mark, on Trim,
// and, while another owner's request waits for host memory, at once as they go idle,
// so that memory kept for this pool's future commits is not held against a caller
// that needs it now; each time such a request starts to wait, the pool's reclaimer
// (see accounting.Authority.SetReclaimer) gives back every granule already idle.
// While only this pool's own commits wait (CommitCtx), granules that go idle are
// handed to them instead, in the order they came, rather than given to the OS to be
// made again. A granule that can not be given back (the punch fails) stays idle and
// owned; the next Trim tries again.
//
// Pooled granules keep their old contents: CommitZeroes is false, and a recommitted
// or shared range reads whatever was last written there. Granules new to the file
// read as zero.
//
// Bookkeeping costs 8 bytes per reserved granule and a few bytes per slot of the
// file, which only grows (sparse: holes cost nothing). The park costs address space,
// not memory: its chunks double from 1 GiB, so it spans at most twice the file; the
// private park, High granules of address space.
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
	huge     sharedHuge
	hugeWhy  string // why huge is not what the user would want, or ""
	sys      sharedSys
	log      *slog.Logger // nil logs nothing

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
	created   int64 // granules ever charged (PoolStats.Created)
	live      int   // reservations not yet unreserved (Quarantined ones excluded)
	resv      map[*SharedReservation]struct{}
	park      []sharedChunk  // see shared_park.go
	park0     int            // slots in the park's first chunk
	nPriv     int            // private granules (see Shared)
	apark     unsafe.Pointer // the private park (shared_priv.go): High granules
	aparkRaw  unsafe.Pointer
	aparkN    int
	aused     sharedBits // positions of the private park that hold a granule
	aidle     sharedBits // ... that hold an idle one (not taken by a commit)
	asince    []int64    // per position, when its granule went idle (clock, ns)
	nPrivIdle int
	clock     func() time.Time
	decay     time.Duration   // 0: off
	decaying  bool            // the scavenger runs
	stop      chan struct{}   // closed by Close
	waitq     []*sharedWaiter // this pool's commits waiting for the budget, first first
	scav      sync.WaitGroup
	adopted   int64        // private granules moved into the memfd by Share
	refused   int64        // MADV_HUGEPAGE calls the kernel refused
	stray     []sharedSpan // address space a failed step could not give back
	refilling bool
	refill    sync.WaitGroup
}

// sharedSlot is one granule-sized offset of the memfd.
type sharedSlot struct {
	refs     int32 // mappings; >0 means Live
	busy     bool  // owned and in flight: being created, populated or given back
	resident bool  // its pages are known to exist
	since    int64 // when it went idle (clock, ns)
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
	at     uint32 // slot+1; 0 means Reserved or private
	ro     bool   // mapped read-only (shared so, or protected)
	shared bool   // shared read-only into the reservation: Protect never makes it writable
	priv   bool   // a private granule: anonymous memory of this reservation alone
}

func (m sharedMap) slot() int { return int(m.at) - 1 }

// committed reports whether the granule is Committed (a slot or private).
func (m sharedMap) committed() bool { return m.at != 0 || m.priv }

// sharedHuge is how a Shared backing gets huge pages.
type sharedHuge uint8

const (
	sharedSmall     sharedHuge = iota // memfd granules of small pages
	sharedShmemHuge                   // memfd granules that ask for huge pages
	sharedPrivHuge                    // new granules private, in anonymous huge pages
)

// SharedStats describes how a Shared backing gets its memory.
type SharedStats struct {
	// HugePages is "shmem" when memfd granules ask for huge pages, "private" when
	// new granules are private anonymous huge pages (only shared ones are memfd
	// granules), or "" when every granule is a memfd granule of small pages; then
	// NoHugePages says why (the option, the granule, the system's modes).
	HugePages   string
	NoHugePages string
	// Private is the bytes of private granules: committed, owned and mapped once,
	// never pooled. They are part of the pool's Owned and Mapped.
	Private int64
	// Adopted counts the private granules that Share moved into the memfd.
	Adopted int64
	// HugeRefused counts the MADV_HUGEPAGE calls the kernel refused (the memory
	// then has small pages).
	HugeRefused int64
}

// sharedNoCopy makes go vet report copies of a Shared.
type sharedNoCopy struct{}

func (*sharedNoCopy) Lock()   {}
func (*sharedNoCopy) Unlock() {}

// sharedSys is the syscall seam: every system call of the shared backing goes
// through one of these, so that tests can make the n-th one fail.
type sharedSys struct {
	memfd    func(name string) (int, error)                               // memfd_create, close-on-exec
	granule  func(fd, g int)                                              // tells the file its granule size (Windows); nil where it needs none
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
	advise   func(at unsafe.Pointer, n int) error                         // MADV_HUGEPAGE
	discard  func(at unsafe.Pointer, n int) error                         // MADV_DONTNEED + mprotect PROT_NONE (private granules)
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
// system has no memfd (Linux) or no placeholders (Windows 10 1803 and later) it
// returns an error wrapping errors.ErrUnsupported; bad options yield an error
// wrapping ErrSharedOptions.
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
	if opts.Decay == 0 {
		opts.Decay = sharedDefaultDecay
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
	case g < sharedMinGranularity:
		return nil, bad("granularity %d is below the system's %d-byte allocation granularity", g, sharedMinGranularity)
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
	huge, why := sharedHugeMode(opts)
	fd, err := sys.memfd(opts.Name)
	if err != nil {
		return nil, fmt.Errorf("host: %s %q: %w", sharedCreateCall, opts.Name, err)
	}
	if sys.granule != nil {
		sys.granule(fd, opts.Granularity)
	}
	s := &Shared{
		g:        opts.Granularity,
		shift:    backing.Log2(opts.Granularity),
		auth:     opts.Authority,
		low:      opts.Low,
		high:     high,
		populate: opts.Populate,
		huge:     huge,
		hugeWhy:  why,
		clock:    time.Now,
		decay:    max(opts.Decay, 0),
		stop:     make(chan struct{}),
		sys:      sys,
		log:      opts.Logger,
		fd:       fd,
		resv:     make(map[*SharedReservation]struct{}),
		park0:    max(sharedParkFirst>>backing.Log2(opts.Granularity), 1),
	}
	s.mu.Lock()
	s.kick()
	s.mu.Unlock()
	opts.Authority.SetReclaimer(s.reclaim)
	noHuge := s.hugeWhy
	if opts.NoHugePages {
		noHuge = "" // the caller's choice, not a fallback
	}
	noteFallbacks(s.log, "shared", s.populate || s.low > 0, s.g, noHuge) // the refill populates too
	return s, nil
}

// sharedHugeMode picks how a backing with opts gets huge pages, and says why not.
func sharedHugeMode(opts SharedOptions) (sharedHuge, string) {
	if opts.NoHugePages {
		return sharedSmall, "turned off by SharedOptions.NoHugePages"
	}
	shmem, anon := hugeShmem(), hugeAnon()
	switch {
	case (shmem.why == "" || anon.why == "") && opts.Granularity%anon.pmd == 0 &&
		!opts.AlwaysHugePages && hugeReporting() != "":
		return sharedSmall, hugeReporting()
	case shmem.why == "" && opts.Granularity%shmem.pmd == 0:
		return sharedShmemHuge, ""
	case anon.why == "" && opts.Granularity%anon.pmd == 0:
		return sharedPrivHuge, ""
	case shmem.why == "" || anon.why == "":
		return sharedSmall, fmt.Sprintf("the %d-byte granule is not a multiple of the %d-byte huge page", opts.Granularity, anon.pmd)
	}
	return sharedSmall, shmem.why + " and " + anon.why
}

// Stats describes how the backing gets its memory; see SharedStats. It may be
// called after Close.
func (s *Shared) Stats() SharedStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := SharedStats{NoHugePages: s.hugeWhy, Private: int64(s.nPriv) << s.shift, Adopted: s.adopted, HugeRefused: s.refused}
	switch s.huge {
	case sharedShmemHuge:
		st.HugePages = "shmem"
	case sharedPrivHuge:
		st.HugePages = "private"
	}
	return st
}

// HugePages returns how many bytes of r's committed memory the kernel really backs
// with huge pages, from /proc/self/smaps: private granules in AnonHugePages, memfd
// granules in ShmemPmdMapped. It costs about a millisecond per thousand mappings of
// the process: it is for metrics and tests, not the token path.
func (s *Shared) HugePages(r *SharedReservation) (HugePageBytes, error) {
	s.mu.Lock()
	if err := s.use("huge pages", r); err != nil {
		s.mu.Unlock()
		return HugePageBytes{}, err
	}
	base, size := uintptr(r.base), r.size
	s.mu.Unlock()
	if size == 0 {
		return HugePageBytes{}, nil
	}
	return hugeBytes(base, base+uintptr(size))
}

// advise asks for huge pages on [at, at+n); a refusal is counted, not an error: the
// memory works with small pages. s.mu must be held.
func (s *Shared) advise(at unsafe.Pointer, n int) {
	if err := s.sys.advise(at, n); err != nil {
		s.refused++
	}
}

// adviseFile asks for huge pages on a new mapping of the memfd at [at, at+n) when
// the backing gets shmem huge pages. (A mapping moved from the park keeps the
// park's advice.) s.mu must be held.
func (s *Shared) adviseFile(at unsafe.Pointer, n int) {
	if s.huge == sharedShmemHuge {
		s.advise(at, n)
	}
}

// reclaim gives every idle granule back when a request on the device waits for
// memory (the governor calls it): idle granules hold budget that the waiter, perhaps
// another pool's user, can not otherwise have.
func (s *Shared) reclaim(need int64) {
	s.mu.Lock()
	if s.closed || !s.othersWait() {
		s.mu.Unlock() // only this pool's commits wait: they take the idle granules
		return
	}
	// Close waits for this like for a refill, so the memfd outlives the give-back.
	s.refill.Add(1)
	m, _ := s.givePriv(s.takePrivIdle(s.nPrivIdle))
	victims := s.victims(s.nIdle)
	s.mu.Unlock()
	defer s.refill.Done()
	n, err := s.giveBack(victims)
	n += m
	if s.log != nil && (n > 0 || err != nil) {
		s.log.Info("host: pool reclaim", "gave_back_bytes", n, "waiter_bytes", need, "err", err)
	}
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
		// NB: where granules may be private, a guard page on either side, so that
		// a private granule at an end never merges with a neighbouring mapping
		// (smaps and the mapping count would blur them).
		align, pad := sharedAlignment(s.g)
		guard := 0
		if s.huge == sharedPrivHuge {
			guard = os.Getpagesize()
		}
		raw, err := s.sys.reserve(size + pad + 2*guard)
		if err != nil {
			return nil, s.opErr("reserve", 0, size, err, true)
		}
		r.raw, r.rawN = raw, size+pad+2*guard
		r.base = sharedAlign(sharedAt(raw, guard), align)
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
		if r.maps[i].committed() != committed {
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
// granules it would have taken stay in the pool, and it waits for the bytes of the
// whole range, so that waiting commits can not hold pieces each of them needs. A
// granule that goes idle meanwhile is handed to the waiting commits of this pool
// (they try again with it) rather than given to the OS and made again; only when
// another owner's request waits too do idle granules go back to the OS at once. When
// ctx ends first it returns ctx.Err() (wrapped) and the range is as it was.
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
	priv := 0 // private granules to create, after the pooled ones
	if gi > 0 && r.maps[gi-1].at != 0 {
		hint = r.maps[gi-1].slot() + 1 // continue the file run of the granule before
	}
	// Idle private granules first (only a backing that makes them has any), then
	// idle memfd granules, then new ones.
	var pos []int
	if s.nPrivIdle > 0 {
		pos = s.takePrivIdle(min(n, s.nPrivIdle))
	}
	picks := s.pickIdle(min(n-len(pos), s.nIdle), hint)
	if len(pos)+len(picks) < n {
		var fresh int
		var err error
		if picks, fresh, err = s.charge(ctx, op, r, off, size, n, picks, &pos, wait); err != nil {
			return err
		}
		if s.huge == sharedPrivHuge {
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
			if err := s.allocateNew(op, r, off, size, picks, more); err != nil {
				return err
			}
		}
	}
	if len(pos) > 0 {
		return s.commitPriv(op, r, gi, n, picks, pos, priv)
	}
	slots := make([]int, len(picks))
	for k, p := range picks {
		slots[k] = p.slot
	}
	if done, err := s.place(r, gi, slots); err != nil {
		s.releasePriv(priv)
		return s.undoMap(op, r, off, size, picks, done, err)
	}
	if priv > 0 {
		at := r.at(gi + len(picks))
		if err := s.sys.protect(at, priv<<s.shift, false); err != nil {
			s.releasePriv(priv)
			return s.undoMap(op, r, off, size, picks, len(picks), err)
		}
		s.advise(at, priv<<s.shift)
	}
	s.record(r, gi, picks, false)
	s.recordPriv(r, gi+len(picks), priv)
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

// recordPriv marks granules [gi, gi+n) of r as private (their bytes are charged) and
// attributes their mapping. s.mu must be held.
func (s *Shared) recordPriv(r *SharedReservation, gi, n int) {
	for i := gi; i < gi+n; i++ {
		r.maps[i] = sharedMap{priv: true}
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
	give := s.drop(r, gi, n)
	s.mu.Unlock()
	_, gerr := s.giveBack(give)
	return s.stayIdle(err, gerr)
}

// charge takes the bytes of fresh new granules for a commit of n granules that
// holds the idle picks and the idle private granules at *pos: at once, or, when
// wait is true and the budget refuses, in FIFO order with the device's other
// waiters until ctx ends. It returns the idle picks the commit keeps and how many
// granules it must create (and may change *pos). s.mu must be held; on error it is
// released and nothing is held.
//
// NB: a commit holds nothing while it waits. Holding its idle granules while waiting
// for the rest would let commits that each hold some wait for each other forever; so
// it puts them back in the pool and waits for all n granules at once. While only
// this pool's commits wait, granules that go idle stay in the pool (see drop) and
// wake the waiters, which try again with them: idle granules are handed to the
// waiting commits, not first given to the OS to be made again.
func (s *Shared) charge(ctx context.Context, op string, r *SharedReservation, off, size, n int, picks []sharedPick, pos *[]int, wait bool) ([]sharedPick, int, error) {
	fresh := n - len(picks) - len(*pos)
	err := s.auth.TryAcquire(int64(fresh) << s.shift)
	if err == nil {
		s.owned += int64(fresh) << s.shift
		s.created += int64(fresh)
		return picks, fresh, nil
	}
	if !wait || !accounting.CanWait(err) {
		s.unpick(picks)
		s.untakePrivIdle(*pos)
		*pos = nil
		s.mu.Unlock()
		return nil, 0, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	bytes := int64(n) << s.shift
	w := &sharedWaiter{wake: make(chan struct{})}
	s.waitq = append(s.waitq, w)
	for {
		s.unpick(picks)
		s.untakePrivIdle(*pos)
		*pos = nil
		w.reset() // what it put back woke nobody but itself
		wake := w.wake
		s.mu.Unlock()
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			select {
			case <-wake:
				cancel()
			case <-done:
			}
		}()
		err := s.auth.Acquire(wctx, bytes)
		close(done)
		cancel()
		s.mu.Lock()
		if r.state != sharedLive {
			s.unwait(w)
			if err == nil {
				s.auth.Release(bytes)
			}
			s.mu.Unlock()
			panic(backing.PanicUseAfterUnreserve)
		}
		if err == nil {
			s.unwait(w)
			s.owned += bytes
			s.created += int64(n)
			return nil, n, nil
		}
		if !w.signaled || ctx.Err() != nil {
			s.unwait(w)
			s.mu.Unlock()
			if ctx.Err() != nil {
				err = fmt.Errorf("%w", ctx.Err()) // NB: not wctx's: the caller's ctx ended
			}
			return nil, 0, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
		}
		// Granules went idle: take them, and what the budget gives for the rest.
		if s.nPrivIdle > 0 {
			*pos = s.takePrivIdle(min(n, s.nPrivIdle))
		}
		picks = s.pickIdle(min(n-len(*pos), s.nIdle), -1)
		fresh = n - len(picks) - len(*pos)
		// NB: not TryAcquire(0), which the governor refuses while anyone waits.
		if fresh == 0 || s.auth.TryAcquire(int64(fresh)<<s.shift) == nil {
			s.unwait(w)
			s.owned += int64(fresh) << s.shift
			s.created += int64(fresh)
			return picks, fresh, nil
		}
		// Not enough yet: wait again, first in line still.
	}
}

// sharedWaiter is a commit of this pool that waits for the budget.
type sharedWaiter struct {
	wake     chan struct{} // closed by signal
	signaled bool
}

// reset makes w wait for the next signal.
func (w *sharedWaiter) reset() {
	if w.signaled {
		w.wake, w.signaled = make(chan struct{}), false
	}
}

// signal wakes the first of this pool's commits that wait for the budget, in the
// order they came: a granule went idle that it can take. (Waking them all would let
// a later one take what the first needs.) s.mu must be held.
func (s *Shared) signal() {
	if len(s.waitq) > 0 && !s.waitq[0].signaled {
		s.waitq[0].signaled = true
		close(s.waitq[0].wake)
	}
}

// unwait takes w out of the line of waiting commits; if idle granules remain, the
// next in line is woken for them. s.mu must be held.
func (s *Shared) unwait(w *sharedWaiter) {
	if i := slices.Index(s.waitq, w); i >= 0 {
		s.waitq = slices.Delete(s.waitq, i, i+1)
	}
	if s.nIdle+s.nPrivIdle > 0 {
		s.signal()
	}
}

// othersWait reports whether requests other than this pool's own waiting commits
// wait for host memory: only then do idle granules go back to the OS at once, since
// only through the OS can another owner have their bytes. s.mu must be held.
func (s *Shared) othersWait() bool {
	return s.auth.Governor().Stats(s.auth.Device()).Waiters > len(s.waitq)
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
	if !s.populate && !sharedMapAllocates {
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
	parked := s.parkPriv(r, off>>s.shift, size>>s.shift)
	// A range of private granules only (or their empty places, parked) keeps its
	// mapping: freeing the pages in place costs a third less than a new mapping,
	// whose first fault must set up its anonymous memory again.
	unmap := s.sys.unmapTo
	if !slices.ContainsFunc(r.maps[off>>s.shift:(off+size)>>s.shift], func(m sharedMap) bool { return m.at != 0 }) {
		unmap = s.sys.discard
	}
	if err := unmap(sharedAt(r.base, off), size); err != nil {
		err = s.opErr("decommit", off, size, err, true)
		if uerr := s.unpark(r, parked); uerr != nil {
			err = fmt.Errorf("%w; and undoing the park failed: %w", err, uerr)
		}
		s.mu.Unlock()
		return err
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
	s.parkPriv(r, 0, n)
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
		if !r.maps[i].committed() {
			i++
			continue
		}
		j := i + 1
		for j < n && r.maps[j].committed() {
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
	s.auth.Quarantine(held-unmapped, err)
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
	var runs []sharedAdoption // undone if the Share fails
	for {
		s.mu.Lock()
		if err := s.use(op, dst); err != nil {
			return s.undoAdopt(op, src, runs, err)
		}
		if err := s.use(op, src); err != nil {
			return s.undoAdopt(op, src, runs, err)
		}
		if err := s.checkShare(op, dst, dstOff, src, srcOff, size, prot); err != nil {
			return s.undoAdopt(op, src, runs, err)
		}
		// Private granules move into the memfd first, one run at a time.
		i, j := srcOff>>s.shift, (srcOff+size)>>s.shift
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
		a, err := s.adopt(op, src, i, k)
		runs = append(runs, a)
		if err != nil {
			s.mu.Lock()
			return s.undoAdopt(op, src, runs, err)
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
	return s.undoAdopt(op, src, runs, err)
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
	return dst.want(op, dstOff, size, false)
}

// adopt moves the private granules [i, j) of r into the memfd: it copies each into
// a memfd granule (an idle one where the pool has one, else a new one, allocated and
// populated in the park), then moves those over the same addresses of r (mremap,
// see the park), so that r keeps its base and its contents and the private pages go
// back to the OS. While both exist the new granules are charged too, so a busy
// budget may refuse the Share; the private granules' bytes are released once
// they are gone. It returns what moved, which unadopt undoes: on error, the
// granules that moved before it (the rest of [i, j) is as it was). s.mu must be
// held; it is released.
func (s *Shared) adopt(op string, r *SharedReservation, i, j int) (sharedAdoption, error) {
	k := j - i
	off, size := i<<s.shift, k<<s.shift
	picks := s.pickIdle(min(k, s.nIdle), -1)
	if fresh := k - len(picks); fresh > 0 {
		b := int64(fresh) << s.shift
		if err := s.auth.TryAcquire(b); err != nil {
			s.unpick(picks)
			s.mu.Unlock()
			return sharedAdoption{}, &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
		}
		s.owned += b
		s.created += int64(fresh)
		more, err := s.pickFresh(fresh, -1)
		if err != nil {
			s.unpick(picks)
			s.owned -= b
			s.auth.Release(b)
			s.mu.Unlock()
			return sharedAdoption{}, s.opErr(op, off, size, err, true)
		}
		picks = append(picks, more...)
	}
	slices.SortFunc(picks, func(a, b sharedPick) int { return a.slot - b.slot })
	ro := make([]bool, k) // protected (Protect): the memfd granule must be too
	for n := range ro {
		ro[n] = r.maps[i+n].ro
	}
	at := make([]unsafe.Pointer, k)
	ready := make([]bool, k)
	for n, p := range picks {
		at[n] = s.parkAt(p.slot)
		ready[n] = s.slots[p.slot].resident
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
	live := r.state == sharedLive
	s.mu.Unlock()
	_, gerr := s.giveBack(give)
	if !live {
		panic(backing.PanicUseAfterUnreserve) // r was unreserved meanwhile
	}
	moved := sharedAdoption{i: i, picks: picks[:done], ro: ro[:done]}
	if err != nil {
		return moved, s.stayIdle(err, gerr)
	}
	return moved, nil
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
	close(s.stop)
	s.mu.Unlock()
	s.auth.SetReclaimer(nil)
	s.refill.Wait()
	s.scav.Wait()

	s.mu.Lock()
	_, err := s.givePriv(s.takePrivIdle(s.nPrivIdle))
	if s.apark != nil {
		s.stray = append(s.stray, sharedSpan{s.aparkRaw, s.aparkN})
		s.apark = nil
	}
	gone, perr := s.releasePark()
	err = errors.Join(err, perr)
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
