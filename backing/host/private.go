package host

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
)

// privateDefaultGranularity is the granule of a Private backing whose options leave
// it zero: small enough that a KV tensor wastes at most 64 KiB at its frontier, large
// enough that a commit covers 16 pages per syscall.
const privateDefaultGranularity = 64 << 10

// privateMaxName is the longest mapping name Linux accepts (80 bytes with the NUL).
const privateMaxName = 79

// PrivateOptions configure a Private backing. The zero value is a 64 KiB-granule
// backing that does not populate and does not name its mappings.
type PrivateOptions struct {
	// Granularity is the granule size in bytes; 0 means 64 KiB. It must be a power of
	// two and a multiple of the OS page size. (On Windows the OS reserves address space
	// in 64 KiB steps whatever the granule; commits go by page.)
	Granularity int
	// Populate makes every commit also make its pages resident (Linux:
	// MADV_POPULATE_WRITE, or touching each page on kernels without it), so that the
	// first writes take no faults. It moves the cost of faulting into Commit; whether
	// that is off the token path is the caller's choice.
	Populate bool
	// NoHugePages turns transparent huge pages off. Otherwise, where the granule is a
	// multiple of the huge page (2 MiB on x86-64) and the system allows them
	// (/sys/kernel/mm/transparent_hugepage/enabled is always or madvise), every
	// reservation asks for them (MADV_HUGEPAGE): a granule then costs one huge page
	// to populate and free instead of 512 small ones. Where it does not ask and
	// enabled is always, every reservation refuses them (MADV_NOHUGEPAGE), which the
	// kernel would otherwise give unasked. PrivateStats says whether it asks and, if
	// not, why; HugePages says what the kernel really gave.
	NoHugePages bool
	// AlwaysHugePages asks for huge pages also on a virtual machine that reports its
	// free memory to the host in huge-page blocks, where a fresh huge page costs more
	// than small pages (PrivateStats.NoHugePages says so when it applies); a caller
	// that keeps its granules committed may still want them there.
	AlwaysHugePages bool
	// Name labels the mappings on Linux (PR_SET_VMA_ANON_NAME), so that
	// /proc/<pid>/maps shows them as [anon:Name]. Kernels built without
	// CONFIG_ANON_VMA_NAME ignore it, as do other systems. At most 79 printable ASCII
	// bytes, none of them \ ` $ [ or ].
	Name string
	// Logger receives, at construction, a fallback the system forces: no
	// MADV_POPULATE_WRITE (Populate touches pages instead), or small pages where the
	// granule would take huge pages. nil logs nothing.
	Logger *slog.Logger
}

// Private is the host backing on private anonymous memory: Reserve maps address
// space with no access and no swap reservation, Commit makes granules readable and
// writable, Decommit gives their pages back to the OS and takes the access away again.
// Pages are faulted in on first touch, or at Commit with PrivateOptions.Populate.
//
// Reserve is mmap(PROT_NONE, MAP_NORESERVE) (VirtualAlloc MEM_RESERVE on Windows),
// Commit mprotect to read-write (MEM_COMMIT), and Decommit MADV_DONTNEED then
// PROT_NONE (a fresh inaccessible mapping on Darwin; MEM_DECOMMIT on Windows), so that
// the pages go back to the OS and a touch faults. Committing costs a syscall; the
// pages cost their first-touch faults, which Populate moves into Commit
// (MADV_POPULATE_WRITE where the kernel has it). On Linux its mappings can be named
// (PrivateOptions.Name).
//
// Private implements [backing.Backing][*PrivateReservation] with ByBuffer accounting
// on the host, and [backing.HostAccessible] (true), [backing.Copier],
// [backing.Populator] and [backing.Zeroer] (true: a recommitted granule reads as
// zero). It can not share granules: private pages belong to one mapping.
//
// A Private is safe for concurrent use, and holds no OS resources of its own: only
// its reservations do.
type Private struct {
	gran     int
	page     int
	populate bool
	name     []byte // NUL-terminated, or nil
	huge     bool   // reservations ask for transparent huge pages
	hugeWhy  string // why they do not, when huge is false
	smallTHP bool   // reservations refuse huge pages (MADV_NOHUGEPAGE): huge is false and THP is "always"

	hugeFailed atomic.Int64 // reservations whose MADV_HUGEPAGE the kernel refused
}

