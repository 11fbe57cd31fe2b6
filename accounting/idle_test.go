package accounting_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
)

// idleWaiter is a request of AcquireIdle that runs on a goroutine of its own.
type idleWaiter struct {
	idle chan int64
	err  chan error
}

// waitIdle starts an AcquireIdle of n bytes on a and returns once it is queued, the
// device's waiters-th.
func waitIdle(t *testing.T, a *accounting.Authority, n int64, waiters int) idleWaiter {
	t.Helper()
	w := idleWaiter{idle: make(chan int64, 1), err: make(chan error, 1)}
	go func() {
		idle, err := a.AcquireIdle(context.Background(), n)
		w.idle <- idle
		w.err <- err
	}()
	require.Eventually(t, func() bool { return a.Governor().Stats(a.Device()).Waiters == waiters },
		5*time.Second, time.Millisecond)
	return w
}

// served reports whether w was served, and with how many idle bytes.
func (w idleWaiter) served() (int64, bool) {
	select {
	case idle := <-w.idle:
		return idle, true
	default:
		return 0, false
	}
}

// On a full budget, bytes a pool puts idle serve its waiting requests in arrival
// order, as free budget would: a small request behind a large one does not overtake
// it, nothing new is charged, and the bytes a request was served from are no longer
// the pool's to take back.
func TestIdleServesWaitersInOrder(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	pool := g.Authority("pool", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(10)) // the whole budget, in use
	first := waitIdle(t, pool, 4, 1)
	second := waitIdle(t, pool, 2, 2)

	pool.PutIdle(2)
	_, ok := first.served()
	assert.False(t, ok, "2 idle bytes do not cover the first request")
	assert.Equal(t, 2, g.Stats(accounting.HostKey).Waiters, "and the second does not overtake it")
	assert.Equal(t, int64(2), pool.Stats().Idle)

	pool.PutIdle(2)
	require.NoError(t, <-first.err)
	assert.Equal(t, int64(4), <-first.idle, "served from idle bytes only")
	assert.Equal(t, 1, g.Stats(accounting.HostKey).Waiters)
	assert.Zero(t, pool.Stats().Idle)
	assert.Zero(t, pool.TakeIdle(4), "the bytes the first was served from are its own")

	pool.PutIdle(3)
	require.NoError(t, <-second.err)
	assert.Equal(t, int64(2), <-second.idle)
	assert.Equal(t, int64(1), pool.TakeIdle(4), "one idle byte left over")
	st := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(10), st.Used, "nothing was charged twice")
	assert.Equal(t, int64(10), st.Peak)
	assert.Equal(t, int64(10), pool.Stats().Owned)
	pool.Release(10)
}

// A request is served from its ledger's idle bytes and free budget together; a plain
// Acquire and another ledger's request are served from free budget only.
func TestIdlePlusFree(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	pool := g.Authority("pool", accounting.HostKey)
	other := g.Authority("other", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(4))
	pool.PutIdle(3)
	require.NoError(t, other.TryAcquire(6))

	w := waitIdle(t, pool, 5, 1)
	other.Release(1)
	_, ok := w.served()
	assert.False(t, ok, "3 idle and 1 free byte do not cover 5")
	other.Release(1)
	require.NoError(t, <-w.err)
	assert.Equal(t, int64(3), <-w.idle, "idle bytes first, free budget for the rest")
	assert.Equal(t, int64(6), pool.Stats().Owned)
	assert.Equal(t, int64(10), g.Stats(accounting.HostKey).Used)

	// Neither Acquire nor another ledger's request takes idle bytes.
	pool.PutIdle(2)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, pool.Acquire(ctx, 1), context.DeadlineExceeded)
	_, err := other.AcquireIdle(ctx, 1)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	idle, err := pool.AcquireIdle(context.Background(), 2)
	require.NoError(t, err)
	assert.Equal(t, int64(2), idle, "with nobody queued, served at once")
	pool.Release(6)
	other.Release(4)
	assert.Zero(t, g.Stats(accounting.HostKey).Used)
}

// AcquireFor tells fn the part it waited for that idle bytes served, which TakeIdle
// hands out first while fn runs; idle bytes fn did not take are idle again and serve
// the next waiter.
func TestAcquireForIdleCredit(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	pool := g.Authority("pool", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(10))
	got := make(chan int64, 1)
	done := make(chan error, 1)
	go func() {
		done <- pool.AcquireFor(context.Background(), 4, func(idle int64) error {
			got <- idle
			if n := pool.TakeIdle(3); n != 3 {
				t.Errorf("TakeIdle took %d of the 4 bytes waited for", n)
			}
			return nil
		})
	}()
	require.Eventually(t, func() bool { return g.Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	behind := waitIdle(t, pool, 1, 2)
	pool.PutIdle(4)
	require.NoError(t, <-done)
	assert.Equal(t, int64(4), <-got)
	require.NoError(t, <-behind.err)
	assert.Equal(t, int64(1), <-behind.idle, "the idle byte fn left serves the next waiter")
	assert.Zero(t, pool.Stats().Idle)
	assert.Equal(t, int64(10), pool.Stats().Owned)
	pool.Release(10)
}

// OthersWait sees another ledger's waiting request, not the ledger's own.
func TestOthersWait(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 1))
	pool := g.Authority("pool", accounting.HostKey)
	other := g.Authority("other", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(1))
	assert.False(t, pool.OthersWait())
	own := waitIdle(t, pool, 1, 1)
	assert.False(t, pool.OthersWait(), "its own request")
	assert.True(t, other.OthersWait())
	pool.PutIdle(1)
	require.NoError(t, <-own.err)
	pool.Release(1)
}

// Bad sizes: AcquireIdle refuses with an error; PutIdle, TakeIdle and a Release of
// idle bytes, which would make the ledger lie, panic by name.
func TestIdleBadInput(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 10))
	a := g.Authority("a", accounting.HostKey)
	_, err := a.AcquireIdle(context.Background(), -1)
	assert.ErrorIs(t, err, accounting.ErrInvalidRequest)
	_, err = a.AcquireIdle(context.Background(), 11)
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.PanicsWithValue(t, "accounting: PutIdle of negative size -1", func() { a.PutIdle(-1) })
	assert.PanicsWithValue(t, "accounting: TakeIdle of negative size -1", func() { a.TakeIdle(-1) })
	require.NoError(t, a.TryAcquire(4))
	a.PutIdle(3)
	assert.PanicsWithValue(t, `accounting: "a" puts 2 bytes idle but owns 4, 3 of them idle`, func() { a.PutIdle(2) })
	assert.PanicsWithValue(t, `accounting: "a" releases 2 bytes but owns 4, 3 of them idle`, func() { a.Release(2) })
	assert.ErrorIs(t, a.Close(), accounting.ErrAuthorityBusy, "idle bytes are owned")
	assert.Equal(t, int64(3), a.TakeIdle(5), "no more than is idle")
	a.Release(4)
	require.NoError(t, a.Close())
}
