package cuda

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Options configure a Backing.
//
// NB: New, Options and Backing carry no prefix, where package host has NewPrivate
// with PrivateOptions and NewShared with SharedOptions: host holds two backings and
// its names must tell them apart, while this package holds one, so the package name
// does the telling: cuda.New(cuda.Options{...}) pairs with
// host.NewShared(host.SharedOptions{...}) at the call site.
type Options struct {
	// Device is the ordinal of the GPU to commit on.
	Device int
	// Authority is the ledger the pool charges every physical handle it holds to,
	// mapped or idle (ByBacking accounting). Required; it must take bytes on
	// accounting.GPU(Device).
	Authority *accounting.Authority
	// Low is the pool's low water mark in handles (granules): New creates that many
	// idle handles ahead of need, and with Background the pool is refilled to Low
	// whenever commits take it below. 0: nothing is created ahead.
	Low int
	// High is the pool's high water mark: idle handles beyond High are released when
	// a decommit or unreserve returns them. 0 means no mark: every idle handle is kept
	// until Trim or Close. When set, Low must not exceed it.
	High int
	// Background refills the pool to Low from a goroutine, off the commit path.
	Background bool
	// Exportable creates every handle exportable as a POSIX file descriptor
	// (requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in
	// cuMemCreate's properties), so that Export can hand committed granules to
	// another process (export.go). New fails with ErrNoExport where the device can
	// not (attribute 103 is 0; every system but Linux), and with ErrMissingSymbol
	// where the driver lacks the export entry points.
	Exportable bool
	// Driver is the driver to call; nil means LoadDriver().
	Driver *Driver
	// Logger receives the pool's events: trims and reclaims that release handles,
	// and a fallback the driver forces (read-only mappings refused, so shares are
	// mapped read-write and guarded on the Go side). nil logs nothing. Quarantines
	// are logged by the governor (see accounting.GovernorOptions).
	Logger *slog.Logger
}

// Backing commits GPU memory through the CUDA driver's virtual memory management API:
// a reservation is a range of device virtual addresses (cuMemAddressReserve), and each
// committed granule is one physical allocation handle (cuMemCreate) mapped into it
// (cuMemMap) and made accessible (cuMemSetAccess). Handles come from a pool the
// Backing owns (ByBacking accounting), so a commit usually maps an existing handle and
// a decommit returns it.
//
// Backing implements backing.Backing[*Reservation], backing.Sharer, backing.Protector,
// backing.Pool, backing.Waiter, backing.Copier and backing.Zeroer. Its memory is not host
// accessible: Base addresses are device addresses and must never be dereferenced on
// the CPU.
type Backing struct {
	_ nocopy.NoCopy

	drv     *Driver
	ordinal int
	dev     int32   // CUdevice
	ctx     uintptr // the retained primary context
	gran    int
	version int32
	export  bool // Options.Exportable
	prop    MemAllocationProp
	rw, ro  MemAccessDesc
	auth    *accounting.Authority
	low     int
	high    int
	closed  atomic.Bool
	// noReadOnly: the driver refused PROT_READ on a device mapping (NOT_SUPPORTED);
	// read-only shares are then mapped read-write and guarded on the Go side only.
	noReadOnly atomic.Bool
	log        *slog.Logger // nil logs nothing

	mu         sync.Mutex
	idle       []*handle // pooled, mapped nowhere; the most recently used last
	stuck      []*handle // idle handles cuMemRelease refused: still owned
	owned      int       // handles held: idle, mapped, stuck, being handed out
	created    int64     // handles ever made (PoolStats.Created)
	creating   int       // handles the refill is creating now
	reclaiming int       // reclaims running now
	settled    sync.Cond // on mu: signalled when creating or reclaiming drops
	held       bool      // Trim or Quiesce paused the background refill until the next commit
	mapped     int64     // bytes of mappings (a handle mapped twice counts twice)
	nres       int       // reservations not yet unreserved
	imports    int       // imported handles not yet released (export.go); never owned
	stuckIn    []*handle // imported handles cuMemRelease refused, retried with stuck

	refill chan struct{} // nudges the background refill; nil without Background
	stop   chan struct{}
	done   chan struct{}

	reclaims sync.WaitGroup // reclaimers running; Close waits for them

	pins pins // host memory PinHost pinned (host.go)
}