// PrivateStats describes a Private backing.
type PrivateStats struct {
	Granule int // granule size in bytes
	// HugePages reports whether reservations ask for transparent huge pages; when
	// false, NoHugePages says why (the option, the granule, or the system's mode).
	HugePages   bool
	NoHugePages string
	// HugeRefused counts the reservations whose request for huge pages the kernel
	// refused (they run on small pages), and, where the backing does not ask for
	// them and THP is "always" (so that the kernel would give them unasked), those
	// whose refusal of huge pages (MADV_NOHUGEPAGE) it refused (they may get some).
	HugeRefused int64
}

// PrivateReservation is a range of address space reserved by a Private backing: the
// private backing's R. It must be given back with Private.Unreserve.
type PrivateReservation struct {
	p    *Private
	leak invariants.Tracker // reports it collected unclosed in the invariants build
	base uintptr
	size int

	mu        sync.Mutex
	gone      bool   // Unreserve completed (or quarantined)
	committed bitset // one bit per granule
}

var (
	_ backing.Backing[*PrivateReservation]   = (*Private)(nil)
	_ backing.Copier[*PrivateReservation]    = (*Private)(nil)
	_ backing.Populator[*PrivateReservation] = (*Private)(nil)
	_ backing.Zeroer                         = (*Private)(nil)
	_ backing.HostAccessible                 = (*Private)(nil)
)

// NewPrivate returns a Private backing. It returns an error matching
// ErrPrivateOptions for a bad granule or name, and one matching
// errors.ErrUnsupported on systems without an implementation.
func NewPrivate(opts PrivateOptions) (*Private, error) {
	if err := privateInitOS(); err != nil {
		return nil, err
	}
	page := os.Getpagesize()
	g := opts.Granularity
	if g == 0 {
		g = max(privateDefaultGranularity, page)
	}
	switch {
	case !backing.IsPowerOfTwo(g):
		return nil, fmt.Errorf("%w: granularity %d is not a power of two", ErrPrivateOptions, g)
	case g%page != 0:
		return nil, fmt.Errorf("%w: granularity %d is not a multiple of the %d-byte page", ErrPrivateOptions, g, page)
	}
	p := &Private{gran: g, page: page, populate: opts.Populate}
	switch m := hugeAnon(); {
	case opts.NoHugePages:
		p.hugeWhy = "turned off by PrivateOptions.NoHugePages"
	case m.why != "":
		p.hugeWhy = m.why
	case g%m.pmd != 0:
		p.hugeWhy = fmt.Sprintf("the %d-byte granule is not a multiple of the %d-byte huge page", g, m.pmd)
	case !opts.AlwaysHugePages && hugeReporting() != "":
		p.hugeWhy = hugeReporting()
	default:
		p.huge = true
	}
	// NB: where THP is "always" the kernel gives huge pages unasked: refuse them
	// where the backing does not ask, so that PrivateStats says what it does.
	p.smallTHP = !p.huge && hugeAnon().mode == "always"
	if opts.Name != "" {
		if err := privateCheckName(opts.Name); err != nil {
			return nil, err
		}
		p.name = append([]byte(opts.Name), 0)
	}
	noHuge := p.hugeWhy
	if opts.NoHugePages {
		noHuge = "" // the caller's choice, not a fallback
	}
	noteFallbacks(opts.Logger, "private", opts.Populate, g, noHuge)
	return p, nil
}

// privateCheckName applies the kernel's rules for anonymous mapping names, so that a
// name is refused here the same way on every system.
func privateCheckName(name string) error {
	if len(name) > privateMaxName {
		return fmt.Errorf("%w: name %q is longer than %d bytes", ErrPrivateOptions, name, privateMaxName)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c < ' ' || c > '~' || c == '\\' || c == '`' || c == '$' || c == '[' || c == ']' {
			return fmt.Errorf("%w: name %q has the byte %q, which the kernel refuses", ErrPrivateOptions, name, c)
		}
	}
	return nil
}

// Granularity returns the granule size in bytes.
func (p *Private) Granularity() int { return p.gran }

// Device returns accounting.HostKey.
func (p *Private) Device() accounting.DeviceKey { return accounting.HostKey }

// Accounting returns ByBuffer: the caller charges what it commits.
func (p *Private) Accounting() backing.PhysicalAccounting { return backing.ByBuffer() }

// HostAccessible reports true: committed memory may be read and written at
// Base(r)+off.
func (p *Private) HostAccessible() bool { return true }

// CommitZeroes reports true: Decommit gives the pages back to the OS, and the OS
// hands out zeroed pages.
func (p *Private) CommitZeroes() bool { return true }

