package accounting_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
)

func TestTryAcquireRelease(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 100))
	a := g.Authority("a", accounting.HostKey)
	b := g.Authority("b", accounting.HostKey)

	require.NoError(t, a.TryAcquire(60))
	err := b.TryAcquire(50)
	var be *accounting.BudgetError
	require.ErrorAs(t, err, &be)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.NotErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.Equal(t, int64(50), be.Requested)
	assert.Equal(t, int64(40), be.Available)
	assert.Equal(t, int64(100), be.Limit)

	require.NoError(t, b.TryAcquire(40))
	s := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(100), s.Used)
	assert.Equal(t, int64(100), s.Peak)
	assert.Equal(t, int64(0), s.Available())
	a.Release(60)
	b.Release(40)
	s = g.Stats(accounting.HostKey)
	assert.Equal(t, int64(0), s.Used)
	assert.Equal(t, int64(100), s.Peak)
	assert.Equal(t, int64(60), a.Stats().OwnedPeak)
	g.ResetPeak(accounting.HostKey)
	assert.Equal(t, int64(0), g.Stats(accounting.HostKey).Peak)
}

func TestUnlimitedByDefault(t *testing.T) {
	g := accounting.NewGovernor()
	a := g.Authority("a", accounting.GPU(1))
	require.NoError(t, a.TryAcquire(1<<50))
	assert.Equal(t, accounting.Unlimited, g.Limit(accounting.GPU(1)))
	assert.Equal(t, accounting.GPU(1), a.Device())
	assert.Equal(t, "device:1", a.Device().String())
	assert.Equal(t, "a", a.Name())
	assert.Same(t, g, a.Governor())
	a.Release(1 << 50)
}

func TestExceedsLimitFailsAtOnce(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	err := a.Acquire(context.Background(), 11) // would block forever if it waited
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Contains(t, err.Error(), "exceeds the limit")
	assert.ErrorIs(t, a.TryAcquire(11), accounting.ErrExceedsLimit)
}

func TestBadInputs(t *testing.T) {
	g := accounting.NewGovernor()
	a := g.Authority("a", accounting.HostKey)
	assert.ErrorIs(t, g.SetLimit(accounting.HostKey, -1), accounting.ErrInvalidRequest)
	assert.ErrorIs(t, a.TryAcquire(-1), accounting.ErrInvalidRequest)
	err := a.Acquire(context.Background(), -5)
	var ie *accounting.InvalidRequestError
	require.ErrorAs(t, err, &ie)
	assert.Contains(t, ie.Reason, "negative")
	assert.PanicsWithValue(t, `accounting: "a" releases 1 bytes but owns 0`, func() { a.Release(1) })
	assert.Panics(t, func() { a.Release(-1) })
	assert.PanicsWithValue(t, `accounting: "a" unmaps 1 bytes but maps 0`, func() { a.Unmap(1) })
	assert.Panics(t, func() { a.Map(-1) })
	assert.Panics(t, func() { a.Unmap(-1) })
	assert.Equal(t, int64(0), g.Stats(accounting.HostKey).Used, "bad inputs changed nothing")
}

func TestMappedIsAttributionOnly(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 2<<20))
	pool := g.Authority("pool", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(2<<20))
	for range 64 {
		pool.Map(2 << 20)
	}
	s := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(2<<20), s.Used)
	assert.Equal(t, int64(128<<20), s.Mapped)
	require.Len(t, s.Authorities, 1)
	assert.Equal(t, accounting.AuthorityStats{Name: "pool", Device: accounting.HostKey, Owned: 2 << 20, OwnedPeak: 2 << 20, Mapped: 128 << 20}, s.Authorities[0])
	for range 64 {
		pool.Unmap(2 << 20)
	}
	pool.Release(2 << 20)
	assert.Equal(t, accounting.AuthorityStats{Name: "pool", Device: accounting.HostKey, OwnedPeak: 2 << 20}, pool.Stats())
}

// waitQueued waits until n requests are queued on k.
func waitQueued(t *testing.T, g *accounting.Governor, k accounting.DeviceKey, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return g.Stats(k).Waiters == n }, 5*time.Second, time.Millisecond)
}

