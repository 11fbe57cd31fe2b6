package backingtest

import (
	"context"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// fakeBase is where the Fake's synthetic address space starts: far above anything a
// test could confuse with a real small address.
const fakeBase uintptr = 1 << 40

// FakeOptions configure a Fake. The zero value is a 64 KiB-granule host fake under
// ByBuffer accounting.
type FakeOptions struct {
	// Granularity is the granule size in bytes; 0 means 64 KiB. It must be a power of
	// two.
	Granularity int
	// Device is the memory the fake claims to be; the zero value is the host.
	Device accounting.DeviceKey
	// Authority, when set, makes the fake ByBacking: it charges each physical granule
	// to Authority with TryAcquire when it creates it and releases it when the last
	// mapping goes, and attributes every mapping (commit or share) with Map until it is
	// decommitted or unreserved. When nil the fake is ByBuffer and charges nothing.
	Authority *accounting.Authority
	// Wait makes a ByBacking fake a working [backing.Waiter]: CommitCtx waits for the
	// budget in the governor's FIFO queue. Without it (or under ByBuffer) CommitCtx
	// answers an error wrapping [backing.ErrUnsupported], so that code above the
	// backings keeps its own wait path unless a test asks for this one.
	Wait bool
}

// Fake is a backing on Go-heap memory, for tests of code above the backings. Its
// addresses are synthetic (a fake address space from 1<<40, granule aligned) and must
// never be dereferenced, so it is not HostAccessible; the contents are reached through
// [backing.Copier]. It implements [backing.Backing][*FakeReservation], Copier,
// [backing.Sharer] (under ByBacking only), [backing.Protector], [backing.Zeroer]
// (CommitZeroes is true),
// [backing.Populator] (which only validates) and [backing.Waiter] (under ByBacking with
// FakeOptions.Wait only).
//
// Each committed physical granule is a []byte with a reference count: sharing maps it
// into another reservation, and it is freed with its last mapping.
//
// A Fake is safe for concurrent use.
type Fake struct {
	gran int
	dev  accounting.DeviceKey
	acct backing.PhysicalAccounting
	wait bool

	mu       sync.Mutex
	next     uintptr // next free synthetic address
	granules int     // physical granules alive
	reserved int     // reservations not yet unreserved

	shareAnySource bool // a mutant (export_test.go): Share grants ReadWrite on read-only sources
}

// FakeReservation is the Fake's reservation. Its zero value is not a reservation.
type FakeReservation struct {
	f    *Fake
	base uintptr
	size int

	// guarded by f.mu
	gone     bool
	mappings map[int]fakeMapping // granule index -> mapping; absent means Reserved
}

type fakeMapping struct {
	g    *fakeGranule
	prot backing.Protection // access now
	ro   bool               // shared ReadOnly: Protect may never grant ReadWrite
}

type fakeGranule struct {
	data []byte
	refs int // mappings of this granule
}

var (
	_ backing.Backing[*FakeReservation]   = (*Fake)(nil)
	_ backing.Copier[*FakeReservation]    = (*Fake)(nil)
	_ backing.Sharer[*FakeReservation]    = (*Fake)(nil)
	_ backing.Populator[*FakeReservation] = (*Fake)(nil)
	_ backing.Protector[*FakeReservation] = (*Fake)(nil)
	_ backing.Waiter[*FakeReservation]    = (*Fake)(nil)
	_ backing.Zeroer                      = (*Fake)(nil)
)

// NewFake returns an empty Fake. It panics when opts.Granularity is not a power of
// two: that is a mistake in the test, not a condition to handle.
func NewFake(opts FakeOptions) *Fake {
	g := opts.Granularity
	if g == 0 {
		g = 64 << 10
	}
	if !backing.IsPowerOfTwo(g) {
		panic(fmt.Sprintf("backingtest: Fake granularity %d is not a power of two", opts.Granularity))
	}
	f := &Fake{gran: g, dev: opts.Device, next: fakeBase, wait: opts.Wait}
	if opts.Authority != nil {
		f.acct = backing.ByBacking(opts.Authority)
	}
	return f
}

// Granularity returns the granule size.
func (f *Fake) Granularity() int { return f.gran }

// Device returns the device the fake claims to be.
func (f *Fake) Device() accounting.DeviceKey { return f.dev }

// Accounting returns ByBacking with the options' authority, or ByBuffer.
func (f *Fake) Accounting() backing.PhysicalAccounting { return f.acct }

// CommitZeroes reports true: a fresh physical granule is a new zeroed slice.
func (f *Fake) CommitZeroes() bool { return true }

// LiveGranules returns the number of physical granules alive (mapped at least once).
func (f *Fake) LiveGranules() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.granules
}

