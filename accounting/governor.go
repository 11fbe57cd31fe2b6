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
	notify  chan struct{}
	auths   []*Authority

	counters DeviceCounters
}

type waiter struct {
	n         int64
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

// Released returns a channel that is closed the next time bytes are released on
// device k or its limit changes. Callers that retry a refused operation wait on it.
func (g *Governor) Released(k DeviceKey) <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	d := g.dev(k)
	if d.notify == nil {
		d.notify = make(chan struct{})
	}
	return d.notify
}

// admit grants queued requests in FIFO order while they fit, and wakes Released
// watchers. g.mu must be held.
func (d *device) admit() {
	for e := d.waiters.Front(); e != nil; e = d.waiters.Front() {
		w := e.Value.(*waiter)
		if d.limit-d.used < w.n {
			break
		}
		d.take(w.n)
		close(w.ready)
		d.waiters.Remove(e)
	}
	if d.notify != nil {
		close(d.notify)
		d.notify = nil
	}
	if invariants.Enabled {
		d.checkLedger()
	}
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
// request on this ledger is its owner's own, which uses its spare memory itself
// rather than giving it back first): an owner that
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

// AcquireFor waits as Acquire does for n bytes (in FIFO order with every other
// waiter of the device), then calls fn while holding them as the ledger's credit:
// TryAcquire on this ledger, from fn or from whoever charges it (a backing that owns
// its memory), takes from the credit first, ahead of any queue, so that what fn
// commits is charged against the bytes waited for. When fn returns the credit left is
// released. It returns fn's error, or the wait's (fn is then not called).
//
// NB: the credit is the ledger's, not the caller's: another taker on the same ledger
// while fn runs may use it, and fn then finds less than it waited for. Callers retry.
func (a *Authority) AcquireFor(ctx context.Context, n int64, fn func() error) error {
	if err := a.Acquire(ctx, n); err != nil {
		return err
	}
	a.g.mu.Lock()
	a.credit += n
	a.g.mu.Unlock()
	defer func() {
		a.g.mu.Lock()
		left := min(a.credit, n)
		a.credit -= left
		a.owned -= left
		a.d.used -= left
		a.d.admit()
		a.g.mu.Unlock()
	}()
	return fn()
}

// Acquire takes n owned bytes, waiting in FIFO order until the budget covers them or
// ctx ends. A request larger than the device's limit fails at once with a *BudgetError
// matching ErrExceedsLimit. When ctx ends first it returns ctx.Err() and takes nothing.
func (a *Authority) Acquire(ctx context.Context, n int64) (err error) {
	if err := checkSize(n); err != nil {
		return err
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
		return err
	}
	if d.waiters.Len() == 0 && d.limit-d.used >= n {
		d.take(n)
		a.own(n)
		a.g.mu.Unlock()
		return nil
	}
	if err := ctx.Err(); err != nil {
		a.g.mu.Unlock()
		return err
	}
	ready := make(chan struct{})
	w := &waiter{n: n, ready: ready}
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
			return d.budgetError(n)
		}
		a.own(n)
		return nil
	case <-ctx.Done():
		a.g.mu.Lock()
		defer a.g.mu.Unlock()
		a.waiting--
		select {
		case <-ready:
			if w.dismissed {
				return ctx.Err()
			}
			// Granted just as ctx ended: give it back so no byte leaks.
			d.used -= n
			d.admit()
		default:
			isFront := d.waiters.Front() == elem
			d.waiters.Remove(elem)
			// A queue head that leaves may unblock the requests behind it.
			if isFront {
				d.admit()
			}
		}
		return ctx.Err()
	}
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

// Release gives back n owned bytes and admits waiters that now fit.
// Releasing more than the ledger owns panics: the ledger would lie.
func (a *Authority) Release(n int64) {
	if n < 0 {
		panic(fmt.Sprintf("accounting: Release of negative size %d", n))
	}
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	if n > a.owned {
		panic(fmt.Sprintf("accounting: %q releases %d bytes but owns %d", a.name, n, a.owned))
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
}

// Stats returns a snapshot of the ledger.
func (a *Authority) Stats() AuthorityStats {
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	return a.stats()
}

func (a *Authority) stats() AuthorityStats {
	return AuthorityStats{Name: a.name, Device: a.d.key, Owned: a.owned, OwnedPeak: a.ownedPeak, Mapped: a.mapped}
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
