package accounting_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/logrec"
)

func TestCountersWaitsAndRefusals(t *testing.T) {
	var rec logrec.Recorder
	g, err := accounting.NewGovernorWith(accounting.GovernorOptions{Logger: rec.Logger(), SlowWait: 20 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, g.SetLimit(accounting.HostKey, 100))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(100))

	// Refusals: at once, over the limit, and a waiter the limit shrinks under.
	assert.ErrorIs(t, a.TryAcquire(1), accounting.ErrBudgetExceeded)
	assert.ErrorIs(t, a.Acquire(context.Background(), 101), accounting.ErrExceedsLimit)
	c := g.Stats(accounting.HostKey).Counters
	assert.Equal(t, int64(2), c.Refusals)
	assert.Zero(t, c.Waits, "no request has queued yet")

	// A wait that is granted after about 30 ms, one abandoned by its context, one
	// refused when the limit shrinks under it.
	done := make(chan error)
	go func() { done <- a.Acquire(context.Background(), 10) }()
	waitQueued(t, g, accounting.HostKey, 1)
	time.Sleep(30 * time.Millisecond)
	a.Release(10)
	require.NoError(t, <-done)

	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- a.Acquire(ctx, 10) }()
	waitQueued(t, g, accounting.HostKey, 1)
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)

	go func() { done <- a.Acquire(context.Background(), 90) }()
	waitQueued(t, g, accounting.HostKey, 1)
	require.NoError(t, g.SetLimit(accounting.HostKey, 50))
	assert.ErrorIs(t, <-done, accounting.ErrBudgetExceeded)

	c = g.Stats(accounting.HostKey).Counters
	assert.Equal(t, int64(3), c.Waits)
	assert.Equal(t, int64(3), c.Refusals)
	assert.GreaterOrEqual(t, c.WaitTime, 30*time.Millisecond)
	last := c.WaitsWithin[accounting.NumWaitBuckets-1]
	assert.Equal(t, c.Waits, last, "every wait here ended within the last bound")
	for i := 1; i < accounting.NumWaitBuckets; i++ {
		assert.LessOrEqual(t, c.WaitsWithin[i-1], c.WaitsWithin[i], "cumulative buckets")
	}
	assert.Less(t, c.WaitsWithin[0], c.Waits, "the 30 ms wait is above the first bound (1 ms)")

	// The granted wait took SlowWait or longer: logged, once at least, as granted.
	slow := rec.Find("accounting: slow budget wait")
	require.NotEmpty(t, slow)
	assert.Equal(t, "granted", slow[0]["outcome"])
	assert.Equal(t, float64(10), slow[0]["bytes"])
	assert.Equal(t, "host:0", slow[0]["device"])
	a.Release(90)
}

func TestQuarantineCountedAndLogged(t *testing.T) {
	var rec logrec.Recorder
	g, err := accounting.NewGovernorWith(accounting.GovernorOptions{Logger: rec.Logger()})
	require.NoError(t, err)
	a := g.Authority("pool", accounting.GPU(0))
	require.NoError(t, a.TryAcquire(4<<20))
	a.Quarantine(2<<20, errors.New("cuMemUnmap: CUDA_ERROR_UNKNOWN"))
	a.Quarantine(0, nil)
	s := g.Stats(accounting.GPU(0))
	assert.Equal(t, int64(2), s.Counters.Quarantines)
	assert.Equal(t, int64(2<<20), s.Counters.QuarantinedBytes)
	assert.Equal(t, int64(4<<20), s.Used, "a quarantine moves no bytes")
	q := rec.Find("accounting: quarantine")
	require.Len(t, q, 2)
	assert.Equal(t, "WARN", q[0]["level"])
	assert.Equal(t, "pool", q[0]["authority"])
	assert.Equal(t, "device:0", q[0]["device"])
	assert.Equal(t, float64(2<<20), q[0]["bytes"])
	assert.Equal(t, "cuMemUnmap: CUDA_ERROR_UNKNOWN", q[0]["cause"])
	assert.PanicsWithValue(t, "accounting: Quarantine of negative size -1", func() { a.Quarantine(-1, nil) })
	a.Release(4 << 20)
}

func TestNilLoggerLogsNothing(t *testing.T) {
	// NewGovernor and a zero GovernorOptions log nothing, and count the same.
	for _, mk := range []func() *accounting.Governor{
		accounting.NewGovernor,
		func() *accounting.Governor {
			g, err := accounting.NewGovernorWith(accounting.GovernorOptions{SlowWait: time.Nanosecond})
			require.NoError(t, err)
			return g
		},
	} {
		g := mk()
		require.NoError(t, g.SetLimit(accounting.HostKey, 1))
		a := g.Authority("a", accounting.HostKey)
		require.NoError(t, a.TryAcquire(1))
		done := make(chan error)
		go func() { done <- a.Acquire(context.Background(), 1) }()
		waitQueued(t, g, accounting.HostKey, 1)
		a.Release(1)
		require.NoError(t, <-done)
		a.Quarantine(1, errors.New("x"))
		c := g.Stats(accounting.HostKey).Counters
		assert.Equal(t, int64(1), c.Waits)
		assert.Equal(t, int64(1), c.Quarantines)
		a.Release(1)
	}
}

func TestGovernorOptionsBadInput(t *testing.T) {
	g, err := accounting.NewGovernorWith(accounting.GovernorOptions{SlowWait: -time.Second})
	assert.Nil(t, g)
	assert.ErrorIs(t, err, accounting.ErrInvalidRequest)
	assert.Contains(t, err.Error(), "negative SlowWait")
}

func TestWaitBuckets(t *testing.T) {
	b := accounting.WaitBuckets()
	require.Len(t, b, accounting.NumWaitBuckets)
	for i := 1; i < len(b); i++ {
		assert.Less(t, b[i-1], b[i])
	}
}

// TestRefuse: a refusal a taker decided counts as the governor's own do, and its
// error carries the device's figures; held bytes make a request that can never fit
// match ErrExceedsLimit though Requested alone fits.
func TestRefuse(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 100))
	a := g.Authority("a", accounting.HostKey)
	require.NoError(t, a.TryAcquire(70))

	e := g.Refuse(accounting.HostKey, 40, 0)
	assert.Equal(t, accounting.BudgetError{Device: accounting.HostKey, Requested: 40, Available: 30, Limit: 100}, *e)
	assert.True(t, accounting.CanWait(e))
	assert.Equal(t, int64(1), g.Stats(accounting.HostKey).Counters.Refusals)

	e = g.Refuse(accounting.HostKey, 40, 70)
	assert.ErrorIs(t, e, accounting.ErrExceedsLimit, "40 more on top of 70 held can never fit under 100")
	assert.False(t, accounting.CanWait(e))
	assert.Contains(t, e.Error(), "request of 40 bytes (and 70 held) exceeds the limit of 100 bytes")
	e = g.Refuse(accounting.HostKey, 40, 60)
	assert.NotErrorIs(t, e, accounting.ErrExceedsLimit, "exactly the limit fits")
	assert.Equal(t, int64(3), g.Stats(accounting.HostKey).Counters.Refusals)

	assert.Panics(t, func() { g.Refuse(accounting.HostKey, -1, 0) })
	assert.Panics(t, func() { g.Refuse(accounting.HostKey, 1, -1) })
	a.Release(70)
}