// LiveReservations returns the number of reservations not yet unreserved.
func (f *Fake) LiveReservations() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reserved
}

// Reserve moves size bytes of synthetic address space to Reserved. Addresses are
// never reused, so a stale base can not alias a new reservation.
func (f *Fake) Reserve(size int) (*FakeReservation, error) {
	if err := backing.CheckReserve(size, f.gran); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	// Keep at least one granule between reservations so that bases are distinct even
	// for empty ones.
	span := uintptr(max(size, f.gran))
	if f.next > ^uintptr(0)-span {
		return nil, &backing.OpError{Op: "reserve", Size: size, Kind: backing.ErrOutOfMemory,
			Err: fmt.Errorf("backingtest: fake address space exhausted")}
	}
	r := &FakeReservation{f: f, base: f.next, size: size, mappings: make(map[int]fakeMapping)}
	f.next += span
	f.reserved++
	return r, nil
}

// use checks that r is a live reservation of f. f.mu must be held.
func (f *Fake) use(op string, r *FakeReservation) error {
	if r == nil || r.f != f {
		return &backing.OpError{Op: op, Kind: backing.ErrForeignReservation}
	}
	if r.gone {
		panic(backing.PanicUseAfterUnreserve)
	}
	return nil
}

// Base returns the reservation's synthetic first address, which must never be
// dereferenced.
func (f *Fake) Base(r *FakeReservation) uintptr {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.gone {
		panic(backing.PanicUseAfterUnreserve)
	}
	return r.base
}

// Size returns the reserved size.
func (f *Fake) Size(r *FakeReservation) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.gone {
		panic(backing.PanicUseAfterUnreserve)
	}
	return r.size
}

// checkState returns an error unless every granule of [off, off+size) is committed
// (want true) or reserved (want false). f.mu must be held.
func (r *FakeReservation) checkState(op string, off, size int, want bool) error {
	g := r.f.gran
	for i := off / g; i < (off+size)/g; i++ {
		if _, ok := r.mappings[i]; ok != want {
			if want {
				return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrNotCommitted,
					Err: fmt.Errorf("granule at %#x", i*g)}
			}
			return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrCommitted,
				Err: fmt.Errorf("granule at %#x", i*g)}
		}
	}
	return nil
}

// mapNew maps fresh zeroed granules at [off, off+size) of r, which must be Reserved,
// and attributes them under ByBacking; the caller charged them already. f.mu must be
// held.
func (r *FakeReservation) mapNew(off, size int) {
	f := r.f
	for i := off / f.gran; i < (off+size)/f.gran; i++ {
		r.mappings[i] = fakeMapping{g: &fakeGranule{data: make([]byte, f.gran), refs: 1}, prot: backing.ReadWrite}
		f.granules++
	}
	if a := f.acct.Authority(); a != nil {
		a.Map(int64(size))
	}
}

// unmap drops granule i's mapping and its attribution, and frees the physical granule
// with its last mapping. f.mu must be held.
func (r *FakeReservation) unmap(i int) {
	f := r.f
	m := r.mappings[i]
	delete(r.mappings, i)
	if a := f.acct.Authority(); a != nil {
		a.Unmap(int64(f.gran))
	}
	m.g.refs--
	if m.g.refs == 0 {
		m.g.data = nil
		f.granules--
		if a := f.acct.Authority(); a != nil {
			a.Release(int64(f.gran))
		}
	}
}

// Commit moves [off, off+size) from Reserved to Committed with fresh zeroed granules.
// Under ByBacking it charges them first; a refused charge changes nothing.
func (f *Fake) Commit(r *FakeReservation, off, size int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("commit", r); err != nil {
		return err
	}
	if err := backing.CheckRange("commit", off, size, r.size, f.gran); err != nil {
		return err
	}
	if err := r.checkState("commit", off, size, false); err != nil || size == 0 {
		return err
	}
	if a := f.acct.Authority(); a != nil {
		if err := a.TryAcquire(int64(size)); err != nil {
			return &backing.OpError{Op: "commit", Offset: off, Size: size, Err: err}
		}
	}
	r.mapNew(off, size)
	return nil
}

