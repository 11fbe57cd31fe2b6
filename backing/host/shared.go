package host

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/causes"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// SharedOptions configures a [Shared] backing. Only Authority is required.
type SharedOptions struct {
	// Granularity is the granule size in bytes: a power of two and a multiple of the
	// page size. 0 means 2 MiB, or the granule ShareUnit picks (see there). Every memfd granule mapped at a scattered file offset
	// costs one kernel mapping (vm.max_map_count), so small granules bound the
	// process's shared memory early: 64k mappings are 128 GiB at 2 MiB, 4 GiB at
	// 64 KiB. On Windows it must be at least 64 KiB, the allocation granularity
	// (each granule is a section view of its own).
	Granularity int
	// ShareUnit, when Granularity is 0, is the bytes the caller maps and shares in
	// (a KV cache: one token of every layer of a group, kv's Group.BytesPerToken): the
	// default granule is then the largest power of two from 64 KiB to 2 MiB that holds
	// at most 64 of them, so that what is shared is not carved coarser than that (a
	// model of 2 KiB tokens gets 128 KiB granules; one of 128 KiB tokens keeps
	// 2 MiB). A smaller granule costs more per byte to commit (a mapping per granule;
	// docs/benchmarks/sizing.md) and gives up huge pages. It must not be negative.
	//
	// With neither Granularity nor ShareUnit (nor Low, whose refill at start makes
	// granules), the granule is left to the backing's first user: a kv cache made on
	// it (kv.New) passes its model's unit (ChooseGranule), so a caller need not. The
	// first of ChooseGranule, Granularity, Reserve, Prefill, Trim, PoolStats and Stats
	// fixes it, to 2 MiB where no unit was given.
	ShareUnit int
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
	// the page tables they went in with (see shared_park.go).
	Populate bool
	// Name is the memfd's name, shown in /proc/self/maps as /memfd:Name. "" means
	// "vmarena". Windows sections have no name.
	Name string
	// Decay is how long an idle granule may stay unused before the pool gives it
	// back to the OS: idle granules above Low leave gradually, the longest idle
	// first, all of them by Decay after the load stops (see shared_decay.go). 0 means 5 s;
	// SharedNoDecay (any negative value) keeps idle granules up to High for good.
	Decay time.Duration
	// NoHugePages turns huge pages off: granules take small pages. Otherwise, with
	// granules a multiple of the huge page (2 MiB on x86-64), the backing takes the
	// fastest new memory the system allows (see shared_priv.go): memfd
	// huge pages where shmem_enabled allows them, else anonymous huge pages for the
	// granules a reservation commits for itself. SharedStats says which, and why.
	NoHugePages bool
	// NoPrivateGranules makes every granule a memfd granule from the start, as on
	// Windows. Otherwise (on Linux, unless memfd huge pages are used) a granule a
	// reservation commits for itself is private anonymous memory, small pages or
	// huge, and moves into the memfd only when Share shares it, at the cost of a
	// copy (see shared_priv.go). A workload that shares most of what it
	// commits (every sequence forked or frozen soon after it is written) pays that
	// copy on most granules and may want memfd granules from the start; so may a
	// process short of mappings (vm.max_map_count), since a new memfd granule
	// placed after its predecessor merges with it and a private one out of the
	// pool does not.
	NoPrivateGranules bool
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

// sharedDefaultGranule returns the default granule for a caller that shares in units
// of unit bytes (0: none given): the largest power of two from sharedMinShareGranule
// to sharedDefaultGranularity that holds at most sharedMaxShareUnits units.
func sharedDefaultGranule(unit int) int {
	g := sharedDefaultGranularity
	for unit > 0 && g > sharedMinShareGranule && g/unit > sharedMaxShareUnits {
		g /= 2
	}
	return g
}

const (
	// sharedMinShareGranule and sharedMaxShareUnits bound the default granule for
	// SharedOptions.ShareUnit: 64 KiB, Windows' allocation granularity, and 64 units.
	sharedMinShareGranule = 64 << 10
	sharedMaxShareUnits   = 64
)

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
// (mremap), or maps them (mmap MAP_SHARED|MAP_FIXED). Share maps the slots behind
// one reservation's range into another's, so that one physical granule may back any
// number of ranges. Each slot counts its mappings and goes back to the pool with its
// last one. Protect makes a reservation's committed granules read-only, or writable
// again, in place (mprotect).
//
// A slot is Free, Idle or Live (shared_pool.go); idle granules wait in the park
// (shared_park.go), and new ones may be private huge pages (shared_priv.go). A Shared
// is safe for concurrent use; Close must not run concurrently with any other call.
// Its bookkeeping is under one mutex, held across mmap and mremap (which the kernel
// serializes per process anyway) but not across page population or fallocate, which
// run outside it on slots marked busy. It costs 12 bytes per reserved granule and a
// few bytes per slot of the file, which only grows (sparse: holes cost nothing).
type Shared struct {
	_ nocopy.NoCopy

	g     int // granule size
	shift int // log2(g)
	// open is set while the granule may still be chosen (ChooseGranule): g,
	// shift and what depends on them change only under mu while it is set, and
	// it is cleared after they are final.
	open     atomic.Bool
	opts     SharedOptions // as given, for a granule chosen later
	auth     *accounting.Authority
	low      int
	high     int // 0 when SharedNoPool
	populate bool
	huge     sharedHuge
	hugeWhy  string // why huge is not what the user would want, or ""
	privWhy  string // why new granules are not private, or ""
	smallTHP bool   // private small granules must refuse huge pages (MADV_NOHUGEPAGE)
	sys      sharedSys
	log      *slog.Logger // nil logs nothing

	mu        sync.Mutex
	fd        int
	closed    bool
	slots     []sharedSlot
	idle      bitset // Idle slots (not busy)
	free      bitset // Free slots
	nIdle     int
	nResident int   // Idle slots that are resident
	owned     int64 // bytes of Idle, Live and busy owned slots; in step with the authority
	mapped    int64 // bytes of mappings; in step with the authority
	created   int64 // granules ever charged (PoolStats.Created)
	live      int   // reservations not yet unreserved (Quarantined ones excluded)
	resv      map[*SharedReservation]struct{}
	park      []sharedChunk  // see shared_park.go
	park0     int            // slots in the park's first chunk
	nPriv     int            // private granules (see shared_priv.go)
	apark     unsafe.Pointer // the private park (shared_priv.go): High granules
	aparkRaw  unsafe.Pointer
	aparkN    int
	aused     bitset          // positions of the private park that hold a granule
	aidle     bitset          // ... that hold an idle one (not taken by a commit)
	ares      bitset          // ... whose granule's pages are known to exist (where aidle)
	asince    []time.Duration // per position, when its granule went idle (since epoch)
	nPrivIdle int
	clock     func() time.Time
	epoch     time.Time     // the clock at construction: idle times are clock().Sub(epoch)
	decay     time.Duration // 0: off
	decaying  bool          // the scavenger runs
	stop      chan struct{} // closed by Close
	scav      sync.WaitGroup
	adopted   int64        // private granules moved into the memfd by Share
	adoptDone sync.Cond    // on mu: an adoption ended (see sharedMap.adopting)
	refused   int64        // MADV_HUGEPAGE and MADV_NOHUGEPAGE calls the kernel refused
	stray     []sharedSpan // address space a failed step could not give back
	refilling bool
	refill    sync.WaitGroup

	// testAdoptWait, when a test sets it, runs (under mu) as a Share starts to wait
	// for another's adoption.
	testAdoptWait func()
}

// sharedSlot is one granule-sized offset of the memfd.
type sharedSlot struct {
	refs     int32         // mappings; >0 means Live
	busy     bool          // owned and in flight: being created, populated or given back
	resident bool          // its pages are known to exist
	since    time.Duration // when it went idle (since epoch)
}

// SharedReservation is a reserved address range of a Shared backing. It is a handle:
// the backing owns what it points to. Its zero value is not a reservation.
type SharedReservation struct {
	s    *Shared
	leak invariants.Tracker // reports it collected unclosed in the invariants build
	base unsafe.Pointer
	size int
	raw  unsafe.Pointer // as reserved, before alignment: what Unreserve unmaps
	rawN int

	// guarded by s.mu
	state sharedState
	maps  []sharedMap // per granule; 12 bytes of bookkeeping per reserved granule
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
	res    bool   // a private granule whose pages are known to exist (populated)
	// adopting marks a private granule that a Share is moving into the memfd while
	// it holds no lock: another Share of it waits (adoptDone) rather than adopt it
	// twice.
	adopting bool
}

func (m sharedMap) slot() int { return int(m.at) - 1 }

// committed reports whether the granule is Committed (a slot or private).
func (m sharedMap) committed() bool { return m.at != 0 || m.priv }

// sharedHuge is how a Shared backing gets new granules: memfd or private, huge
// pages or small.
type sharedHuge uint8

const (
	sharedSmall     sharedHuge = iota // memfd granules of small pages
	sharedShmemHuge                   // memfd granules that ask for huge pages
	sharedPrivHuge                    // new granules private, in anonymous huge pages
	sharedPrivSmall                   // new granules private, in anonymous small pages
)

// private reports whether the backing makes new granules private.
func (h sharedHuge) private() bool { return h == sharedPrivHuge || h == sharedPrivSmall }

// SharedStats describes how a Shared backing gets its memory.
type SharedStats struct {
	// HugePages is "shmem" when memfd granules ask for huge pages, "private" when
	// new granules are private anonymous huge pages (only shared ones are memfd
	// granules), or "" when granules take small pages; then NoHugePages says why
	// (the option, the granule, the system's modes, a guest that reports free
	// memory to its host).
	HugePages   string
	NoHugePages string
	// PrivateGranules reports whether new granules are private: anonymous memory
	// of the reservation that commits them (huge pages when HugePages is
	// "private", else small pages), moved into the memfd only when Share shares
	// them. When false every granule is a memfd granule from the start, and
	// NoPrivateGranules says why (the option, memfd huge pages, the system).
	PrivateGranules   bool
	NoPrivateGranules string
	// Private is the bytes of private granules: committed, owned and mapped once,
	// never pooled. They are part of the pool's Owned and Mapped.
	Private int64
	// Adopted counts the private granules that Share moved into the memfd.
	Adopted int64
	// HugeRefused counts the MADV_HUGEPAGE calls the kernel refused (the memory
	// then has small pages), and the MADV_NOHUGEPAGE calls it refused (see
	// shared_priv.go: the memory may then get huge pages).
	HugeRefused int64
}

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
	advise   func(at unsafe.Pointer, n int, huge bool) error              // MADV_HUGEPAGE, or MADV_NOHUGEPAGE
	discard  func(at unsafe.Pointer, n int) error                         // MADV_DONTNEED + mprotect PROT_NONE (private granules)
	mapCount func() (count, limit int, err error)                         // mappings of the process, vm.max_map_count
}

