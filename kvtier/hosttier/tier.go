package hosttier

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/nocopy"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

// A value's life cycle. Every value owns one run of granules of the region (none when
// it is empty) from the moment its store takes room until the run is given back:
//
//  1. Filling: Store took the run (evicting what it had to) and charged what it had to
//     commit; fill writes into it without the lock. Not visible to Load or Contains.
//  2. Held: fill returned nil; the value is in the index and the LRU list. Load lends
//     it to use calls, counting readers.
//  3. Doomed: evicted, replaced or deleted while readers still read it: out of the
//     index and the list, its run kept until the last reader leaves.
//  4. Free: its run is back in the free space, still committed (warm) until Trim or
//     Close decommits it.
//
// Transitions: Filling → Held (fill succeeded) or Free (fill failed); Held → Free
// (evicted, replaced, deleted with no reader) or Doomed (with readers); Doomed → Free
// (last reader left).
type state uint8

const (
	filling state = iota
	held
	doomed
)

// Defaults.
const (
	defaultGranule  = 64 << 10
	defaultPinChunk = 1 << 30
	tierName        = "host"
)

// Options configure a Tier.
type Options struct {
	// Budget is the most bytes of host memory the tier holds: its region, rounded down
	// to whole granules. Required.
	Budget int64
	// Authority is the ledger the tier charges the memory it commits to. It must take
	// bytes on a device of tier accounting.HostTier. nil: the tier makes a governor of
	// its own with device accounting.HostTier:0 limited to Budget.
	Authority *accounting.Authority
	// Granule is the unit the tier commits and hands out in bytes: a power of two and
	// a multiple of the page size; 0 means 64 KiB. A value takes whole granules, so at
	// most one granule less a byte is lost per value.
	Granule int
	// NoEvict makes a full tier refuse a store with ErrFull instead of evicting its
	// least recently used values.
	NoEvict bool
	// CgroupRoot is where the cgroup file systems are mounted, and CgroupSelf the file
	// naming the process's cgroups; "" means /sys/fs/cgroup and /proc/self/cgroup.
	// On Linux, New refuses a Budget above what the tightest memory cgroup of the
	// process leaves free (ErrCgroup). Elsewhere the check runs only when CgroupRoot
	// is set (tests).
	CgroupRoot, CgroupSelf string
	// CUDA, when set, makes the tier one of pinned host memory below that device: New
	// commits (without populating) the whole region at once, a goroutine pins it (Backing.PinHost) in
	// pieces of PinChunk bytes, and the tier keeps a stream of its own (Stream) for
	// the device's copies into and out of its values. Until a piece is pinned its
	// values are plain pageable memory: copies still work, staged by the driver.
	CUDA *cuda.Backing
	// PinChunk is the size of each registration the pinning goroutine makes: 0 means
	// 1 GiB (about 0.1 s of pinning each); at most cuda.MaxPinChunk.
	PinChunk int
}

// Tier is a kv.Tier in host memory the Go collector never scans or moves: one
// reserved region of address space, committed in granules on demand and charged to
// its own budget. Values are kept whole in runs of granules; when a store finds no
// room, the least recently stored or loaded values are evicted until it fits, or, with
// NoEvict, the store is refused.
//
// A Tier is safe for concurrent use. It MUST be closed with Close, which gives every
// byte back to the OS and the ledger.
type Tier struct {
	_ nocopy.NoCopy

	priv   *host.Private
	res    *host.PrivateReservation
	base   uintptr
	gran   int
	region int64
	auth   *accounting.Authority
	evict  bool
	pin    *pinner      // nil without CUDA
	stream *cuda.Stream // nil without CUDA

	mu      sync.Mutex
	closed  bool
	ops     int       // Store, Load, Contains and Delete calls in progress
	idle    sync.Cond // on mu: signalled when ops drops to 0 during Close
	index   map[tierval.Key]*entry
	lru     entry // sentinel: lru.next is the most recently used
	sp      space
	held    int64 // committed bytes, charged to auth
	values  int
	vbytes  int64
	counter Stats
}