func TestAcquireWaitsFIFO(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 100))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(100))

	// Queue a large request, then small ones: the small ones must not overtake it.
	done := make([]chan struct{}, 3)
	for i, n := range []int64{80, 10, 10} {
		done[i] = make(chan struct{})
		go func() {
			assert.NoError(t, a.Acquire(context.Background(), n))
			close(done[i])
		}()
		waitQueued(t, g, accounting.HostKey, i+1)
	}
	// A TryAcquire must not jump the queue either.
	assert.ErrorIs(t, a.TryAcquire(1), accounting.ErrBudgetExceeded)

	a.Release(20) // 20 free: enough for either small one, but the head needs 80
	time.Sleep(10 * time.Millisecond)
	assert.Equal(t, 3, g.Stats(accounting.HostKey).Waiters)
	a.Release(60) // 80 free: the head alone
	<-done[0]
	assert.Equal(t, 2, g.Stats(accounting.HostKey).Waiters)
	a.Release(10)
	<-done[1]
	assert.Equal(t, 1, g.Stats(accounting.HostKey).Waiters)
	a.Release(10)
	<-done[2]
	assert.Equal(t, int64(100), g.Stats(accounting.HostKey).Used)
	a.Release(100)
}

func TestAcquireCancelledLeaksNothing(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 100))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(90))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- a.Acquire(ctx, 50) }()
	waitQueued(t, g, accounting.HostKey, 1)

	// A request behind the cancelled head is admitted once the head leaves.
	second := make(chan error)
	go func() { second <- a.Acquire(context.Background(), 10) }()
	waitQueued(t, g, accounting.HostKey, 2)

	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	require.NoError(t, <-second)
	s := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(100), s.Used)
	assert.Equal(t, 0, s.Waiters)
	a.Release(100)
	assert.Equal(t, int64(0), g.Stats(accounting.HostKey).Used)
}

func TestAcquireAlreadyCancelled(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(10))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, a.Acquire(ctx, 5), context.Canceled)
	assert.Equal(t, 0, g.Stats(accounting.HostKey).Waiters)
	// With room, even a done context gets its bytes: the call did not need to wait.
	a.Release(10)
	assert.NoError(t, a.Acquire(ctx, 5))
	a.Release(5)
}

func TestAcquireDeadline(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(10))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, a.Acquire(ctx, 1), context.DeadlineExceeded)
	assert.Equal(t, int64(10), g.Stats(accounting.HostKey).Used)
	a.Release(10)
}

func TestSetLimitAdmitsAndDismisses(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(10))

	small := make(chan error)
	go func() { small <- a.Acquire(context.Background(), 5) }()
	waitQueued(t, g, accounting.HostKey, 1)
	require.NoError(t, g.SetLimit(accounting.HostKey, 15)) // raising admits it
	require.NoError(t, <-small)

	big := make(chan error)
	go func() { big <- a.Acquire(context.Background(), 12) }()
	waitQueued(t, g, accounting.HostKey, 1)
	require.NoError(t, g.SetLimit(accounting.HostKey, 11)) // 12 can now never fit
	err := <-big
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
	s := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(15), s.Used, "shrinking the limit takes nothing away")
	assert.Equal(t, int64(0), s.Available())
	a.Release(15)
}

func TestConcurrentAcquireRelease(t *testing.T) {
	g := accounting.NewGovernor()
	const limit = 1000
	require.NoError(t, g.SetLimit(accounting.HostKey, limit))
	var wg sync.WaitGroup
	for w := range 8 {
		a := g.Authority("w", accounting.HostKey)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				n := int64(1 + (w*7+i)%300)
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%3)*time.Millisecond)
				err := a.Acquire(ctx, n)
				cancel()
				if err != nil {
					assert.True(t, errors.Is(err, context.DeadlineExceeded), "%v", err)
					continue
				}
				assert.LessOrEqual(t, g.Stats(accounting.HostKey).Used, int64(limit))
				a.Release(n)
			}
		}()
	}
	wg.Wait()
	s := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(0), s.Used)
	assert.Equal(t, 0, s.Waiters)
	assert.LessOrEqual(t, s.Peak, int64(limit))
}

func TestAllStatsOrdered(t *testing.T) {
	g := accounting.NewGovernor()
	g.Authority("gpu1", accounting.GPU(1))
	g.Authority("host", accounting.HostKey)
	g.Authority("gpu0", accounting.GPU(0))
	all := g.AllStats()
	require.Len(t, all, 3)
	assert.Equal(t, []accounting.DeviceKey{accounting.HostKey, accounting.GPU(0), accounting.GPU(1)},
		[]accounting.DeviceKey{all[0].Device, all[1].Device, all[2].Device})
}