// CommitCtx is Commit that, under ByBacking with FakeOptions.Wait, waits in the
// governor's FIFO queue until the budget covers [off, off+size) or ctx ends; then it
// returns an error wrapping ctx's and changes nothing. Otherwise it answers an error
// wrapping [backing.ErrUnsupported] and changes nothing.
func (f *Fake) CommitCtx(ctx context.Context, r *FakeReservation, off, size int) error {
	const op = "commit ctx"
	if ctx == nil {
		panic("backingtest: CommitCtx with a nil context")
	}
	a := f.acct.Authority()
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use(op, r); err != nil {
		return err
	}
	if !f.wait || a == nil {
		return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrUnsupported,
			Err: fmt.Errorf("backingtest: waiting needs ByBacking accounting and FakeOptions.Wait")}
	}
	if err := backing.CheckRange(op, off, size, r.size, f.gran); err != nil {
		return err
	}
	// NB: an empty commit must not queue: the governor refuses even 0 bytes while
	// others wait.
	if err := r.checkState(op, off, size, false); err != nil || size == 0 {
		return err
	}
	err := a.TryAcquire(int64(size))
	if accounting.CanWait(err) {
		// Wait without f.mu: the decommits that free the budget need it.
		f.mu.Unlock()
		err = a.Acquire(ctx, int64(size))
		f.mu.Lock()
		if err == nil {
			if r.gone {
				a.Release(int64(size))
				panic(backing.PanicUseAfterUnreserve)
			}
			// NB: only misuse (an unserialized call on an overlapping range) can
			// commit a granule of the range meanwhile.
			if err := r.checkState(op, off, size, false); err != nil {
				a.Release(int64(size))
				return err
			}
		}
	}
	if err != nil {
		return &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	r.mapNew(off, size)
	return nil
}

// Decommit moves [off, off+size) from Committed to Reserved; the contents are
// forfeit. A physical granule shared elsewhere lives on in its other mappings.
func (f *Fake) Decommit(r *FakeReservation, off, size int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("decommit", r); err != nil {
		return err
	}
	if err := backing.CheckRange("decommit", off, size, r.size, f.gran); err != nil {
		return err
	}
	if err := r.checkState("decommit", off, size, true); err != nil {
		return err
	}
	for i := off / f.gran; i < (off+size)/f.gran; i++ {
		r.unmap(i)
	}
	return nil
}

// Unreserve decommits everything still committed in r and moves it to Unreserved. It
// is Complete, with the committed bytes unmapped, unless r is foreign (Failed).
func (f *Fake) Unreserve(r *FakeReservation) accounting.ReleaseOutcome {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("unreserve", r); err != nil {
		return accounting.FailedRelease(0, err)
	}
	n := int64(len(r.mappings)) * int64(f.gran)
	for i := range r.mappings {
		r.unmap(i)
	}
	r.gone = true
	f.reserved--
	return accounting.Released(n)
}

// Share moves [dstOff, dstOff+size) of dst from Reserved to Committed by mapping the
// physical granules committed at [srcOff, srcOff+size) of src. ReadWrite is refused
// with an error wrapping [backing.ErrReadOnly] when a source granule is ReadOnly in
// src (shared so, or protected). Under ByBuffer it returns an error wrapping
// [backing.ErrUnsupported]: a shared granule must be owned exactly once, which only
// ByBacking accounting can say.
func (f *Fake) Share(dst *FakeReservation, dstOff int, src *FakeReservation, srcOff, size int, prot backing.Protection) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("share", dst); err != nil {
		return err
	}
	if err := f.use("share", src); err != nil {
		return err
	}
	if prot != backing.ReadWrite && prot != backing.ReadOnly {
		return &backing.OpError{Op: "share", Offset: dstOff, Size: size,
			Err: fmt.Errorf("backingtest: unknown protection %d", prot)}
	}
	if !f.acct.OwnedByBacking() {
		return &backing.OpError{Op: "share", Offset: dstOff, Size: size, Kind: backing.ErrUnsupported,
			Err: fmt.Errorf("backingtest: sharing needs ByBacking accounting")}
	}
	if err := backing.CheckRange("share", srcOff, size, src.size, f.gran); err != nil {
		return err
	}
	if err := backing.CheckRange("share", dstOff, size, dst.size, f.gran); err != nil {
		return err
	}
	if err := src.checkState("share", srcOff, size, true); err != nil {
		return err
	}
	if err := dst.checkState("share", dstOff, size, false); err != nil {
		return err
	}
	if prot == backing.ReadWrite && !f.shareAnySource {
		for i := srcOff / f.gran; i < (srcOff+size)/f.gran; i++ {
			if src.mappings[i].prot != backing.ReadWrite {
				return &backing.OpError{Op: "share", Offset: dstOff, Size: size, Kind: backing.ErrReadOnly,
					Err: fmt.Errorf("backingtest: source granule at %#x is read-only in its reservation", i*f.gran)}
			}
		}
	}
	for k := 0; k < size/f.gran; k++ {
		m := src.mappings[srcOff/f.gran+k]
		m.g.refs++
		dst.mappings[dstOff/f.gran+k] = fakeMapping{g: m.g, prot: prot, ro: prot == backing.ReadOnly}
	}
	f.acct.Authority().Map(int64(size))
	return nil
}