// entry is one value: see the life cycle above.
type entry struct {
	key        tierval.Key
	r          run
	size       int
	st         state
	readers    int
	prev, next *entry
}

// Stats is a snapshot of a Tier.
type Stats struct {
	Hits      int64 // loads that found their key
	Misses    int64 // loads that did not
	Stores    int64 // values kept
	Evictions int64 // values evicted to make room
	Refusals  int64 // stores refused: too large, full, or the budget refused
	// StoredBytes and LoadedBytes count value bytes stored and lent to use since New.
	StoredBytes, LoadedBytes int64
	Values                   int   // values held now
	ValueBytes               int64 // their bytes
	Held                     int64 // bytes of host memory committed and charged now
	Budget                   int64 // the region: the most Held can be
	Pinned                   int64 // bytes of the region pinned for the device so far
}

var _ kv.Tier = (*Tier)(nil)

// New reserves the tier's region and returns an empty Tier (with CUDA, the whole
// region committed and being pinned). Errors: ErrBadOptions, ErrCgroup, a
// *accounting.BudgetError when the ledger refuses the eager commit, or the host
// backing's error.
func New(opts Options) (*Tier, error) {
	if opts.Granule == 0 {
		opts.Granule = defaultGranule
	}
	if opts.PinChunk == 0 {
		opts.PinChunk = defaultPinChunk
	}
	switch {
	case opts.Budget <= 0:
		return nil, fmt.Errorf("%w: budget %d bytes", ErrBadOptions, opts.Budget)
	case opts.Granule < 0 || opts.Granule&(opts.Granule-1) != 0:
		return nil, fmt.Errorf("%w: granule %d is not a power of two", ErrBadOptions, opts.Granule)
	case opts.Budget < int64(opts.Granule):
		return nil, fmt.Errorf("%w: budget %d bytes is below one granule (%d)", ErrBadOptions, opts.Budget, opts.Granule)
	case opts.PinChunk < 0 || opts.PinChunk > cuda.MaxPinChunk:
		return nil, fmt.Errorf("%w: pin chunk %d bytes (at most %d)", ErrBadOptions, opts.PinChunk, cuda.MaxPinChunk)
	case opts.Authority != nil && opts.Authority.Device().Tier != accounting.HostTier:
		return nil, fmt.Errorf("%w: authority %q takes bytes on %v, not on a %v device", ErrBadOptions,
			opts.Authority.Name(), opts.Authority.Device(), accounting.HostTier)
	}
	if cgroupByDefault || opts.CgroupRoot != "" {
		if err := checkCgroup(opts.CgroupRoot, opts.CgroupSelf, opts.Budget); err != nil {
			return nil, err
		}
	}
	region := opts.Budget / int64(opts.Granule) * int64(opts.Granule)
	auth := opts.Authority
	if auth == nil {
		g := accounting.NewGovernor()
		dev := accounting.DeviceKey{Tier: accounting.HostTier}
		if err := g.SetLimit(dev, opts.Budget); err != nil {
			return nil, err
		}
		auth = g.Authority("hosttier", dev)
	}
	// Commits do not populate their pages: a store's fill faults them in by its copy
	// (one fault per huge page where the region takes them, else per 4 KiB page).
	// MADV_POPULATE_WRITE makes a store's first use of a granule cheaper (here 0.57
	// ms against 0.97 ms per 2 MiB, BenchmarkColdStore; later stores reuse resident
	// granules), but it holds the process's memory-map lock while it zeroes, and
	// every mmap, munmap and mprotect of the process, a cache committing its next
	// granule on the token path among them, waits for it, even when it populates 64
	// KiB at a time (kvtier/filetier's BenchmarkDecodeStep, tier=host, grow-ns/op:
	// -71% without it); a fault holds only the lock of the tier's own mapping. A
	// CUDA tier's pinning, in the background, makes its pages resident.
	priv, err := host.NewPrivate(host.PrivateOptions{Granularity: opts.Granule, Name: "vmarena-hosttier"})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadOptions, err)
	}
	res, err := priv.Reserve(int(region))
	if err != nil {
		return nil, err
	}
	t := &Tier{priv: priv, res: res, base: priv.Base(res), gran: opts.Granule, region: region, auth: auth,
		evict: !opts.NoEvict, index: make(map[tierval.Key]*entry), sp: newSpace(int(region / int64(opts.Granule)))}
	t.idle.L = &t.mu
	t.lru.next, t.lru.prev = &t.lru, &t.lru
	if opts.CUDA != nil {
		if err := t.startCUDA(opts.CUDA, opts.PinChunk); err != nil {
			return nil, errors.Join(err, t.release())
		}
	}
	return t, nil
}