// Reserve moves size bytes of address space from Unreserved to Reserved: the range
// is mapped with no access and commits no memory (nor swap). The base is aligned to
// the granule (on Windows, where the OS allows it, else to 64 KiB). A zero size gives
// an empty reservation with base 0 that maps nothing.
func (p *Private) Reserve(size int) (*PrivateReservation, error) {
	if err := backing.CheckReserve(size, p.gran); err != nil {
		return nil, err
	}
	r := &PrivateReservation{p: p, size: size}
	if size == 0 {
		return r, nil
	}
	base, err := privateReserveOS(size, p.gran)
	if err != nil {
		return nil, privateError("reserve", 0, size, err)
	}
	if p.name != nil {
		privateNameOS(base, size, p.name)
	}
	if p.huge || p.smallTHP {
		if err := hugeAdvise(base, size, p.huge); err != nil {
			// NB: not an error of Reserve: the reservation works either way, and
			// PrivateStats.HugeRefused says so.
			p.hugeFailed.Add(1)
		}
	}
	r.base = base
	r.committed = newBitset(size / p.gran)
	invariants.Track(&r.leak, r, "host.PrivateReservation")
	return r, nil
}

// Stats describes the backing: its granule and whether it asks for huge pages.
func (p *Private) Stats() PrivateStats {
	return PrivateStats{Granule: p.gran, HugePages: p.huge, NoHugePages: p.hugeWhy, HugeRefused: p.hugeFailed.Load()}
}

// HugePages returns how many bytes of r's committed memory the kernel really backs
// with transparent huge pages (smaps' AnonHugePages over r's range). It reads
// /proc/self/smaps, which costs about a millisecond per thousand mappings of the
// process: it is for metrics and tests, not the token path. Where the system has no
// transparent huge pages it returns zero and an error matching errors.ErrUnsupported.
func (p *Private) HugePages(r *PrivateReservation) (HugePageBytes, error) {
	if err := p.lock("huge pages", r); err != nil {
		return HugePageBytes{}, err
	}
	base, size := r.base, r.size
	r.mu.Unlock()
	if size == 0 {
		return HugePageBytes{}, nil
	}
	return hugeBytes(base, base+uintptr(size))
}

// lock locks r and checks that it is a live reservation of p. On a nil error the
// caller holds r.mu. Use after Unreserve panics.
func (p *Private) lock(op string, r *PrivateReservation) error {
	if r == nil || r.p != p {
		return &backing.OpError{Op: op, Kind: backing.ErrForeignReservation}
	}
	r.mu.Lock()
	if r.gone {
		r.mu.Unlock()
		panic(backing.PanicUseAfterUnreserve)
	}
	return nil
}

// Base returns the first address of r. It never changes.
func (p *Private) Base(r *PrivateReservation) uintptr {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gone {
		panic(backing.PanicUseAfterUnreserve)
	}
	return r.base
}

// Size returns the reserved size of r in bytes.
func (p *Private) Size(r *PrivateReservation) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gone {
		panic(backing.PanicUseAfterUnreserve)
	}
	return r.size
}

// Commit moves [off, off+size) from Reserved to Committed: the pages become readable
// and writable and read as zero; with PrivateOptions.Populate they are also made
// resident. On any error nothing was committed.
func (p *Private) Commit(r *PrivateReservation, off, size int) error {
	if err := p.lock("commit", r); err != nil {
		return err
	}
	err := backing.CheckRange("commit", off, size, r.size, p.gran)
	if err == nil {
		err = r.claim("commit", off, size)
	}
	r.mu.Unlock()
	if err != nil || size == 0 {
		return err
	}
	// The bits are claimed: callers serialize calls on overlapping ranges, so nobody
	// else acts on these granules until the syscalls are done.
	addr := r.base + uintptr(off)
	if err = privateCommitOS(addr, size); err == nil && p.populate {
		if err = privatePopulateOS(addr, size, p.page); err != nil {
			if rerr := privateDecommitOS(addr, size); rerr != nil {
				// NB: the pages stay accessible; the granules stay Committed so that
				// the state says the truth, and the caller learns why.
				return privateError("commit", off, size, fmt.Errorf("populate: %w (and rollback: %w)", err, rerr))
			}
		}
	}
	if err != nil {
		r.mu.Lock()
		r.committed.clearRange(off/p.gran, size/p.gran)
		r.mu.Unlock()
		return privateError("commit", off, size, err)
	}
	return nil
}