// span checks that [off, off+n) lies inside r and is wholly committed, for the
// byte-granular Copier methods. f.mu must be held.
func (r *FakeReservation) span(op string, off, n int) error {
	if off < 0 || n < 0 || off > r.size-n {
		kind := backing.ErrOutOfRange
		if off < 0 || n < 0 {
			kind = backing.ErrInvalidRange
		}
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: kind}
	}
	if n == 0 {
		return nil
	}
	g := r.f.gran
	lo := backing.AlignDown(off, g)
	hi, _ := backing.AlignUp(off+n, g)
	return r.checkState(op, lo, hi-lo, true)
}

// CopyIn copies src into committed memory at off. Writing a ReadOnly mapping (shared
// so, or protected) fails with an error wrapping [backing.ErrReadOnly] (on real memory
// it would fault).
func (f *Fake) CopyIn(r *FakeReservation, off int, src []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("copy in", r); err != nil {
		return err
	}
	if err := r.span("copy in", off, len(src)); err != nil {
		return err
	}
	g := f.gran
	for i := off / g; i*g < off+len(src); i++ {
		if r.mappings[i].prot == backing.ReadOnly {
			return &backing.OpError{Op: "copy in", Offset: off, Size: len(src), Kind: backing.ErrReadOnly,
				Err: fmt.Errorf("backingtest: write to a read-only mapping at %#x", i*g)}
		}
	}
	for i := off / g; len(src) > 0; i++ {
		src = src[copy(r.mappings[i].g.data[max(off-i*g, 0):], src):]
	}
	return nil
}

// CopyOut copies committed memory at off into dst.
func (f *Fake) CopyOut(dst []byte, r *FakeReservation, off int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("copy out", r); err != nil {
		return err
	}
	if err := r.span("copy out", off, len(dst)); err != nil {
		return err
	}
	g := f.gran
	for i := off / g; len(dst) > 0; i++ {
		dst = dst[copy(dst, r.mappings[i].g.data[max(off-i*g, 0):]):]
	}
	return nil
}

// Populate validates [off, off+size) as Committed; Go-heap granules are resident
// already.
func (f *Fake) Populate(r *FakeReservation, off, size int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use("populate", r); err != nil {
		return err
	}
	if err := backing.CheckRange("populate", off, size, r.size, f.gran); err != nil {
		return err
	}
	return r.checkState("populate", off, size, true)
}

// Protect sets the access of the committed range [off, off+size) of r to prot. It
// refuses ReadWrite, with an error wrapping [backing.ErrReadOnly], on a range holding a
// granule shared into r ReadOnly. On error nothing changed.
func (f *Fake) Protect(r *FakeReservation, off, size int, prot backing.Protection) error {
	const op = "protect"
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.use(op, r); err != nil {
		return err
	}
	if prot != backing.ReadWrite && prot != backing.ReadOnly {
		return &backing.OpError{Op: op, Offset: off, Size: size,
			Err: fmt.Errorf("backingtest: unknown protection %d", prot)}
	}
	if err := backing.CheckRange(op, off, size, r.size, f.gran); err != nil {
		return err
	}
	if err := r.checkState(op, off, size, true); err != nil {
		return err
	}
	g := f.gran
	if prot == backing.ReadWrite {
		for i := off / g; i < (off+size)/g; i++ {
			if r.mappings[i].ro {
				return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrReadOnly,
					Err: fmt.Errorf("backingtest: granule at %#x is shared read-only into this reservation", i*g)}
			}
		}
	}
	for i := off / g; i < (off+size)/g; i++ {
		m := r.mappings[i]
		m.prot = prot
		r.mappings[i] = m
	}
	return nil
}