// MaxValueSize returns the largest value the tier holds: its whole region.
func (t *Tier) MaxValueSize() int { return int(t.region) }

// Name returns "host".
func (t *Tier) Name() string { return tierName }

// InProcess returns true: the tier's values live in this process's memory, so a
// cache leaves their payloads out of its values' checksums (kv.InProcessTier).
func (t *Tier) InProcess() bool { return true }

var _ kv.InProcessTier = (*Tier)(nil)

// enter counts an operation in. t.mu must be held; after Close it unlocks t.mu and
// panics.
func (t *Tier) enter() {
	if t.closed {
		t.mu.Unlock()
		panic(PanicClosed)
	}
	t.ops++
}

// leave counts an operation out. t.mu must be held.
func (t *Tier) leave() {
	t.ops--
	if t.ops == 0 && t.closed {
		t.idle.Broadcast()
	}
}

// Store keeps a value of size bytes under key, replacing any value held there. fill
// is called once, without the tier's lock, with size bytes of the tier's own memory
// (pinned host memory once a CUDA tier's pinning has reached it); the value is kept
// only if fill returns nil, and fill's error is Store's. When there is no room the
// least recently used values that nobody is reading are evicted until it fits (with
// NoEvict, or when none can go, Store fails with ErrFull). A value larger than the
// tier is ErrTooLarge, a negative size ErrBadSize, and a refusal of the ledger a
// *accounting.BudgetError; each is counted in Stats.Refusals.
func (t *Tier) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	if fill == nil {
		panic(PanicNilFunc)
	}
	if size < 0 {
		return fmt.Errorf("%w: %d", ErrBadSize, size)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	t.enter()
	e, cold, err := t.room(key, size)
	t.mu.Unlock()
	if err != nil {
		t.mu.Lock()
		t.counter.Refusals++
		t.leave()
		t.mu.Unlock()
		return err
	}
	kept := false
	defer func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		defer t.leave()
		if !kept {
			t.give(e.r)
			return
		}
		t.keep(e)
	}()
	if err := t.commit(e, cold); err != nil {
		return err
	}
	if err := fill(t.bytes(e)); err != nil {
		return err
	}
	kept = true
	return nil
}

// room takes a run for a value of size bytes, evicting as needed, and charges the
// granules of it that are not committed (cold, returned to be committed by the
// caller). t.mu must be held.
func (t *Tier) room(key tierval.Key, size int) (*entry, []run, error) {
	n := (size + t.gran - 1) / t.gran
	if int64(n)*int64(t.gran) > t.region {
		return nil, nil, fmt.Errorf("%w: %d bytes, the tier holds %d", ErrTooLarge, size, t.region)
	}
	e := &entry{key: key, size: size, st: filling}
	if n == 0 {
		return e, nil, nil
	}
	var lastErr error
	for {
		if r, ok := t.sp.take(n); ok {
			cold := t.sp.cold(r)
			need := 0
			for _, c := range cold {
				need += c.n
			}
			err := t.auth.TryAcquire(int64(need) * int64(t.gran))
			if err == nil {
				t.held += int64(need) * int64(t.gran)
				e.r = r
				return e, cold, nil
			}
			t.sp.give(r)
			lastErr = err
		}
		if !t.evict || !t.evictOne() {
			if lastErr != nil {
				return nil, nil, lastErr
			}
			return nil, nil, fmt.Errorf("%w: no run of %d granules free and nothing to evict", ErrFull, n)
		}
	}
}