// handle is one physical allocation of one granule. One the pool created is owned;
// when its last mapping goes it returns to the pool, unless it was exported: then
// another process may map it still, so it is released. An imported one is not
// owned: released when its last mapping goes (export.go).
type handle struct {
	h        uint64 // CUmemGenericAllocationHandle
	refs     int    // mappings; guarded by Backing.mu
	exported bool   // Export gave out a descriptor of it; guarded by Backing.mu
	imported bool   // Import made it from another process's descriptor
}

// Reservation is one reserved range of device virtual addresses and what is mapped in
// it. Its zero value is not a reservation; only Reserve makes one.
type Reservation struct {
	b    *Backing
	leak invariants.Tracker // reports it collected unclosed in the invariants build
	base uint64
	size int
	dead atomic.Bool // Unreserve gave the range back (or quarantined it)

	mu    sync.Mutex
	slots slotTable // one slot per granule, h nil: Reserved (slots.go)
}

type slot struct {
	h      *handle
	ro     bool // mapped read-only (by Share, or Protect): the Go side refuses writes
	shared bool // shared read-only into the reservation: Protect never makes it writable
}

var (
	_ backing.Backing[*Reservation]   = (*Backing)(nil)
	_ backing.Sharer[*Reservation]    = (*Backing)(nil)
	_ backing.Waiter[*Reservation]    = (*Backing)(nil)
	_ backing.Copier[*Reservation]    = (*Backing)(nil)
	_ backing.Protector[*Reservation] = (*Backing)(nil)
	_ backing.Pool                    = (*Backing)(nil)
	_ backing.Zeroer                  = (*Backing)(nil)
)

// New initialises the driver, opens device opts.Device, retains its primary context
// and returns a Backing with an empty pool (filled to opts.Low before it returns, or
// from the background goroutine with opts.Background). The Backing MUST be closed.
//
// Errors are distinct: ErrNoDriver (no library), ErrMissingSymbol (too old a driver),
// ErrStubLibrary, ErrNoDevice, ErrBadDevice (no such ordinal), ErrNoVMM (the device
// can not reserve and map), ErrBadOptions; a failing driver call is a *Result.
func New(opts Options) (*Backing, error) {
	switch {
	case opts.Authority == nil:
		return nil, fmt.Errorf("%w: an Authority is required", ErrBadOptions)
	case opts.Device < 0:
		return nil, fmt.Errorf("%w: ordinal %d", ErrBadDevice, opts.Device)
	case opts.Low < 0 || opts.High < 0:
		return nil, fmt.Errorf("%w: negative water mark (Low %d, High %d)", ErrBadOptions, opts.Low, opts.High)
	case opts.High > 0 && opts.Low > opts.High:
		return nil, fmt.Errorf("%w: Low %d above High %d", ErrBadOptions, opts.Low, opts.High)
	case opts.Authority.Device() != accounting.GPU(opts.Device):
		return nil, fmt.Errorf("%w: authority %q takes bytes on %v, not %v", ErrBadOptions,
			opts.Authority.Name(), opts.Authority.Device(), accounting.GPU(opts.Device))
	}
	drv := opts.Driver
	if drv == nil {
		var err error
		if drv, err = LoadDriver(); err != nil {
			return nil, err
		}
	} else if err := drv.checkComplete(); err != nil {
		return nil, err
	}

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if opts.Exportable {
		if !posixFDs {
			return nil, fmt.Errorf("%w: not on this system", ErrNoExport)
		}
		if err := drv.checkExport(); err != nil {
			return nil, err
		}
	}
	b := &Backing{drv: drv, ordinal: opts.Device, auth: opts.Authority, low: opts.Low, high: opts.High,
		log: opts.Logger, export: opts.Exportable}
	b.settled.L = &b.mu
	if err := b.open(); err != nil {
		return nil, err
	}
	if opts.Background {
		b.refill = make(chan struct{}, 1)
		b.stop = make(chan struct{})
		b.done = make(chan struct{})
		go b.refiller()
		b.nudge()
	} else if b.low > 0 {
		// Best effort: a budget that can not cover Low is not an error here.
		if err := b.fill(b.low, false); err != nil && !errors.Is(err, accounting.ErrBudgetExceeded) {
			_, rerr := b.releaseIdle(0)
			b.drv.DevicePrimaryCtxRelease(b.dev)
			return nil, errors.Join(fmt.Errorf("cuda: filling the pool: %w", err), rerr)
		}
	}
	b.auth.SetReclaimer(b.reclaim)
	return b, nil
}