// errSharedSpan says that the kernel refused to move a range over several mappings
// (mremap before Linux 6.17, EFAULT) and moved nothing of it.
var errSharedSpan = errors.New("host: mremap of a range over several mappings")

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
	_ backing.GranuleChooser                = (*Shared)(nil)
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
	return newShared(opts, countedSys(sharedDefaultSys()))
}

func newShared(opts SharedOptions, sys sharedSys) (*Shared, error) {
	page := os.Getpagesize()
	if opts.ShareUnit < 0 {
		return nil, fmt.Errorf("%w: share unit %d is negative", ErrSharedOptions, opts.ShareUnit)
	}
	// NB: Low refills at start, in granules of the granule fixed here.
	open := opts.Granularity == 0 && opts.ShareUnit == 0 && opts.Low == 0
	if opts.Granularity == 0 {
		opts.Granularity = max(sharedDefaultGranule(opts.ShareUnit), page)
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
	huge, why, privWhy := sharedHugeMode(opts)
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
		privWhy:  privWhy,
		smallTHP: huge == sharedPrivSmall && hugeAnon().mode == "always",
		clock:    time.Now,
		epoch:    time.Now(),
		decay:    max(opts.Decay, 0),
		stop:     make(chan struct{}),
		sys:      sys,
		log:      opts.Logger,
		fd:       fd,
		resv:     make(map[*SharedReservation]struct{}),
		park0:    max(sharedParkFirst>>backing.Log2(opts.Granularity), 1),
	}
	s.adoptDone.L = &s.mu
	s.opts = opts
	s.mu.Lock()
	s.kick()
	s.mu.Unlock()
	opts.Authority.SetReclaimer(s.reclaim)
	if open {
		s.open.Store(true) // the fallbacks are noted when it is fixed
		return s, nil
	}
	s.noteFallbacks()
	return s, nil
}