// evictOne drops the least recently used value nobody reads; false when there is none.
// t.mu must be held.
func (t *Tier) evictOne() bool {
	for e := t.lru.prev; e != &t.lru; e = e.prev {
		if e.readers == 0 {
			t.drop(e)
			t.counter.Evictions++
			return true
		}
	}
	return false
}

// commit commits the cold runs of e's run, which room charged; on error it gives the
// charge of what it did not commit back. Called without t.mu: the run is e's alone.
func (t *Tier) commit(e *entry, cold []run) error {
	for i, c := range cold {
		if err := t.priv.Commit(t.res, c.off*t.gran, c.n*t.gran); err != nil {
			t.mu.Lock()
			for _, done := range cold[:i] {
				t.sp.setCommitted(done, true)
			}
			var lost int64
			for _, left := range cold[i:] {
				lost += int64(left.n) * int64(t.gran)
			}
			t.held -= lost
			t.auth.Release(lost)
			t.mu.Unlock()
			return err
		}
	}
	if len(cold) > 0 {
		t.mu.Lock()
		for _, c := range cold {
			t.sp.setCommitted(c, true)
		}
		t.mu.Unlock()
	}
	return nil
}

// keep makes a filled value Held, replacing the one under its key. t.mu must be held.
func (t *Tier) keep(e *entry) {
	if old := t.index[e.key]; old != nil {
		t.drop(old)
	}
	e.st = held
	t.index[e.key] = e
	t.push(e)
	t.values++
	t.vbytes += int64(e.size)
	t.counter.Stores++
	t.counter.StoredBytes += int64(e.size)
}

// drop takes a Held value out of the index and the list: Free at once, or Doomed
// until its readers leave. t.mu must be held.
func (t *Tier) drop(e *entry) {
	delete(t.index, e.key)
	t.unlink(e)
	t.values--
	t.vbytes -= int64(e.size)
	if e.readers == 0 {
		t.give(e.r)
		return
	}
	e.st = doomed
}

// give returns a run to the free space; it stays committed. t.mu must be held.
func (t *Tier) give(r run) { t.sp.give(r) }

func (t *Tier) push(e *entry) {
	e.prev, e.next = &t.lru, t.lru.next
	t.lru.next.prev = e
	t.lru.next = e
}

func (t *Tier) unlink(e *entry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

// bytes returns the memory of e's value.
func (t *Tier) bytes(e *entry) []byte {
	return bytesAt(t.base+uintptr(e.r.off*t.gran), e.size)
}

// Load calls use once, without the tier's lock, with the value stored under key; src
// is valid only during the call and must not be written. The value becomes the most
// recently used. A key the tier does not hold is kv.ErrTierMiss; use's error is
// Load's.
func (t *Tier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	if use == nil {
		panic(PanicNilFunc)
	}
	e, err := t.reader(ctx, key, true)
	if err != nil {
		return err
	}
	defer t.unread(e)
	return use(t.bytes(e))
}

// reader returns key's value with one more reader (unread ends it), the tier entered
// meanwhile: a Load's (load: counted, and marked the most recently used) or a Peek's
// (neither). A key not held is kv.ErrTierMiss.
func (t *Tier) reader(ctx context.Context, key tierval.Key, load bool) (*entry, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.enter() // NB: unlocks t.mu before it panics on a closed tier
	e := t.index[key]
	if e == nil {
		if load {
			t.counter.Misses++
		}
		t.leave()
		t.mu.Unlock()
		return nil, kv.ErrTierMiss
	}
	e.readers++
	if load {
		t.unlink(e)
		t.push(e)
		t.counter.Hits++
		t.counter.LoadedBytes += int64(e.size)
	}
	t.mu.Unlock()
	return e, nil
}

// unread ends a read of e that reader began.
func (t *Tier) unread(e *entry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	defer t.leave()
	t.release1(e)
}

// Peek calls use with the first min(n, size) bytes of the value under key, read in
// place as Load reads it (kv.TierPeeker): it marks nothing used and counts no hit or
// miss. A key not held is kv.ErrTierMiss.
func (t *Tier) Peek(ctx context.Context, key tierval.Key, n int, use func(head []byte) error) error {
	if n < 1 {
		panic(kv.PanicPeekLength)
	}
	if use == nil {
		panic(PanicNilFunc)
	}
	e, err := t.reader(ctx, key, false)
	if err != nil {
		return err
	}
	defer t.unread(e)
	b := t.bytes(e)
	return use(b[:min(n, len(b))])
}

// release1 ends one read of e, freeing a Doomed value with its last reader. t.mu
// must be held.
func (t *Tier) release1(e *entry) {
	if e.readers <= 0 {
		panic(PanicReaders)
	}
	e.readers--
	if e.readers == 0 && e.st == doomed {
		t.give(e.r)
	}
}

// Contains returns how many of keys, from the first, the tier holds.
func (t *Tier) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	t.mu.Lock()
	t.enter()
	defer t.mu.Unlock()
	defer t.leave()
	for i, k := range keys {
		if t.index[k] == nil {
			return i, nil
		}
	}
	return len(keys), nil
}