// open initialises the driver and the device and retains the primary context. The
// calling goroutine must be locked to its thread.
func (b *Backing) open() error {
	d := b.drv
	switch c := d.Init(0); c {
	case Success:
	case CodeStubLibrary:
		return fmt.Errorf("%w (%w)", ErrStubLibrary, d.call("cuInit", c))
	case CodeNoDevice:
		return fmt.Errorf("%w (%w)", ErrNoDevice, d.call("cuInit", c))
	default:
		return d.call("cuInit", c)
	}
	var count int32
	if err := d.call("cuDeviceGetCount", d.DeviceGetCount(&count)); err != nil {
		return err
	}
	if count == 0 {
		return ErrNoDevice
	}
	if b.ordinal >= int(count) {
		return fmt.Errorf("%w: ordinal %d, %d devices", ErrBadDevice, b.ordinal, count)
	}
	switch c := d.DeviceGet(&b.dev, int32(b.ordinal)); c {
	case Success:
	case CodeInvalidDevice:
		return fmt.Errorf("%w: ordinal %d (%w)", ErrBadDevice, b.ordinal, d.call("cuDeviceGet", c))
	default:
		return d.call("cuDeviceGet", c)
	}
	var vmm int32
	if err := d.call("cuDeviceGetAttribute", d.DeviceGetAttribute(&vmm, AttrVMMSupported, b.dev)); err != nil {
		return err
	}
	if vmm == 0 {
		return fmt.Errorf("%w: device %d", ErrNoVMM, b.ordinal)
	}
	if d.DriverGetVersion(&b.version) != Success {
		b.version = 0 // only reported, never relied on
	}
	b.prop = deviceProp(b.dev)
	if b.export {
		var fd int32
		if err := d.call("cuDeviceGetAttribute", d.DeviceGetAttribute(&fd, AttrPosixFDSupported, b.dev)); err != nil {
			return err
		}
		if fd == 0 {
			return fmt.Errorf("%w: device %d", ErrNoExport, b.ordinal)
		}
		b.prop.RequestedHandleTypes = HandleTypePosixFD
	}
	b.rw = MemAccessDesc{Location: b.prop.Location, Flags: AccessReadWrite}
	b.ro = MemAccessDesc{Location: b.prop.Location, Flags: AccessRead}
	g, err := b.granularity()
	if err != nil {
		return err
	}
	b.gran = g
	if err := d.call("cuDevicePrimaryCtxRetain", d.DevicePrimaryCtxRetain(&b.ctx, b.dev)); err != nil {
		return err
	}
	if err := b.setCurrent(); err != nil {
		d.DevicePrimaryCtxRelease(b.dev)
		return err
	}
	return nil
}

// granularity queries the minimum and recommended granularity and returns the
// recommended one when it is a multiple of the minimum (it is on every GPU seen so
// far), else the minimum.
func (b *Backing) granularity() (int, error) {
	var lo, rec uintptr
	d := b.drv
	if err := d.call("cuMemGetAllocationGranularity", d.MemGetAllocationGranularity(&lo, &b.prop, GranularityMinimum)); err != nil {
		return 0, err
	}
	if err := d.call("cuMemGetAllocationGranularity", d.MemGetAllocationGranularity(&rec, &b.prop, GranularityRecommended)); err != nil {
		return 0, err
	}
	g := lo
	if rec > 0 && lo > 0 && rec%lo == 0 {
		g = rec
	}
	if g == 0 || g&(g-1) != 0 || g > 1<<40 {
		return 0, fmt.Errorf("%w: minimum %d, recommended %d", ErrBadGranularity, lo, rec)
	}
	return int(g), nil
}

// setCurrent makes the primary context current on the calling thread, which must be
// locked (runtime.LockOSThread) for as long as the driver calls that follow.
func (b *Backing) setCurrent() error {
	return b.drv.call("cuCtxSetCurrent", b.drv.CtxSetCurrent(b.ctx))
}