// noteFallbacks logs what the system forces on the backing's granules (see
// SharedOptions.Logger).
func (s *Shared) noteFallbacks() {
	noHuge := s.hugeWhy
	if s.opts.NoHugePages {
		noHuge = "" // the caller's choice, not a fallback
	}
	noteFallbacks(s.log, "shared", s.populate || s.low > 0, s.g, noHuge) // the refill populates too
}

// sharedHugeMode picks how a backing with opts gets its new granules: memfd or
// private, huge pages or small. It says why not huge pages (noHuge) and why not
// private granules (noPriv); "" where they are used.
func sharedHugeMode(opts SharedOptions) (mode sharedHuge, noHuge, noPriv string) {
	return sharedHugeModeOf(opts, hugeShmem(), hugeAnon(), hugeReporting)
}

// sharedHugeModeOf is sharedHugeMode on a system whose modes are shmem and anon and
// whose guest reporting is reporting.
func sharedHugeModeOf(opts SharedOptions, shmem, anon hugeMode, reporting func() string) (mode sharedHuge, noHuge, noPriv string) {
	switch {
	case opts.NoPrivateGranules:
		noPriv = "turned off by SharedOptions.NoPrivateGranules"
	case !sharedPrivate:
		noPriv = "private granules need mremap (Linux)"
	}
	// NB: pmd is 0 where the system has no transparent huge pages (not Linux).
	fits := anon.pmd > 0 && opts.Granularity%anon.pmd == 0
	switch {
	case opts.NoHugePages:
		noHuge = "turned off by SharedOptions.NoHugePages"
	case (shmem.why == "" || anon.why == "") && fits && !opts.AlwaysHugePages && reporting() != "":
		noHuge = reporting()
	case shmem.why == "" && shmem.pmd > 0 && opts.Granularity%shmem.pmd == 0:
		if noPriv == "" {
			noPriv = "memfd granules get huge pages (shmem_enabled allows them)"
		}
		return sharedShmemHuge, "", noPriv
	case anon.why == "" && fits && noPriv == "":
		return sharedPrivHuge, "", ""
	case anon.why == "" && fits:
		noHuge = "anonymous huge pages need private granules (" + noPriv + ") and " + shmem.why
	case shmem.why == "" || anon.why == "":
		noHuge = fmt.Sprintf("the %d-byte granule is not a multiple of the %d-byte huge page", opts.Granularity, anon.pmd)
	default:
		noHuge = shmem.why + " and " + anon.why
	}
	if noPriv == "" {
		return sharedPrivSmall, noHuge, ""
	}
	return sharedSmall, noHuge, noPriv
}