// Delete forgets key; its memory is free for other values once no Load reads it. A
// key not held is not an error.
func (t *Tier) Delete(ctx context.Context, key tierval.Key) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	t.enter()
	defer t.mu.Unlock()
	defer t.leave()
	if e := t.index[key]; e != nil {
		t.drop(e)
	}
	return nil
}

// Stats returns a snapshot of the tier's counters and bytes.
func (t *Tier) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.counter
	s.Values = t.values
	s.ValueBytes = t.vbytes
	s.Held = t.held
	s.Budget = t.region
	if t.pin != nil {
		s.Pinned = t.pin.pinned.Load()
	}
	return s
}

// Trim decommits the free granules that are still committed, giving their memory
// back to the OS and their bytes back to the ledger, and returns how many bytes that
// was. A CUDA tier keeps its pinned region whole and returns 0.
func (t *Tier) Trim() (int64, error) {
	t.mu.Lock()
	t.enter()
	defer t.mu.Unlock()
	defer t.leave()
	if t.pin != nil {
		return 0, nil
	}
	var freed int64
	for _, r := range t.sp.freeWarm() {
		if err := t.priv.Decommit(t.res, r.off*t.gran, r.n*t.gran); err != nil {
			return freed, err
		}
		t.sp.setCommitted(r, false)
		n := int64(r.n) * int64(t.gran)
		t.held -= n
		t.auth.Release(n)
		freed += n
	}
	return freed, nil
}

// Close waits for the calls in progress, stops the pinning, closes the stream,
// unpins and gives the whole region back to the OS and its bytes back to the ledger.
// Every value is forfeit. A second Close changes nothing and returns ErrClosed
// (docs/server.md, "A second Close").
func (t *Tier) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return ErrClosed
	}
	t.closed = true
	for t.ops > 0 {
		t.idle.Wait()
	}
	t.index = nil
	t.mu.Unlock()
	return t.release()
}

// release undoes New: the CUDA side first, then the region and its charge.
func (t *Tier) release() error {
	var errs []error
	if t.stream != nil {
		errs = append(errs, t.stream.Close())
	}
	if t.pin != nil {
		errs = append(errs, t.pin.stopAndUnpin())
	}
	out := t.priv.Unreserve(t.res)
	switch out.Status {
	case accounting.Complete:
		t.auth.Release(t.held)
	case accounting.Quarantined:
		// What was unmapped is given back; the rest stays charged, and is reported.
		given := min(out.Unmapped, t.held)
		t.auth.Release(given)
		t.auth.Quarantine(t.held-given, out.Err)
		errs = append(errs, out.Err)
	default:
		errs = append(errs, out.Err)
	}
	t.held = 0
	return errors.Join(errs...)
}