// live panics if b was closed.
func (b *Backing) live() {
	if b.closed.Load() {
		panic(PanicClosed)
	}
}

// Granularity returns the granule size: the driver's recommended allocation
// granularity (2 MiB on current GPUs).
func (b *Backing) Granularity() int { return b.gran }

// Device returns accounting.GPU(ordinal).
func (b *Backing) Device() accounting.DeviceKey { return accounting.GPU(b.ordinal) }

// Accounting returns ByBacking with the pool's authority.
func (b *Backing) Accounting() backing.PhysicalAccounting { return backing.ByBacking(b.auth) }

// CommitZeroes returns false: a pooled handle keeps what its last user wrote.
func (b *Backing) CommitZeroes() bool { return false }

// DriverVersion returns what cuDriverGetVersion reported (12060 for CUDA 12.6), or 0.
func (b *Backing) DriverVersion() int { return int(b.version) }

// use checks that r is a live reservation of b.
func (b *Backing) use(op string, r *Reservation) error {
	b.live()
	if r == nil || r.b != b {
		return &backing.OpError{Op: op, Kind: backing.ErrForeignReservation}
	}
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	return nil
}

// Reserve moves size bytes of device address space from Unreserved to Reserved,
// aligned to the granularity (cuMemAddressReserve). The reservation MUST be given back
// with Unreserve. What it costs the heap grows with what is committed in it, not with
// its size. Where the driver's address space is short it answers
// CUDA_ERROR_OUT_OF_MEMORY, which matches backing.ErrOutOfMemory; a size past 2^27
// granules (256 TiB at 2 MiB) gets that error before the driver is asked.
func (b *Backing) Reserve(size int) (*Reservation, error) {
	b.live()
	if err := backing.CheckReserve(size, b.gran); err != nil {
		return nil, err
	}
	if n := size / b.gran; n > maxChunks*chunkSlots {
		return nil, &backing.OpError{Op: "reserve", Size: size, Kind: backing.ErrOutOfMemory,
			Err: fmt.Errorf("cuda: %d granules is past any device's address space (at most %d)", n, maxChunks*chunkSlots)}
	}
	r := &Reservation{b: b, size: size}
	if size > 0 {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := b.setCurrent(); err != nil {
			return nil, opError("reserve", 0, size, err)
		}
		d := b.drv
		if err := d.call("cuMemAddressReserve", d.MemAddressReserve(&r.base, uintptr(size), uintptr(b.gran), 0, 0)); err != nil {
			return nil, opError("reserve", 0, size, err)
		}
		if r.base%uint64(b.gran) != 0 {
			ferr := d.call("cuMemAddressFree", d.MemAddressFree(r.base, uintptr(size)))
			return nil, opError("reserve", 0, size, errors.Join(
				fmt.Errorf("cuda: driver returned %#x, not aligned to %d", r.base, b.gran), ferr))
		}
		r.slots = newSlotTable(size / b.gran)
	}
	b.mu.Lock()
	b.nres++
	if invariants.Enabled {
		b.checkCountsLocked()
	}
	b.mu.Unlock()
	invariants.Track(&r.leak, r, "cuda.Reservation")
	return r, nil
}

// Base returns the reservation's first device address. It never changes and must
// never be dereferenced on the CPU. An empty reservation's base is 0.
func (b *Backing) Base(r *Reservation) uintptr {
	if r == nil {
		panic(PanicNilReservation)
	}
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	return uintptr(r.base)
}

// Size returns the reserved size in bytes.
func (b *Backing) Size(r *Reservation) int {
	if r == nil {
		panic(PanicNilReservation)
	}
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	return r.size
}

// check validates [off, off+size) of r for op: r live and b's, the range granule
// aligned and inside.
func (b *Backing) check(op string, r *Reservation, off, size int) error {
	if err := b.use(op, r); err != nil {
		return err
	}
	return backing.CheckRange(op, off, size, r.size, b.gran)
}