// Stats describes how the backing gets its memory; see SharedStats. It may be
// called after Close.
func (s *Shared) Stats() SharedStats {
	s.fixGranule(0)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := SharedStats{NoHugePages: s.hugeWhy, PrivateGranules: s.huge.private(), NoPrivateGranules: s.privWhy,
		Private: int64(s.nPriv) << s.shift, Adopted: s.adopted, HugeRefused: s.refused}
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
	if err := s.lockUse("huge pages", r); err != nil {
		return HugePageBytes{}, err
	}
	base, size := uintptr(r.base), r.size
	s.mu.Unlock()
	if size == 0 {
		return HugePageBytes{}, nil
	}
	return hugeBytes(base, base+uintptr(size))
}

// advise asks for the pages the backing's private granules should have on new
// anonymous memory at [at, at+n): huge pages (MADV_HUGEPAGE) where it makes them
// in huge pages; small pages (MADV_NOHUGEPAGE) where it makes them in small pages
// and the system would give huge ones unasked (enabled is always); nothing else. A
// refusal is counted, not an error: the memory works either way. s.mu must be held.
func (s *Shared) advise(at unsafe.Pointer, n int) {
	var err error
	switch {
	case s.huge == sharedPrivHuge:
		err = s.sys.advise(at, n, true)
	case s.smallTHP:
		err = s.sys.advise(at, n, false)
	default:
		return
	}
	if err != nil {
		s.refused++
	}
}