// Decommit moves [off, off+size) from Committed to Reserved: the pages go back to the
// OS, their contents are forfeit and a touch faults. On error the range is still
// Committed.
//
// NB: when the kernel frees the pages but then refuses to take the access away (it
// never does in practice), the granules stay Committed and read as zero.
func (p *Private) Decommit(r *PrivateReservation, off, size int) error {
	if err := p.lock("decommit", r); err != nil {
		return err
	}
	err := backing.CheckRange("decommit", off, size, r.size, p.gran)
	if err == nil {
		err = r.check("decommit", off, size, true)
	}
	r.mu.Unlock()
	if err != nil || size == 0 {
		return err
	}
	if err := privateDecommitOS(r.base+uintptr(off), size); err != nil {
		return privateError("decommit", off, size, err)
	}
	r.mu.Lock()
	r.committed.clearRange(off/p.gran, size/p.gran)
	r.mu.Unlock()
	return nil
}

// Unreserve unmaps the whole of r, committed granules included, and moves it to
// Unreserved. It is Complete with the committed bytes as Unmapped, or Failed (nothing
// changed) when the OS refuses or r is foreign.
func (p *Private) Unreserve(r *PrivateReservation) accounting.ReleaseOutcome {
	if err := p.lock("unreserve", r); err != nil {
		return accounting.FailedRelease(0, err)
	}
	defer r.mu.Unlock()
	committed := int64(r.committed.count()) * int64(p.gran)
	if r.size > 0 {
		if err := privateReleaseOS(r.base, r.size); err != nil {
			return accounting.FailedRelease(committed, privateError("unreserve", 0, r.size, err))
		}
	}
	r.gone = true
	r.leak.Close()
	r.committed = nil
	return accounting.Released(committed)
}

// Populate makes the pages of [off, off+size) resident, so that later accesses take
// no faults; the contents are kept. Every granule must be Committed.
func (p *Private) Populate(r *PrivateReservation, off, size int) error {
	if err := p.lock("populate", r); err != nil {
		return err
	}
	err := backing.CheckRange("populate", off, size, r.size, p.gran)
	if err == nil {
		err = r.check("populate", off, size, true)
	}
	r.mu.Unlock()
	if err != nil || size == 0 {
		return err
	}
	if err := privatePopulateOS(r.base+uintptr(off), size, p.page); err != nil {
		return privateError("populate", off, size, err)
	}
	return nil
}

// CopyIn copies src into committed memory at off; the range need not be aligned.
func (p *Private) CopyIn(r *PrivateReservation, off int, src []byte) error {
	if err := p.span("copy in", r, off, len(src)); err != nil {
		return err
	}
	copy(privateBytes(r.base, off, len(src)), src)
	return nil
}

// CopyOut copies committed memory at off into dst; the range need not be aligned.
func (p *Private) CopyOut(dst []byte, r *PrivateReservation, off int) error {
	if err := p.span("copy out", r, off, len(dst)); err != nil {
		return err
	}
	copy(dst, privateBytes(r.base, off, len(dst)))
	return nil
}

// span checks that [off, off+n) lies in r and every granule it touches is Committed.
func (p *Private) span(op string, r *PrivateReservation, off, n int) error {
	if err := p.lock(op, r); err != nil {
		return err
	}
	defer r.mu.Unlock()
	switch {
	case off < 0:
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrInvalidRange}
	case off > r.size-n:
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrOutOfRange,
			Err: fmt.Errorf("reservation is %d bytes", r.size)}
	case n == 0:
		return nil
	}
	lo := backing.AlignDown(off, p.gran)
	hi, _ := backing.AlignUp(off+n, p.gran)
	if err := r.check(op, lo, hi-lo, true); err != nil {
		e := err.(*backing.OpError)
		e.Offset, e.Size = off, n // the caller's range, not the granules it touches
		return e
	}
	return nil
}

// claim marks [off, off+size) committed if every granule of it is Reserved.
// r.mu must be held.
func (r *PrivateReservation) claim(op string, off, size int) error {
	if err := r.check(op, off, size, false); err != nil {
		return err
	}
	r.committed.setRange(off/r.p.gran, size/r.p.gran)
	return nil
}

// check returns an error unless every granule of the aligned range [off, off+size)
// is Committed (want true) or Reserved (want false). r.mu must be held.
func (r *PrivateReservation) check(op string, off, size int, want bool) error {
	g := r.p.gran
	i, n := off/g, size/g
	var bad int
	if want {
		bad = r.committed.nextClear(i, i+n)
	} else {
		bad = r.committed.next(i, i+n)
	}
	if bad == i+n {
		return nil
	}
	kind := backing.ErrCommitted
	if want {
		kind = backing.ErrNotCommitted
	}
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: fmt.Errorf("granule at %#x", bad*g)}
}
