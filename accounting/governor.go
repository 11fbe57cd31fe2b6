package accounting

import (
	"container/list"
	"context"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/vmarena/vmarena/internal/invariants"
)

// Unlimited is the limit of a device whose budget was never set.
const Unlimited int64 = math.MaxInt64

// Governor holds a byte budget per device and the ledgers that take bytes against it.
// The zero value is not usable; call NewGovernor.
type Governor struct {
	mu      sync.Mutex
	devices map[DeviceKey]*device

	log      *slog.Logger  // nil logs nothing; see observe.go
	slowWait time.Duration // shortest wait logged
}

type device struct {
	key     DeviceKey
	limit   int64
	used    int64 // owned bytes of all authorities on this device
	peak    int64
	waiters list.List // of *waiter, FIFO
	auths   []*Authority

	counters DeviceCounters
}

type waiter struct {
	a         *Authority
	n         int64
	useIdle   bool          // may be served from a's idle bytes (AcquireIdle)
	idle      int64         // set when granted: the part of n served from a's idle bytes
	ready     chan struct{} // closed when the waiter was granted or dismissed
	dismissed bool          // set (under g.mu) when the limit shrank below n
}

// NewGovernor returns a governor with no budgets set: every device is Unlimited until
// SetLimit says otherwise.
func NewGovernor() *Governor {
	return &Governor{devices: make(map[DeviceKey]*device)}
}

// dev returns the device record for k, creating it. g.mu must be held.
func (g *Governor) dev(k DeviceKey) *device {
	d := g.devices[k]
	if d == nil {
		d = &device{key: k, limit: Unlimited}
		g.devices[k] = d
	}
	return d
}

// SetLimit sets the byte budget of device k. A limit below what is already used takes
// nothing away: later requests wait until enough is released. Raising the limit admits
// waiters in order. It returns an *InvalidRequestError for a negative limit.
func (g *Governor) SetLimit(k DeviceKey, limit int64) error {
	if limit < 0 {
		return &InvalidRequestError{Reason: fmt.Sprintf("negative limit %d for %v", limit, k)}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	d := g.dev(k)
	d.limit = limit
	// Requests that can now never fit fail at once rather than wait forever.
	for e := d.waiters.Front(); e != nil; {
		next := e.Next()
		if w := e.Value.(*waiter); w.n > limit {
			w.dismissed = true
			close(w.ready)
			d.waiters.Remove(e)
		}
		e = next
	}
	d.admit()
	return nil
}

// Limit returns the byte budget of device k (Unlimited if never set).
func (g *Governor) Limit(k DeviceKey) int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.dev(k).limit
}

// Available returns the bytes free under device k's limit now (0 when over it).
func (g *Governor) Available(k DeviceKey) int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	d := g.dev(k)
	return max(d.limit-d.used, 0)
}

// Authority returns a new ledger named name that takes bytes on device k.
// Names need not be unique; they label Stats.
func (g *Governor) Authority(name string, k DeviceKey) *Authority {
	g.mu.Lock()
	defer g.mu.Unlock()
	d := g.dev(k)
	a := &Authority{g: g, d: d, name: name}
	d.auths = append(d.auths, a)
	return a
}

// admit grants queued requests in FIFO order while they fit: in free budget, or, for
// a request that may use them (AcquireIdle, AcquireFor), in its ledger's idle bytes
// first and free budget for the rest. g.mu must be held.
func (d *device) admit() {
	for e := d.waiters.Front(); e != nil; e = d.waiters.Front() {
		w := e.Value.(*waiter)
		idle := w.a.idleFor(w.n, w.useIdle)
		if d.limit-d.used < w.n-idle {
			break
		}
		w.a.idle -= idle
		w.idle = idle
		d.take(w.n - idle)
		close(w.ready)
		d.waiters.Remove(e)
	}
	if invariants.Enabled {
		d.checkLedger()
	}
}

// idleFor returns the part of a request of n bytes that a's idle bytes serve: none
// unless useIdle. a.g.mu must be held.
func (a *Authority) idleFor(n int64, useIdle bool) int64 {
	if !useIdle {
		return 0
	}
	return min(a.idle, n)
}