// adviseFile asks for huge pages on a new mapping of the memfd at [at, at+n) when
// the backing gets shmem huge pages. (A mapping moved from the park keeps the
// park's advice.) s.mu must be held.
func (s *Shared) adviseFile(at unsafe.Pointer, n int) {
	if s.huge == sharedShmemHuge {
		if err := s.sys.advise(at, n, true); err != nil {
			s.refused++
		}
	}
}

// reclaim gives every idle granule back when a request on the device waits for
// memory (the governor calls it): idle granules hold budget that the waiter, perhaps
// another pool's user, can not otherwise have. s.mu must not be held.
func (s *Shared) reclaim(need int64) {
	s.mu.Lock()
	if s.closed || !s.auth.OthersWait() {
		s.mu.Unlock() // only this pool's requests wait: the idle granules serve them
		return
	}
	// Close waits for this like for a refill, so the memfd outlives the give-back.
	s.refill.Add(1)
	k := s.claim(s.nIdle + s.nPrivIdle)
	pos := s.takePrivIdle(min(k, s.nPrivIdle))
	m, _ := s.givePriv(pos)
	victims := s.victims(k - len(pos))
	s.mu.Unlock()
	defer s.refill.Done()
	n, err := s.giveBack(victims)
	n += m
	if s.log != nil && (n > 0 || err != nil) {
		s.log.Info("host: pool reclaim", "gave_back_bytes", n, "waiter_bytes", need, "err", err)
	}
}

// Granularity returns the granule size in bytes, fixing it if it was left open (see
// SharedOptions.ShareUnit).
func (s *Shared) Granularity() int {
	s.fixGranule(0)
	return s.g
}

// ChooseGranule fixes the granule, if the options left it open (see
// SharedOptions.ShareUnit), to the one ShareUnit unit picks, and returns the granule
// in force. unit must not be negative; 0 keeps 2 MiB.
func (s *Shared) ChooseGranule(unit int) int {
	if unit < 0 {
		panic(fmt.Sprintf("host: ChooseGranule of a %d-byte unit", unit))
	}
	s.fixGranule(unit)
	return s.g
}