// state returns an error unless every granule of [off, off+size) is committed (want
// true) or reserved (want false). r.mu must be held.
func (r *Reservation) state(op string, off, size int, want bool) error {
	g := r.b.gran
	bad := -1
	for i, end := off/g, (off+size)/g; i < end && bad < 0; {
		s, next := r.slots.run(i, end)
		switch {
		case s == nil && want:
			bad = i
		case s != nil:
			for k := range s {
				if (s[k].h != nil) != want {
					bad = i + k
					break
				}
			}
		}
		i = next
	}
	if bad < 0 {
		return nil
	}
	kind := backing.ErrCommitted
	if want {
		kind = backing.ErrNotCommitted
	}
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: fmt.Errorf("granule at %#x", bad*g)}
}

// Commit moves [off, off+size) from Reserved to Committed: it maps one pooled handle
// per granule (creating handles only when the pool is empty, each charged to the
// authority with TryAcquire first) and grants read-write access with one
// cuMemSetAccess over the whole range. A budget refusal returns an error matching
// accounting.ErrBudgetExceeded and changes nothing; a driver failure is rolled back
// (what was mapped is unmapped, the handles return to the pool). The contents are
// whatever the handle's last user left (CommitZeroes is false).
func (b *Backing) Commit(r *Reservation, off, size int) error {
	return b.commit(context.Background(), false, r, off, size)
}

// CommitCtx is Commit that, when the budget can not cover the handles it must create,
// waits in FIFO order on the authority (Authority.AcquireIdle: handles that come back
// to the pool serve it as free budget does) until ctx ends. A cancelled wait returns
// ctx's error and changes nothing.
func (b *Backing) CommitCtx(ctx context.Context, r *Reservation, off, size int) error {
	if ctx == nil {
		panic("cuda: CommitCtx with a nil context")
	}
	return b.commit(ctx, true, r, off, size)
}

// commit is Commit, and CommitCtx when wait is set: only then does it wait for the
// budget, until ctx ends.
func (b *Backing) commit(ctx context.Context, wait bool, r *Reservation, off, size int) error {
	const op = "commit"
	if err := b.check(op, r, off, size); err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	r.mu.Lock()
	err := r.state(op, off, size, false)
	r.mu.Unlock()
	if err != nil {
		return err
	}
	if wait {
		if err := ctx.Err(); err != nil {
			return err
		}
	}

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError(op, off, size, err)
	}
	// Gather the handles before locking r: waiting for budget with r locked would
	// block the very decommits that could free it.
	hs, err := b.getHandles(ctx, wait, size/b.gran)
	if err != nil {
		if wait && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return err
		}
		return opError(op, off, size, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		b.putIdle(hs)
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := r.state(op, off, size, false); err != nil {
		b.putIdle(hs) // a racing overlapping commit won
		return err
	}
	if err := b.mapRun(r, off, hs, false); err != nil {
		b.putIdle(b.unmapped(hs))
		return opError(op, off, size, err)
	}
	b.nudgeIfLow()
	return nil
}

// mapRun maps hs at consecutive granules of r from off, then grants access with one
// cuMemSetAccess over the run (read-only when ro), and records the mappings. On
// failure it unmaps what it mapped; a granule the rollback can not unmap stays
// recorded as committed (read-only, so nothing writes to a mapping without access)
// so that Decommit or Unreserve can give it back later. r.mu must be held and the
// thread bound.
func (b *Backing) mapRun(r *Reservation, off int, hs []*handle, ro bool) error {
	d := b.drv
	g := uint64(b.gran)
	va := r.base + uint64(off)
	for i, h := range hs {
		if err := d.call("cuMemMap", d.MemMap(va+uint64(i)*g, uintptr(g), 0, h.h, 0)); err != nil {
			return errors.Join(err, b.rollback(r, off, hs[:i]))
		}
	}
	desc := &b.rw
	if ro && !b.noReadOnly.Load() {
		desc = &b.ro
	}
	c := d.MemSetAccess(va, uintptr(len(hs))*uintptr(g), desc, 1)
	if c == CodeNotSupported && desc == &b.ro {
		// A driver without read-only device mappings: map read-write and let the
		// Go side alone refuse writes (the slots are marked read-only either way).
		b.readOnlyRefused()
		c = d.MemSetAccess(va, uintptr(len(hs))*uintptr(g), &b.rw, 1)
	}
	if err := d.call("cuMemSetAccess", c); err != nil {
		return errors.Join(err, b.rollback(r, off, hs))
	}
	b.record(r, off, hs, ro)
	return nil
}

