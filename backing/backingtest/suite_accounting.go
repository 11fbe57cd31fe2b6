package backingtest

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// hangGuard is how long the suite waits for something that must happen (a waiter
// queued, a waiter served, a pool's background refill settled) before it calls the
// property failed. It guards against hangs; nothing is timed.
const hangGuard = 10 * time.Second

// books is one reading of the ByBacking ledgers.
type books struct {
	ok     bool  // ByBacking: the other fields mean something
	owned  int64 // the authority's Owned
	mapped int64 // the authority's Mapped
	live   int64 // physical bytes of granules mapped somewhere: owned minus idle
	idle   int64 // the pool's idle bytes (0 without a pool)
}

// books reads the authority's axes and, for a pool, its idle bytes. A pool may refill
// in the background; books waits until the authority and the pool agree on the owned
// bytes, so that the reading is of a pool at rest.
func (e *env[R]) books() books {
	e.t.Helper()
	a := e.b.Accounting().Authority()
	if a == nil {
		return books{}
	}
	p, ok := e.b.(backing.Pool)
	if !ok || p.PoolStats().Granule == 0 {
		s := a.Stats()
		return books{ok: true, owned: s.Owned, mapped: s.Mapped, live: s.Owned}
	}
	deadline := time.Now().Add(hangGuard)
	for {
		s, ps := a.Stats(), p.PoolStats()
		if (s.Owned == ps.Owned && s.Mapped == ps.Mapped) || time.Now().After(deadline) {
			assert.Equal(e.t, s.Owned, ps.Owned, "the authority's Owned and PoolStats().Owned")
			assert.Equal(e.t, s.Mapped, ps.Mapped, "the authority's Mapped and PoolStats().Mapped")
			return books{ok: true, owned: s.Owned, mapped: s.Mapped, live: ps.Owned - ps.Idle, idle: ps.Idle}
		}
		time.Sleep(time.Millisecond)
	}
}

// expectBooks asserts that since before the authority's Mapped moved by mapped and the
// bytes of live granules by live, and that Owned moved by live plus what the pool's
// idle bytes moved: a granule taken from the pool or kept in it changes Owned by
// nothing. It returns the new reading. Under ByBuffer it checks nothing.
func (e *env[R]) expectBooks(before books, mapped, live int64, what string) books {
	e.t.Helper()
	now := e.books()
	if !before.ok || !now.ok {
		return now
	}
	assert.Equal(e.t, mapped, now.mapped-before.mapped, "%s: the authority's Mapped moved by", what)
	assert.Equal(e.t, live, now.live-before.live, "%s: bytes of live granules moved by", what)
	assert.Equal(e.t, live+now.idle-before.idle, now.owned-before.owned,
		"%s: the authority's Owned moved by (live granules %+d, idle %+d)", what, live, now.idle-before.idle)
	return now
}

// sameBooks asserts that nothing moved since before, idle bytes included.
func (e *env[R]) sameBooks(before books, what string) {
	e.t.Helper()
	now := e.expectBooks(before, 0, 0, what)
	assert.Equal(e.t, before.idle, now.idle, "%s: idle bytes", what)
}

func testAccountingAxes[R any](e *env[R]) {
	t := e.t
	if !e.b.Accounting().OwnedByBacking() {
		t.Log("ByBuffer: the backing keeps no ledger")
		return
	}
	s, shares := e.sharer()
	g := int64(e.g())
	start := e.books()
	x := e.reserve(3)
	y := e.reserve(3)
	b := e.expectBooks(start, 0, 0, "Reserve")
	require.NoError(t, e.b.Commit(x.r, 0, int(3*g)))
	b = e.expectBooks(b, 3*g, 3*g, "Commit of 3 granules")
	if !shares {
		require.NoError(t, e.b.Decommit(x.r, int(g), int(g)))
		b = e.expectBooks(b, -g, -g, "Decommit of 1 granule")
		e.unreserve(x, int(2*g))
		b = e.expectBooks(b, -2*g, -2*g, "Unreserve with 2 granules")
		e.unreserve(y, 0)
		e.expectBooks(b, 0, 0, "Unreserve of an empty reservation")
		return
	}
	require.NoError(t, s.Share(y.r, 0, x.r, 0, int(2*g), backing.ReadWrite))
	b = e.expectBooks(b, 2*g, 0, "Share of 2 granules")
	require.NoError(t, e.b.Decommit(x.r, 0, int(g)))
	b = e.expectBooks(b, -g, 0, "Decommit of a granule mapped elsewhere too")
	require.NoError(t, e.b.Decommit(x.r, int(2*g), int(g)))
	b = e.expectBooks(b, -g, -g, "Decommit of a granule's only mapping")
	e.unreserve(x, int(g))
	b = e.expectBooks(b, -g, 0, "Unreserve of a granule mapped elsewhere too")
	require.NoError(t, e.b.Decommit(y.r, 0, int(g)))
	b = e.expectBooks(b, -g, -g, "Decommit of a shared granule's last mapping")
	e.unreserve(y, int(g))
	e.expectBooks(b, -g, -g, "Unreserve with a shared granule's last mapping")
}