func TestErrors(t *testing.T) {
	cause := errors.New("ENOMEM")
	err := error(&accounting.AllocationError{Device: accounting.GPU(0), Bytes: 4096, Cause: cause})
	assert.ErrorIs(t, err, accounting.ErrAllocationFailed)
	assert.ErrorIs(t, err, cause)
	assert.Equal(t, "accounting: device:0: allocation of 4096 bytes failed: ENOMEM", err.Error())
	assert.Equal(t, "host", accounting.Host.String())
	assert.Equal(t, "Tier(9)", accounting.Tier(9).String())
	assert.Equal(t, "host-tier:0", accounting.DeviceKey{Tier: accounting.HostTier}.String())
}

func TestReleaseOutcome(t *testing.T) {
	e := errors.New("boom")
	tests := []struct {
		name               string
		unmapped, residual int64
		changed            bool
		err                error
		want               accounting.ReleaseStatus
	}{
		{"complete", 10, 0, true, nil, accounting.Complete},
		{"complete with nothing held", 0, 0, false, nil, accounting.Complete},
		{"failed, nothing changed", 0, 10, false, e, accounting.Failed},
		{"quarantined, bytes freed", 4, 6, true, e, accounting.Quarantined},
		{"quarantined, state changed", 0, 10, true, e, accounting.Quarantined},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := accounting.Outcome(tt.unmapped, tt.residual, tt.changed, tt.err)
			assert.Equal(t, tt.want, o.Status)
			assert.Equal(t, tt.err, o.Err)
			assert.Equal(t, tt.residual, o.Residual)
			assert.Equal(t, tt.want == accounting.Complete, o.OK())
			if tt.want == accounting.Failed {
				assert.Equal(t, int64(0), o.Unmapped)
			} else {
				assert.Equal(t, tt.unmapped, o.Unmapped)
			}
			assert.Contains(t, o.String(), tt.want.String())
		})
	}
	assert.Equal(t, accounting.ReleaseOutcome{Status: accounting.Complete, Unmapped: 7}, accounting.Released(7))
	assert.Equal(t, accounting.ReleaseOutcome{Status: accounting.Failed, Residual: 7, Err: e}, accounting.FailedRelease(7, e))
}

func TestAvailable(t *testing.T) {
	g := accounting.NewGovernor()
	assert.Equal(t, accounting.Unlimited, g.Available(accounting.HostKey))
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(4))
	assert.Equal(t, int64(6), g.Available(accounting.HostKey))
	require.NoError(t, g.SetLimit(accounting.HostKey, 2))
	assert.Equal(t, int64(0), g.Available(accounting.HostKey), "over the limit: nothing available")
	a.Release(4)
}

func TestReclaimerFreesForWaiter(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	pool := g.Authority("pool", accounting.HostKey)
	user := g.Authority("user", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(8)) // idle memory a pool could spare
	asked := make(chan int64, 1)
	pool.SetReclaimer(func(need int64) {
		asked <- need
		pool.Release(8)
	})
	require.NoError(t, user.Acquire(context.Background(), 5))
	assert.Equal(t, int64(5), <-asked)
	assert.Equal(t, int64(5), g.Stats(accounting.HostKey).Used)
	user.Release(5)

	// Without a reclaimer nobody is asked.
	pool.SetReclaimer(nil)
	require.NoError(t, pool.TryAcquire(8))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, user.Acquire(ctx, 5), context.DeadlineExceeded)
	assert.Empty(t, asked)
	pool.Release(8)
}

func TestCanWait(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"refused now", &accounting.BudgetError{Requested: 5, Available: 2, Limit: 10}, true},
		{"wrapped", fmt.Errorf("kv: step: %w", &accounting.BudgetError{Requested: 5, Limit: 10}), true},
		{"past the limit", &accounting.BudgetError{Requested: 11, Limit: 10}, false},
		{"other", errors.New("boom"), false},
		{"invalid", &accounting.InvalidRequestError{Reason: "x"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, accounting.CanWait(tt.err))
		})
	}
}