// rollback unmaps hs, just mapped at off of r: one call for the run, then granule by
// granule if that fails. It records what stays mapped and returns why.
func (b *Backing) rollback(r *Reservation, off int, hs []*handle) error {
	if len(hs) == 0 {
		return nil
	}
	d := b.drv
	g := b.gran
	va := r.base + uint64(off)
	if d.MemUnmap(va, uintptr(len(hs)*g)) == Success {
		return nil
	}
	var errs []error
	for i, h := range hs {
		if err := d.call("cuMemUnmap", d.MemUnmap(va+uint64(i*g), uintptr(g))); err != nil {
			b.record(r, off+i*g, []*handle{h}, true)
			errs = append(errs, fmt.Errorf("cuda: rollback left granule at %#x mapped: %w", off+i*g, err))
		}
	}
	return errors.Join(errs...)
}

// record notes hs as mapped at off of r. r.mu must be held.
func (b *Backing) record(r *Reservation, off int, hs []*handle, ro bool) {
	r.slots.set(off/b.gran, hs, ro)
	n := int64(len(hs)) * int64(b.gran)
	b.mu.Lock()
	for _, h := range hs {
		h.refs++
	}
	b.mapped += n
	b.mu.Unlock()
	b.auth.Map(n)
}

// unmapped returns the handles of hs that are mapped nowhere.
func (b *Backing) unmapped(hs []*handle) []*handle {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := hs[:0:0]
	for _, h := range hs {
		if h.refs == 0 {
			out = append(out, h)
		}
	}
	return out
}

// Decommit moves [off, off+size) from Committed to Reserved with one cuMemUnmap over
// the range (whole mappings only); the contents are forfeit. Each handle whose last
// mapping this was returns to the pool, or is released when the pool is above High.
// On error nothing changed.
func (b *Backing) Decommit(r *Reservation, off, size int) error {
	const op = "decommit"
	if err := b.check(op, r, off, size); err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.state(op, off, size, true); err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError(op, off, size, err)
	}
	if err := b.drv.call("cuMemUnmap", b.drv.MemUnmap(r.base+uint64(off), uintptr(size))); err != nil {
		return opError(op, off, size, err)
	}
	b.drop(r, off/b.gran, size/b.gran)
	return nil
}

// drop forgets the n mappings of r from granule first, which are unmapped, and
// returns the handles whose last mapping they were to the pool, or releases them when
// they were exported or imported (export.go). r.mu must be held and the thread bound.
func (b *Backing) drop(r *Reservation, first, n int) {
	var free, gone, foreign []*handle
	b.mu.Lock()
	for i := first; i < first+n; {
		s, next := r.slots.run(i, first+n)
		for k := range s {
			h := s[k].h
			s[k] = slot{}
			if h.refs <= 0 {
				b.mu.Unlock()
				panic(PanicHandleRefs)
			}
			h.refs--
			switch {
			case h.refs > 0:
			case h.imported:
				foreign = append(foreign, h)
			case h.exported:
				gone = append(gone, h)
			default:
				free = append(free, h)
			}
		}
		r.slots.cleared(i, len(s))
		i = next
	}
	bytes := int64(n) * int64(b.gran)
	b.mapped -= bytes
	b.mu.Unlock()
	b.auth.Unmap(bytes)
	b.putIdle(free)
	if len(gone) > 0 {
		// A handle the driver refuses to release stays owned (stuck), as in
		// addIdle; the caller's unmap succeeded.
		_, _ = b.release(gone)
	}
	b.releaseImported(foreign)
}