// tighten sets the limit of the backing's device, on the backing's governor, to what
// is used now, so that no new granule fits, and restores the previous limit at
// cleanup. Then it commits whatever a pool holds idle into a reservation of its own,
// so that only what the property frees can serve a commit.
func (e *env[R]) tighten() {
	t := e.t
	a := e.b.Accounting().Authority()
	gov, dev := a.Governor(), a.Device()
	prev := gov.Limit(dev)
	t.Cleanup(func() { assert.NoError(t, gov.SetLimit(dev, prev), "restore the device's limit") })
	require.NoError(t, gov.SetLimit(dev, gov.Stats(dev).Used))
	// A background refill may have charged granules before the limit; books waits
	// for them to land in the pool, and none can be charged after it.
	if idle := int(e.books().idle); idle > 0 {
		sponge := reserveOn(t, e.b, idle)
		require.NoError(t, e.b.Commit(sponge.r, 0, idle), "commit the pool's idle granules under the limit")
	}
	require.Zero(t, e.books().idle, "idle bytes left under the limit")
}

// waiters returns how many requests wait on the governor for the backing's device.
func (e *env[R]) waiters() int {
	a := e.b.Accounting().Authority()
	return a.Governor().Stats(a.Device()).Waiters
}

// waitQueued polls until n requests wait on the governor (or, with spy, until n-1
// do and spy's Done was asked for), failing the property at once when a CommitCtx
// that must still wait returns, and after hangGuard.
func (e *env[R]) waitQueued(n int, spy *spyCtx, what string, pending ...<-chan error) {
	e.t.Helper()
	deadline := time.Now().Add(hangGuard)
	for {
		for i, ch := range pending {
			select {
			case err := <-ch:
				require.FailNow(e.t, "a CommitCtx returned with no memory for it", "%s: waiter %d of %d returned %v", what, i+1, len(pending), err)
			default:
			}
		}
		k := e.waiters()
		if k == n || (spy != nil && k == n-1 && spy.asked.Load()) {
			return
		}
		if time.Now().After(deadline) {
			require.FailNow(e.t, "gave up waiting", "%s (waiters on the governor: %d)", what, k)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// result receives a CommitCtx's result; after hangGuard it fails the property.
func (e *env[R]) result(ch <-chan error, what string) error {
	e.t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(hangGuard):
		require.FailNow(e.t, "gave up waiting", "%s (waiters on the governor: %d)", what, e.waiters())
		return nil
	}
}

func testBudgetRefusal[R any](e *env[R]) {
	t := e.t
	if !e.b.Accounting().OwnedByBacking() {
		t.Log("ByBuffer: the caller charges the budget, not the backing")
		return
	}
	g := e.g()
	e.trim()
	h := e.reserve(2)
	require.NoError(t, e.b.Commit(h.r, 0, 2*g))
	e.tighten()
	x := e.reserve(3)
	before := e.books()
	isOp(t, e.b.Commit(x.r, 0, g), accounting.ErrBudgetExceeded, "Commit with no budget left")
	e.checkState(x.r, []bool{false, false, false}, 0, "after a refused commit")
	e.sameBooks(before, "a refused commit")

	// One granule freed (to the pool or to the budget): a commit of two still does not
	// fit, and gives back whatever it took on the way.
	require.NoError(t, e.b.Decommit(h.r, 0, g))
	before = e.expectBooks(before, -int64(g), -int64(g), "Decommit under the limit")
	isOp(t, e.b.Commit(x.r, g, 2*g), accounting.ErrBudgetExceeded, "Commit of two granules when one fits")
	e.checkState(x.r, []bool{false, false, false}, 0, "after a refused commit")
	e.sameBooks(before, "a refused commit of two granules")
	require.NoError(t, e.b.Commit(x.r, g, g), "Commit of the granule that fits")
	e.expectBooks(before, int64(g), int64(g), "Commit under the limit")
	e.mark(x.r, g, g, 46)
	e.checkMark(x.r, g, g, 46, "committed under the limit")
	e.unreserve(x, g)
	e.unreserve(h, g)
}

// waiter returns the backing's Waiter if it waits, after checking on a probe that a
// refusal (ErrUnsupported) changed nothing, and only under ByBacking.
func (e *env[R]) waiter() (backing.Waiter[R], bool) {
	t := e.t
	w, ok := e.b.(backing.Waiter[R])
	if !ok {
		t.Log("not a Waiter")
		return nil, false
	}
	if !e.b.Accounting().OwnedByBacking() {
		t.Log("ByBuffer: the caller waits for the budget, not the backing")
		return nil, false
	}
	x := e.reserve(1)
	if !e.supports(func() error { return w.CommitCtx(context.Background(), x.r, 0, e.g()) }) {
		e.checkState(x.r, []bool{false}, 0, "after a refused CommitCtx")
		e.unreserve(x, 0)
		return nil, false
	}
	e.unreserve(x, e.g())
	return w, true
}

// spyCtx records whether Done was called: a waiter selects on it when it starts to
// wait.
type spyCtx struct {
	context.Context
	asked atomic.Bool
}

func (c *spyCtx) Done() <-chan struct{} {
	c.asked.Store(true)
	return c.Context.Done()
}

// commitCtx starts w.CommitCtx(ctx, r, off, size) in a goroutine and returns its
// result channel. At cleanup, before the reservations go (cleanups run last first),
// it cancels ctx and waits for the goroutine, so that a failed property leaves no
// waiter behind.
func (e *env[R]) commitCtx(w backing.Waiter[R], ctx context.Context, cancel context.CancelFunc, r R, off, size int) <-chan error {
	ch := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		ch <- w.CommitCtx(ctx, r, off, size)
	}()
	e.t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	return ch
}

func testBudgetWaitFIFO[R any](e *env[R]) {
	w, ok := e.waiter()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	e.trim()
	h := e.marked(2, 2*g, 47)
	e.tighten()
	a := e.reserve(1)
	b := e.reserve(1)
	before := e.books()
	ctx, cancel := context.WithCancel(context.Background())
	first := e.commitCtx(w, ctx, cancel, a.r, 0, g)
	e.waitQueued(1, nil, "the first CommitCtx to queue on the governor", first)
	spy := &spyCtx{Context: ctx}
	second := e.commitCtx(w, spy, cancel, b.r, 0, g)
	// NB: a backing may hold later waiters on a gate of its own rather than on the
	// governor; either way they select on ctx.Done while they wait.
	e.waitQueued(2, spy, "the second CommitCtx to wait", first, second)

	// Free one granule: only the first waiter fits.
	require.NoError(t, e.b.Decommit(h.r, 0, g))
	require.NoError(t, e.result(first, "the first CommitCtx after one granule was freed"), "the first waiter is served first")
	e.waitQueued(1, nil, "the second CommitCtx to queue on the governor when only the first fitted", second)
	e.mark(a.r, 0, g, 48)

	require.NoError(t, e.b.Decommit(h.r, g, g))
	require.NoError(t, e.result(second, "the second CommitCtx after another granule was freed"), "the second waiter is served next")
	e.checkZero(b.r, 0, g, "a waiter's granule")
	e.mark(b.r, 0, g, 49)
	e.checkMark(a.r, 0, g, 48, "the first waiter's granule")
	e.checkMark(b.r, 0, g, 49, "the second waiter's granule")
	assert.Zero(t, e.waiters(), "waiters left on the governor")
	// Two granules went from h to the waiters.
	e.expectBooks(before, 0, 0, "two granules moved from the holder to the waiters")
	e.unreserve(a, g)
	e.unreserve(b, g)
	e.unreserve(h, 0)
}

func testBudgetWaitCancel[R any](e *env[R]) {
	w, ok := e.waiter()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	e.trim()
	h := e.reserve(1)
	require.NoError(t, e.b.Commit(h.r, 0, g))
	e.tighten()
	x := e.reserve(2)
	a := e.b.Accounting().Authority()
	used := a.Governor().Stats(a.Device()).Used
	before := e.books()
	ctx, cancel := context.WithCancel(context.Background())
	res := e.commitCtx(w, ctx, cancel, x.r, 0, g)
	e.waitQueued(1, nil, "CommitCtx to queue on the governor", res)
	cancel()
	assert.ErrorIs(t, e.result(res, "CommitCtx after its context was cancelled"), context.Canceled)
	assert.Zero(t, e.waiters(), "a cancelled CommitCtx leaves the governor's queue")
	e.checkState(x.r, []bool{false, false}, 0, "after a cancelled CommitCtx")
	e.sameBooks(before, "a cancelled CommitCtx")
	assert.Equal(t, used, a.Governor().Stats(a.Device()).Used, "the device's used bytes after a cancelled CommitCtx")

	// The granule freed now goes to no ghost of the cancelled waiter.
	require.NoError(t, e.b.Decommit(h.r, 0, g))
	require.NoError(t, e.b.Commit(x.r, g, g), "commit the freed granule after the cancelled wait")
	e.mark(x.r, g, g, 50)
	e.checkState(x.r, []bool{false, true}, 50, "after the commit")
	e.unreserve(x, g)
	e.unreserve(h, 0)
}