// AcquireFor hands the bytes it waited for to the TryAcquire calls fn makes, ahead of
// the queue behind it, and releases what fn did not take.
func TestAcquireForCredit(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	b := g.Authority("b", accounting.HostKey)
	require.NoError(t, b.TryAcquire(10))

	got := make(chan error, 1)
	go func() {
		got <- a.AcquireFor(context.Background(), 6, func(int64) error {
			// Someone queued behind: a plain TryAcquire would be refused.
			if err := a.TryAcquire(4); err != nil {
				return err
			}
			return a.TryAcquire(1)
		})
	}()
	require.Eventually(t, func() bool { return g.Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	behind := make(chan error, 1)
	go func() { behind <- b.Acquire(context.Background(), 5) }()
	require.Eventually(t, func() bool { return g.Stats(accounting.HostKey).Waiters == 2 }, 5*time.Second, time.Millisecond)
	b.Release(10)
	require.NoError(t, <-got)
	assert.Equal(t, int64(5), a.Stats().Owned, "fn took 5 of the 6 bytes; the last went back")
	require.NoError(t, <-behind, "the byte left over admits the next waiter")
	assert.Equal(t, int64(10), g.Stats(accounting.HostKey).Used)
	a.Release(5)
	b.Release(5)

	// A wait that ends does not call fn and takes nothing; bad sizes are refused.
	require.NoError(t, b.TryAcquire(10))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	called := false
	assert.ErrorIs(t, a.AcquireFor(ctx, 1, func(int64) error { called = true; return nil }), context.DeadlineExceeded)
	assert.False(t, called)
	assert.ErrorIs(t, a.AcquireFor(context.Background(), -1, func(int64) error { called = true; return nil }), accounting.ErrInvalidRequest)
	assert.ErrorIs(t, a.AcquireFor(context.Background(), 11, func(int64) error { called = true; return nil }), accounting.ErrExceedsLimit)
	assert.False(t, called)
	assert.Zero(t, a.Stats().Owned)
	b.Release(10)
	assert.Zero(t, g.Stats(accounting.HostKey).Used)
}

// A request's own ledger's reclaimer is not asked: its owner uses its spare memory
// itself.
func TestOwnReclaimerNotAsked(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	pool := g.Authority("pool", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(8))
	asked := make(chan int64, 1)
	pool.SetReclaimer(func(need int64) { asked <- need })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, pool.Acquire(ctx, 5), context.DeadlineExceeded)
	assert.Empty(t, asked)
	pool.Release(8)
}

func TestAuthorityClose(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	keep := g.Authority("keep", accounting.HostKey)
	a := g.Authority("a", accounting.HostKey)
	names := func() []string {
		var out []string
		for _, s := range g.Stats(accounting.HostKey).Authorities {
			out = append(out, s.Name)
		}
		return out
	}
	require.Equal(t, []string{"keep", "a"}, names())

	// Busy: owned bytes, mapped bytes, a queued Acquire. Each refusal changes nothing.
	require.NoError(t, a.TryAcquire(4))
	err := a.Close()
	assert.ErrorIs(t, err, accounting.ErrAuthorityBusy)
	assert.Contains(t, err.Error(), `"a" owns 4 bytes`)
	a.Release(4)
	a.Map(3)
	assert.ErrorIs(t, a.Close(), accounting.ErrAuthorityBusy)
	a.Unmap(3)
	require.NoError(t, keep.TryAcquire(10))
	queued := make(chan error)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { queued <- a.Acquire(ctx, 1) }()
	require.Eventually(t, func() bool { return g.Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	assert.ErrorIs(t, a.Close(), accounting.ErrAuthorityBusy)
	cancel()
	assert.ErrorIs(t, <-queued, context.Canceled)
	keep.Release(10)
	assert.Equal(t, []string{"keep", "a"}, names(), "refused closes changed nothing")

	// Idle: it closes, leaves the device's list, and a second Close changes nothing.
	require.NoError(t, a.Close())
	require.ErrorIs(t, a.Close(), accounting.ErrAuthorityClosed)
	assert.Equal(t, []string{"keep"}, names())
	assert.Equal(t, accounting.AuthorityStats{Name: "a", Device: accounting.HostKey, OwnedPeak: 4}, a.Stats())

	// Use after close panics by name, and takes nothing.
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() { _ = a.TryAcquire(1) })
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() { _ = a.Acquire(context.Background(), 1) })
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() {
		_ = a.AcquireFor(context.Background(), 1, func(int64) error { return nil })
	})
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() { _, _ = a.AcquireIdle(context.Background(), 1) })
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() { a.PutIdle(0) })
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() { a.Map(1) })
	assert.Equal(t, int64(0), g.Stats(accounting.HostKey).Used)
}

// A closed ledger's reclaimer is no longer called when a request on the device waits.
func TestAuthorityCloseDropsReclaimer(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 1))
	owner := g.Authority("owner", accounting.HostKey)
	var calls atomic.Int32
	owner.SetReclaimer(func(int64) { calls.Add(1) })
	require.NoError(t, owner.Close())
	other := g.Authority("other", accounting.HostKey)
	require.NoError(t, other.TryAcquire(1))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, g.Authority("waiter", accounting.HostKey).Acquire(ctx, 1), context.DeadlineExceeded)
	assert.Zero(t, calls.Load())
}