// Unreserve unmaps everything still committed in r (one cuMemUnmap per contiguous
// run of mappings) and frees the address range (cuMemAddressFree). The outcome is
// honest: Complete; Failed when nothing changed (r is still valid); Quarantined when a
// step failed midway: Unmapped says the bytes of mappings given back, Residual the
// bytes still mapped (their handles stay owned by the pool for good), and r is
// unusable.
func (b *Backing) Unreserve(r *Reservation) accounting.ReleaseOutcome {
	const op = "unreserve"
	if err := b.use(op, r); err != nil {
		return accounting.FailedRelease(0, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	g := b.gran
	var held int64
	for _, c := range r.slots.c {
		if c != nil {
			held += int64(c.n) * int64(g)
		}
	}
	if r.size > 0 {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := b.setCurrent(); err != nil {
			return accounting.FailedRelease(held, opError(op, 0, r.size, err))
		}
	}
	d := b.drv
	var unmapped int64
	var errs []error
	for from := 0; from < r.slots.n; {
		i, j := r.slots.nextMapped(from)
		if i == j {
			break
		}
		if d.MemUnmap(r.base+uint64(i*g), uintptr((j-i)*g)) == Success {
			b.drop(r, i, j-i)
			unmapped += int64((j - i) * g)
		} else {
			// One bad mapping must not strand the rest of the run.
			for k := i; k < j; k++ {
				if err := d.call("cuMemUnmap", d.MemUnmap(r.base+uint64(k*g), uintptr(g))); err != nil {
					errs = append(errs, fmt.Errorf("granule at %#x: %w", k*g, err))
					continue
				}
				b.drop(r, k, 1)
				unmapped += int64(g)
			}
		}
		from = j
	}
	residual := held - unmapped
	if residual == 0 && r.size > 0 {
		if err := d.call("cuMemAddressFree", d.MemAddressFree(r.base, uintptr(r.size))); err != nil {
			errs = append(errs, err)
		}
	}
	var err error
	if len(errs) > 0 {
		err = opError(op, 0, r.size, errors.Join(errs...))
	}
	out := accounting.Outcome(unmapped, residual, unmapped > 0, err)
	if out.Status == accounting.Quarantined {
		b.auth.Quarantine(out.Residual, out.Err)
	}
	if out.Status != accounting.Failed {
		r.dead.Store(true)
		r.leak.Close()
		b.mu.Lock()
		b.nres--
		if invariants.Enabled {
			b.checkCountsLocked()
		}
		b.mu.Unlock()
	}
	return out
}

// Share moves [dstOff, dstOff+size) of dst from Reserved to Committed by mapping the
// handles committed at [srcOff, srcOff+size) of src, with one cuMemSetAccess over the
// run (PROT_READ for backing.ReadOnly). Each handle's reference count grows by one;
// it returns to the pool with its last mapping. On error nothing changed. Writes
// through this package's helpers to a read-only share fail with ErrReadOnly; where
// the driver does not support read-only device mappings (CUDA_ERROR_NOT_SUPPORTED),
// the mapping is read-write and that Go-side check is the only guard. ReadWrite is
// refused with ErrReadOnly (which matches backing.ErrReadOnly) when a source granule
// is read-only in src (shared so, or protected): protection is per mapping, and
// read-only memory must not yield a writable mapping elsewhere.
//
// NB: the driver only guarantees that a write through one mapping is visible through
// another once the writing operation completed (Synchronize).
func (b *Backing) Share(dst *Reservation, dstOff int, src *Reservation, srcOff, size int, prot backing.Protection) error {
	const op = "share"
	if err := b.check(op, src, srcOff, size); err != nil {
		return err
	}
	if err := b.check(op, dst, dstOff, size); err != nil {
		return err
	}
	if prot != backing.ReadWrite && prot != backing.ReadOnly {
		return &backing.OpError{Op: op, Offset: dstOff, Size: size, Err: fmt.Errorf("cuda: unknown protection %d", prot)}
	}
	if size == 0 {
		return nil
	}
	unlock := lockPair(dst, src)
	defer unlock()
	if src.dead.Load() || dst.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := src.state(op, srcOff, size, true); err != nil {
		return err
	}
	if err := dst.state(op, dstOff, size, false); err != nil {
		return err
	}
	first := srcOff / b.gran
	hs := make([]*handle, 0, size/b.gran)
	for i, end := first, first+size/b.gran; i < end; {
		s, next := src.slots.run(i, end) // committed: never nil
		for k := range s {
			if prot == backing.ReadWrite && s[k].ro {
				return &backing.OpError{Op: op, Offset: dstOff, Size: size, Kind: backing.ErrReadOnly,
					Err: fmt.Errorf("%w: source granule at %#x is read-only in its reservation", ErrReadOnly, (i+k)*b.gran)}
			}
			hs = append(hs, s[k].h)
		}
		i = next
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError(op, dstOff, size, err)
	}
	if err := b.mapRun(dst, dstOff, hs, prot == backing.ReadOnly); err != nil {
		return opError(op, dstOff, size, err)
	}
	return nil
}

// lockPair locks the mutexes of a and b (once if they are the same reservation) in a
// fixed order, and returns the unlock.
func lockPair(a, b *Reservation) func() {
	if a == b {
		a.mu.Lock()
		return a.mu.Unlock
	}
	if a.base > b.base || (a.base == b.base && a.size > b.size) {
		a, b = b, a
	}
	a.mu.Lock()
	b.mu.Lock()
	return func() { b.mu.Unlock(); a.mu.Unlock() }
}

// Protect sets the access of the committed range [off, off+size) of r to prot with one
// cuMemSetAccess over the range (PROT_READ for backing.ReadOnly, PROT_READWRITE for
// backing.ReadWrite), and nothing at all when every granule has it already. The
// handles, their contents and their other mappings are untouched. ReadWrite is
// refused with ErrReadOnly (which matches backing.ErrReadOnly) on a range holding a
// granule shared into r read-only.
//
// Writes through this package's helpers (CopyIn, Memset, CopyDtoD) to a read-only
// range fail with ErrReadOnly. A kernel's write faults on the device where the driver
// grants read-only access; where it does not (cuMemSetAccess answers
// CUDA_ERROR_NOT_SUPPORTED, as for read-only shares) the mapping stays read-write and
// the Go-side check is the only guard. On error nothing changed, but where the access
// call failed and restoring the old access failed too: that range is then recorded
// read-only, which the helpers honour, and the error says so.
func (b *Backing) Protect(r *Reservation, off, size int, prot backing.Protection) error {
	const op = "protect"
	if err := b.check(op, r, off, size); err != nil {
		return err
	}
	if prot != backing.ReadWrite && prot != backing.ReadOnly {
		return &backing.OpError{Op: op, Offset: off, Size: size, Err: fmt.Errorf("cuda: unknown protection %d", prot)}
	}
	if size == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := r.state(op, off, size, true); err != nil {
		return err
	}
	g := b.gran
	ro := prot == backing.ReadOnly
	first, n := off/g, size/g
	same := true
	for i := first; i < first+n; {
		s, next := r.slots.run(i, first+n) // committed: never nil
		for k := range s {
			if !ro && s[k].shared {
				return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrReadOnly,
					Err: fmt.Errorf("%w: granule at %#x is shared read-only into this reservation", ErrReadOnly, (i+k)*g)}
			}
			same = same && s[k].ro == ro
		}
		i = next
	}
	if same {
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError(op, off, size, err)
	}
	if err := b.setAccess(r.base+uint64(off), size, ro); err != nil {
		err = opError(op, off, size, err)
		// NB: the driver does not say whether a failed call changed part of the
		// range: give each run its old access back.
		for i := first; i < first+n; {
			was := r.slots.at(i).ro
			j := i + 1
			for j < first+n && r.slots.at(j).ro == was {
				j++
			}
			if rerr := b.setAccess(r.base+uint64(i*g), (j-i)*g, was); rerr != nil {
				r.slots.setReadOnly(i, j, true)
				err = fmt.Errorf("%w; restoring the access of [%#x, +%#x) failed, it is recorded read-only: %w",
					err, i*g, (j-i)*g, opError(op, i*g, (j-i)*g, rerr))
			}
			i = j
		}
		return err
	}
	r.slots.setReadOnly(first, first+n, ro)
	return nil
}

// setAccess grants read-only or read-write access to the n mapped bytes at va. Where
// the driver refuses read-only device mappings it leaves them read-write and says
// nothing: the Go side guards them. The thread must be bound.
func (b *Backing) setAccess(va uint64, n int, ro bool) error {
	if ro && b.noReadOnly.Load() {
		return nil
	}
	desc := &b.rw
	if ro {
		desc = &b.ro
	}
	c := b.drv.MemSetAccess(va, uintptr(n), desc, 1)
	if c == CodeNotSupported && ro {
		b.readOnlyRefused()
		return nil
	}
	return b.drv.call("cuMemSetAccess", c)
}