func (d *device) take(n int64) {
	d.used += n
	if d.used > d.peak {
		d.peak = d.used
	}
}

// budgetError counts a refusal of n bytes and returns its error. d's governor's mu
// must be held.
func (d *device) budgetError(n int64) *BudgetError {
	d.counters.Refusals++
	avail := d.limit - d.used
	if avail < 0 {
		avail = 0
	}
	return &BudgetError{Device: d.key, Requested: n, Available: avail, Limit: d.limit}
}

// Refuse counts a refusal on device k and returns its error: a request for requested
// bytes of budget, of which the taker owns held bytes already (see BudgetError.Held),
// that the taker checked against the budget itself (Available, Limit) and found can
// not be covered now. The error carries the device's available bytes and limit now.
// So the device's Counters.Refusals count every refusal on it, the governor's own and
// its takers', such as a KV cache that refuses a whole batch step before committing
// any of it. A negative size panics.
func (g *Governor) Refuse(k DeviceKey, requested, held int64) *BudgetError {
	if requested < 0 || held < 0 {
		panic(fmt.Sprintf("accounting: Refuse of negative size %d (held %d)", requested, held))
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.dev(k).budgetError(requested)
	e.Held = held
	return e
}

// Authority is a named ledger of owned and mapped bytes on one device.
type Authority struct {
	g    *Governor
	d    *device
	name string

	// guarded by g.mu
	owned, ownedPeak int64
	mapped           int64
	credit           int64 // owned bytes waited for by AcquireFor, not yet taken
	idle             int64 // owned bytes its owner holds idle (PutIdle), not handed out
	idleCredit       int64 // idle bytes waited for by AcquireFor, not yet taken back
	reclaim          func(need int64)
	waiting          int  // Acquire calls of this ledger in the device's queue
	closed           bool // retired by Close: out of the device's list
}

// PanicAuthorityClosed is the panic of a closed Authority asked to take or map bytes.
const PanicAuthorityClosed = "accounting: use of a closed Authority"

// live panics with PanicAuthorityClosed when a is closed. a.g.mu must be held.
func (a *Authority) live() {
	if a.closed {
		panic(PanicAuthorityClosed)
	}
}

// Close retires the ledger: it leaves its device's list (Stats, reclaimers) for good.
// It fails with an error matching ErrAuthorityBusy, and changes nothing, while the
// ledger owns or maps bytes, holds bytes waited for by AcquireFor, or has an Acquire
// queued. A closed ledger that is asked to take or map bytes panics with
// PanicAuthorityClosed; its Stats stay readable. A second Close changes nothing and
// returns ErrAuthorityClosed (docs/server.md, "A second Close").
func (a *Authority) Close() error {
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	if a.closed {
		return ErrAuthorityClosed
	}
	if a.owned != 0 || a.mapped != 0 || a.credit != 0 || a.waiting != 0 {
		// NB: idle bytes are owned: a ledger that holds some is busy too.
		return fmt.Errorf("%w: %q owns %d bytes, maps %d, holds %d waited for and has %d requests queued",
			ErrAuthorityBusy, a.name, a.owned, a.mapped, a.credit, a.waiting)
	}
	a.closed = true
	a.reclaim = nil
	a.d.auths = slices.DeleteFunc(a.d.auths, func(o *Authority) bool { return o == a })
	return nil
}

// SetReclaimer registers fn to be called, on a goroutine of its own, each time a
// request on another ledger of the device starts to wait (Acquire queues it; a
// request on this ledger is its owner's own, which the queue serves from the
// ledger's idle bytes rather than have them given back first): an owner that
// holds memory it can spare (a pool's idle granules) gives it back so the waiter can
// be served. fn receives the bytes the queued request asked for and must not block for
// long. A nil fn removes the reclaimer; fn may still be running when SetReclaimer
// returns, so an owner that closes must wait for its own reclaimer to finish.
func (a *Authority) SetReclaimer(fn func(need int64)) {
	a.g.mu.Lock()
	a.reclaim = fn
	a.g.mu.Unlock()
}

// Name returns the ledger's name.
func (a *Authority) Name() string { return a.name }

// Device returns the device the ledger takes bytes on.
func (a *Authority) Device() DeviceKey { return a.d.key }

// Governor returns the governor the ledger belongs to.
func (a *Authority) Governor() *Governor { return a.g }

func checkSize(n int64) error {
	if n < 0 {
		return &InvalidRequestError{Reason: fmt.Sprintf("negative size %d", n)}
	}
	return nil
}

// TryAcquire takes n owned bytes if the budget covers them now and nobody is queued
// ahead; otherwise it returns a *BudgetError and takes nothing. Inside AcquireFor it
// takes from the bytes waited for first, ahead of any queue.
func (a *Authority) TryAcquire(n int64) error {
	if err := checkSize(n); err != nil {
		return err
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	a.live()
	d := a.d
	if c := min(a.credit, n); c > 0 && (c == n || d.waiters.Len() == 0 && d.limit-d.used >= n-c) {
		// Credit bytes are owned already.
		a.credit -= c
		d.take(n - c)
		a.own(n - c)
		return nil
	}
	if n > d.limit || d.waiters.Len() > 0 || d.limit-d.used < n {
		return d.budgetError(n)
	}
	d.take(n)
	a.own(n)
	return nil
}

// AcquireFor waits for n bytes as AcquireIdle does (in FIFO order with every other
// waiter of the device, served from the ledger's idle bytes first), then calls fn
// while holding them as the ledger's credit, telling it the part served from idle
// bytes: TryAcquire on this ledger, from fn or from whoever charges it (a backing
// that owns its memory), takes from the fresh credit first, ahead of any queue, and
// TakeIdle from the idle credit first, so that what fn commits is charged against
// the bytes waited for. When fn returns the credit left is released and the idle
// credit left is idle again. It returns fn's error, or the wait's (fn is then not
// called).
//
// NB: the credit is the ledger's, not the caller's: another taker on the same ledger
// while fn runs may use it, and fn then finds less than it waited for. Callers retry.
func (a *Authority) AcquireFor(ctx context.Context, n int64, fn func(idle int64) error) error {
	idle, err := a.acquire(ctx, n, true)
	if err != nil {
		return err
	}
	a.g.mu.Lock()
	a.credit += n - idle
	a.idleCredit += idle
	a.g.mu.Unlock()
	defer func() {
		a.g.mu.Lock()
		left := min(a.credit, n-idle)
		a.credit -= left
		a.owned -= left
		a.d.used -= left
		back := min(a.idleCredit, idle)
		a.idleCredit -= back
		a.idle += back
		a.d.admit()
		a.g.mu.Unlock()
	}()
	return fn(idle)
}

// Acquire takes n owned bytes, waiting in FIFO order until the budget covers them or
// ctx ends. A request larger than the device's limit fails at once with a *BudgetError
// matching ErrExceedsLimit. When ctx ends first it returns ctx.Err() and takes nothing.
// It is not served from the ledger's idle bytes (see AcquireIdle).
func (a *Authority) Acquire(ctx context.Context, n int64) error {
	_, err := a.acquire(ctx, n, false)
	return err
}

// AcquireIdle is Acquire for an owner that holds idle bytes on the ledger (PutIdle):
// it waits in the same FIFO queue until the ledger's idle bytes and the free budget
// together cover n bytes, and serves it from the idle ones first. It returns the part
// of n served from idle bytes, which the caller now holds as its own (it uses them,
// or returns them with PutIdle); the rest, n - idle, is newly owned. Idle bytes are
// the queue's: while one of the ledger's requests waits for more, those that come
// idle are kept for it, in arrival order, not taken by the requests behind it. On
// error it takes nothing.
func (a *Authority) AcquireIdle(ctx context.Context, n int64) (idle int64, err error) {
	return a.acquire(ctx, n, true)
}

// acquire is Acquire, served from the ledger's idle bytes too when useIdle is set;
// it returns the part that was.
func (a *Authority) acquire(ctx context.Context, n int64, useIdle bool) (idle int64, err error) {
	if err := checkSize(n); err != nil {
		return 0, err
	}
	a.g.mu.Lock()
	if a.closed {
		a.g.mu.Unlock()
		panic(PanicAuthorityClosed)
	}
	d := a.d
	if n > d.limit {
		err := d.budgetError(n)
		a.g.mu.Unlock()
		return 0, err
	}
	if idle := a.idleFor(n, useIdle); d.waiters.Len() == 0 && d.limit-d.used >= n-idle {
		a.idle -= idle
		d.take(n - idle)
		a.own(n - idle)
		a.g.mu.Unlock()
		return idle, nil
	}
	if err := ctx.Err(); err != nil {
		a.g.mu.Unlock()
		return 0, err
	}
	ready := make(chan struct{})
	w := &waiter{a: a, n: n, useIdle: useIdle, ready: ready}
	elem := d.waiters.PushBack(w)
	a.waiting++
	var reclaimers []func(int64)
	for _, o := range d.auths {
		if o.reclaim != nil && o != a {
			reclaimers = append(reclaimers, o.reclaim)
		}
	}
	a.g.mu.Unlock()
	start := time.Now()
	defer func() { a.g.endWait(d, n, start, err) }() // runs after the unlocks below
	for _, fn := range reclaimers {
		go fn(n)
	}

	select {
	case <-ready:
		a.g.mu.Lock()
		defer a.g.mu.Unlock()
		a.waiting--
		if w.dismissed {
			return 0, d.budgetError(n)
		}
		a.own(n - w.idle)
		return w.idle, nil
	case <-ctx.Done():
		a.g.mu.Lock()
		defer a.g.mu.Unlock()
		a.waiting--
		select {
		case <-ready:
			if w.dismissed {
				return 0, ctx.Err()
			}
			// Granted just as ctx ended: give it back so no byte leaks.
			d.used -= n - w.idle
			a.idle += w.idle
			d.admit()
		default:
			isFront := d.waiters.Front() == elem
			d.waiters.Remove(elem)
			// A queue head that leaves may unblock the requests behind it.
			if isFront {
				d.admit()
			}
		}
		return 0, ctx.Err()
	}
}

// PutIdle marks n of the ledger's owned bytes idle: its owner keeps them for reuse
// (a pool's idle granules) and nothing uses them. They stay owned and charged, but a
// request of this ledger that waits (AcquireIdle, AcquireFor) is served from them as
// from free budget, in FIFO order, at once. Marking more than the ledger owns and
// does not hold idle already panics: the ledger would lie; so does a closed ledger
// (PanicAuthorityClosed).
func (a *Authority) PutIdle(n int64) {
	if n < 0 {
		panic(fmt.Sprintf("accounting: PutIdle of negative size %d", n))
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	a.live()
	if n > a.owned-a.idle-a.idleCredit {
		panic(fmt.Sprintf("accounting: %q puts %d bytes idle but owns %d, %d of them idle", a.name, n, a.owned, a.idle+a.idleCredit))
	}
	a.idle += n
	a.d.admit()
}

// TakeIdle takes up to n of the ledger's idle bytes back into use (a commit that
// reuses idle granules, or a trim that gives them back) and returns how many it took:
// the owner may take that many out of its pool, and no more. Bytes a waiting request
// was served from are not the pool's to take any more. Inside AcquireFor it takes
// from the idle bytes waited for first.
//
// NB: it does not queue: an owner reuses what it holds idle ahead of the requests
// that wait for more than that, as a step that needs no new memory does not wait.
func (a *Authority) TakeIdle(n int64) int64 {
	if n < 0 {
		panic(fmt.Sprintf("accounting: TakeIdle of negative size %d", n))
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	c := min(a.idleCredit, n)
	a.idleCredit -= c
	t := min(a.idle, n-c)
	a.idle -= t
	return c + t
}

// OthersWait reports whether a request of another ledger waits on the device: an
// owner that holds idle bytes gives them back rather than keep them (only the
// ledger's own requests are served from its idle bytes).
func (a *Authority) OthersWait() bool {
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	return a.d.waiters.Len() > a.waiting
}

func (a *Authority) own(n int64) {
	a.owned += n
	if a.owned > a.ownedPeak {
		a.ownedPeak = a.owned
	}
	if invariants.Enabled {
		a.d.checkLedger()
	}
}

// Release gives back n owned bytes and admits waiters that now fit. The bytes must
// be in use, not idle (TakeIdle them first). Releasing more than the ledger owns and
// holds in use panics: the ledger would lie.
func (a *Authority) Release(n int64) {
	if n < 0 {
		panic(fmt.Sprintf("accounting: Release of negative size %d", n))
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	if idle := a.idle + a.idleCredit; n > a.owned-idle {
		if idle == 0 {
			panic(fmt.Sprintf("accounting: %q releases %d bytes but owns %d", a.name, n, a.owned))
		}
		panic(fmt.Sprintf("accounting: %q releases %d bytes but owns %d, %d of them idle", a.name, n, a.owned, idle))
	}
	a.owned -= n
	a.d.used -= n
	a.d.admit()
}

// Map adds n bytes of attribution: memory this ledger's owner has mapped, owned here or
// elsewhere. Mapped bytes never consume budget.
func (a *Authority) Map(n int64) {
	if n < 0 {
		panic(fmt.Sprintf("accounting: Map of negative size %d", n))
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	a.live()
	a.mapped += n
}

// Unmap removes n bytes of attribution. Unmapping more than is mapped panics.
func (a *Authority) Unmap(n int64) {
	if n < 0 {
		panic(fmt.Sprintf("accounting: Unmap of negative size %d", n))
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	if n > a.mapped {
		panic(fmt.Sprintf("accounting: %q unmaps %d bytes but maps %d", a.name, n, a.mapped))
	}
	a.mapped -= n
}

// AuthorityStats is a snapshot of one ledger.
type AuthorityStats struct {
	Name      string
	Device    DeviceKey
	Owned     int64 // physical bytes held (consume budget)
	OwnedPeak int64
	Mapped    int64 // bytes mapped (attribution only)
	// Idle is the part of Owned its owner holds idle (PutIdle) that no waiting
	// request was served from yet.
	Idle int64
}

// Stats returns a snapshot of the ledger.
func (a *Authority) Stats() AuthorityStats {
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	return a.stats()
}

func (a *Authority) stats() AuthorityStats {
	return AuthorityStats{Name: a.name, Device: a.d.key, Owned: a.owned, OwnedPeak: a.ownedPeak, Mapped: a.mapped, Idle: a.idle + a.idleCredit}
}

// DeviceStats is a snapshot of one device's budget.
type DeviceStats struct {
	Device      DeviceKey
	Limit       int64 // Unlimited if never set
	Used        int64 // owned bytes of all ledgers
	Peak        int64 // highest Used seen
	Mapped      int64 // mapped bytes of all ledgers (attribution)
	Waiters     int   // Acquire calls queued
	Authorities []AuthorityStats
	Counters    DeviceCounters // cumulative: waits, refusals, quarantines
}

// Available returns the bytes free under the limit (0 when over it).
func (s DeviceStats) Available() int64 { return max(s.Limit-s.Used, 0) }

// Stats returns a snapshot of device k.
func (g *Governor) Stats(k DeviceKey) DeviceStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.dev(k).stats()
}

func (d *device) stats() DeviceStats {
	s := DeviceStats{Device: d.key, Limit: d.limit, Used: d.used, Peak: d.peak, Waiters: d.waiters.Len(), Counters: d.counters}
	for _, a := range d.auths {
		as := a.stats()
		s.Mapped += as.Mapped
		s.Authorities = append(s.Authorities, as)
	}
	return s
}

// AllStats returns a snapshot of every device the governor has seen, ordered by key.
func (g *Governor) AllStats() []DeviceStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]DeviceStats, 0, len(g.devices))
	for _, d := range g.devices {
		out = append(out, d.stats())
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Device.Tier != out[j].Device.Tier {
			return out[i].Device.Tier < out[j].Device.Tier
		}
		return out[i].Device.Index < out[j].Device.Index
	})
	return out
}

// ResetPeak sets device k's peak to its current use.
func (g *Governor) ResetPeak(k DeviceKey) {
	g.mu.Lock()
	defer g.mu.Unlock()
	d := g.dev(k)
	d.peak = d.used
}