// fixGranule fixes the granule if it is still open: to the one SharedOptions.ShareUnit
// unit picks (0: the default, already in place). Every entry point that reads the
// granule without a reservation of the backing calls it first (one with a
// reservation comes after Reserve's). s.mu must not be held.
func (s *Shared) fixGranule(unit int) {
	if !s.open.Load() {
		return
	}
	s.mu.Lock()
	if !s.open.Load() {
		s.mu.Unlock()
		return
	}
	if g := max(sharedDefaultGranule(unit), os.Getpagesize()); g != s.g {
		// Nothing is reserved and no granule made yet (Low is 0, and Reserve and
		// Prefill fix the granule first), so nothing depends on the old one.
		s.opts.Granularity = g
		s.g, s.shift = g, backing.Log2(g)
		s.huge, s.hugeWhy, s.privWhy = sharedHugeMode(s.opts)
		s.smallTHP = s.huge == sharedPrivSmall && hugeAnon().mode == "always"
		s.park0 = max(sharedParkFirst>>s.shift, 1)
		if s.sys.granule != nil {
			s.sys.granule(s.fd, g)
		}
	}
	s.open.Store(false)
	s.mu.Unlock()
	s.noteFallbacks()
}

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
// base is 2 MiB-aligned (see shared_park.go). The reservation MUST be given
// back with Unreserve.
func (s *Shared) Reserve(size int) (*SharedReservation, error) {
	s.fixGranule(0)
	if err := backing.CheckReserve(size, s.g); err != nil {
		return nil, err
	}
	s.lock()
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
		if s.huge.private() {
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
	invariants.Track(&r.leak, r, "host.SharedReservation")
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

// lock takes s.mu for a call on s, which must not be closed: when it is, lock
// releases s.mu again and panics with PanicSharedClosed. On return the caller holds
// s.mu.
func (s *Shared) lock() {
	causes.Lock(&s.mu, causes.WaitBacking)
	if s.closed {
		s.mu.Unlock()
		panic(PanicSharedClosed)
	}
	if invariants.Enabled {
		s.checkCountsLocked()
	}
}

// lockUse takes s.mu for a call of op on rs, which must be reservations of s: a
// foreign one is an error, an unreserved one panics with
// backing.PanicUseAfterUnreserve, each checked in turn. Either way lockUse releases
// s.mu again first. On a nil error the caller holds s.mu.
func (s *Shared) lockUse(op string, rs ...*SharedReservation) error {
	causes.Lock(&s.mu, causes.WaitBacking)
	if invariants.Enabled {
		s.checkCountsLocked()
	}
	for _, r := range rs {
		if r == nil || r.s != s {
			s.mu.Unlock()
			return &backing.OpError{Op: op, Kind: backing.ErrForeignReservation,
				Err: errors.New("host: not a reservation of this shared backing")}
		}
		if r.state != sharedLive {
			s.mu.Unlock()
			panic(backing.PanicUseAfterUnreserve)
		}
	}
	return nil
}

// lockRange takes s.mu for a range call of op on r (lockUse) and checks that the
// range lies in r and its granules are all committed or all reserved. On a nil error
// the caller holds s.mu; on an error lockRange released it.
func (s *Shared) lockRange(op string, r *SharedReservation, off, size int, committed bool) error {
	if err := s.lockUse(op, r); err != nil {
		return err
	}
	err := backing.CheckRange(op, off, size, r.size, s.g)
	if err == nil {
		err = r.want(op, off, size, committed)
	}
	if err != nil {
		s.mu.Unlock()
	}
	return err
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

// opErr wraps a failed system call of op. An ENOMEM from mmap is checked against the
// process's mapping limit, so that reaching vm.max_map_count says so.
func (s *Shared) opErr(op string, off, size int, err error, mmap bool) error {
	kind := error(nil)
	if sharedNoMemory(err) {
		kind = backing.ErrOutOfMemory
		if mmap {
			if n, limit, cerr := s.sys.mapCount(); cerr == nil && limit > 0 && n+sharedMapSlack >= limit {
				kind = backing.ErrMapLimit
				err = &mapLimitError{count: n, limit: limit, errno: err,
					cost: "memfd granules at scattered offsets need one mapping each"}
			}
		}
	}
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: err}
}

// sharedMapSlack is how close to vm.max_map_count the mapping count must be for an
// ENOMEM to be blamed on the limit: one MAP_FIXED may split a mapping in three, and
// other threads map concurrently.
const sharedMapSlack = 64

// Decommit moves [off, off+size) of r from Committed to Reserved by mapping fresh
// PROT_NONE anonymous memory over it (the range stays reserved), and drops one
// reference per physical granule: a granule whose last mapping went returns to the
// pool, or to the OS (see shared_pool.go). A read-write last mapping that the pool
// keeps is first moved into the park with its page tables (see shared_park.go). The
// contents seen through r are forfeit; other mappings of the
// granules keep them. On error nothing changed (but where page tables wait).
func (s *Shared) Decommit(r *SharedReservation, off, size int) error {
	if err := s.lockRange("decommit", r, off, size, true); err != nil {
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
	s.putParked(parked)
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
	if err := s.lockUse("unreserve", r); err != nil {
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
	parked := s.parkPriv(r, 0, n)
	err := s.sys.release(r.raw, r.rawN)
	if err == nil {
		s.putParked(parked)
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
	// NB: the parked private granules come back first, so that a Failed outcome
	// changed nothing and a Quarantined one counts them where they are.
	if uerr := s.unpark(r, parked); uerr != nil {
		err = fmt.Errorf("%w; and undoing the park failed: %w", err, uerr)
	}
	var give []int
	var unmapped int64
	// quarantined ends a failed Unreserve: the books under s.mu, then, outside it,
	// the residual reported to the authority and the granules given back.
	quarantined := func(err error) accounting.ReleaseOutcome {
		out := s.quarantine(r, unmapped, held, err)
		s.mu.Unlock()
		if unmapped != 0 {
			s.auth.Quarantine(held-unmapped, err)
		}
		s.giveBack(give)
		return out
	}
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
			return quarantined(err)
		}
		give = append(give, s.drop(r, i, j-i)...)
		unmapped += int64(j-i) << s.shift
		i = j
	}
	if rerr := s.sys.release(r.raw, r.rawN); rerr != nil {
		return quarantined(errors.Join(err, s.opErr("unreserve", 0, r.size, rerr, true)))
	}
	s.forget(r, sharedGone)
	s.mu.Unlock()
	s.giveBack(give)
	return accounting.Released(held)
}

// quarantine returns the outcome of a failed Unreserve of r that unmapped unmapped
// of its held bytes: Failed if nothing changed, else Quarantined, and r is then
// quarantined with what it still maps. s.mu must be held.
func (s *Shared) quarantine(r *SharedReservation, unmapped, held int64, err error) accounting.ReleaseOutcome {
	if unmapped == 0 {
		return accounting.FailedRelease(held, err)
	}
	s.live--
	r.state = sharedQuarantined
	r.leak.Close() // unreserved as far as its owner goes
	return accounting.Outcome(unmapped, held-unmapped, true, err)
}

// forget ends r's life as a live reservation. s.mu must be held.
func (s *Shared) forget(r *SharedReservation, state sharedState) {
	r.state = state
	s.live--
	delete(s.resv, r)
	r.leak.Close()
}

// Protect sets the access of the committed range [off, off+size) of r to prot with one
// mprotect over the range (nothing at all when every granule has it already). The
// physical granules, their contents and their other mappings are untouched. ReadWrite
// is refused with ErrSharedReadOnly (which matches backing.ErrReadOnly) on a range
// holding a granule shared into r read-only. A store through Base(r) into a read-only
// range raises SIGSEGV: the process dies unless the goroutine runs under
// runtime/debug.SetPanicOnFault(true), where it becomes a recoverable panic; CopyIn
// refuses instead. The access lasts until the granule is decommitted; a read-only last
// mapping goes idle without its page tables (see shared_park.go). On error
// nothing changed, but where mprotect failed midway and restoring a run's old access
// failed too: that run is then recorded read-only, which CopyIn honours, and the error
// says so.
func (s *Shared) Protect(r *SharedReservation, off, size int, prot backing.Protection) error {
	const op = "protect"
	if err := s.lockUse(op, r); err != nil {
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
	if err := s.lockRange("populate", r, off, size, true); err != nil {
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
			} else if m.priv {
				r.maps[i].res = true
			}
		}
	}
	return nil
}

// span checks a byte range of r for CopyIn/CopyOut: inside r and wholly committed,
// and, for a write, mapped read-write. s.mu must be held.
func (s *Shared) span(op string, r *SharedReservation, off, n int, write bool) error {
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
	if err := s.lockUse("copy in", r); err != nil {
		return err
	}
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
	if err := s.lockUse("copy out", r); err != nil {
		return err
	}
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
// PoolStats, the constant accessors and a second Close, which changes nothing and
// returns ErrSharedClosed (docs/server.md, "A second Close").
func (s *Shared) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrSharedClosed
	}
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
	_, err := s.givePriv(s.takePrivIdle(s.claim(s.nPrivIdle)))
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
		victims := s.victims(s.claim(s.nIdle))
		s.mu.Unlock()
		_, gerr := s.giveBack(victims)
		err = errors.Join(err, gerr)
		s.mu.Lock()
	}
	if !stranded {
		// Closing the last reference to the file frees all its pages at once.
		s.claim(s.nIdle) // NB: all of them: no commit waits once every reservation is gone
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
