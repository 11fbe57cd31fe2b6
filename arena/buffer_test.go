package arena_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
)

const g = 64 << 10

func newFake(t *testing.T, limit int64) (*backingtest.Fake, *accounting.Authority) {
	t.Helper()
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, limit))
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g})
	t.Cleanup(func() {
		assert.Zero(t, f.LiveGranules(), "granules leaked")
		assert.Zero(t, f.LiveReservations(), "reservations leaked")
	})
	return f, gov.Authority("buf", accounting.HostKey)
}

func TestBufferGrowShrink(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 10*g-1, a)
	require.NoError(t, err)
	base := buf.Base()
	assert.Equal(t, 10*g, buf.Capacity(), "capacity rounds up to the granule")
	assert.Equal(t, g, buf.Granularity())
	assert.False(t, buf.HostAccessible())

	steps := []struct{ n, committed int }{
		{1, g}, {g, g}, {g + 1, 2 * g}, {5*g + 7, 6 * g}, {3 * g, 3 * g}, {0, 0}, {10 * g, 10 * g},
	}
	for _, st := range steps {
		require.NoError(t, buf.Resize(st.n))
		assert.Equal(t, st.n, buf.Len())
		assert.Equal(t, st.committed, buf.Committed(), "after Resize(%d)", st.n)
		assert.Equal(t, base, buf.Base(), "the base never moves")
		assert.Equal(t, int64(st.committed), a.Stats().Owned, "each committed granule is charged")
		assert.Equal(t, int64(st.committed), a.Stats().Mapped)
		assert.Equal(t, st.committed/g, f.LiveGranules())
	}
	out := buf.Close()
	assert.Equal(t, accounting.Complete, out.Status)
	assert.Equal(t, accounting.AuthorityStats{Name: "buf", Device: accounting.HostKey, OwnedPeak: 10 * g}, a.Stats())
	assert.PanicsWithValue(t, arena.PanicClosed, func() { _ = buf.Resize(1) })
	again := buf.Close()
	assert.Equal(t, accounting.Failed, again.Status, "a second Close changes nothing")
	assert.ErrorIs(t, again.Err, arena.ErrClosed)
}

func TestBufferBadInputs(t *testing.T) {
	f, a := newFake(t, 1<<30)
	_, err := arena.NewBuffer(f, -1, a)
	assert.ErrorIs(t, err, arena.ErrInvalidSize)
	_, err = arena.NewBuffer(f, math.MaxInt, a)
	assert.ErrorIs(t, err, arena.ErrInvalidSize)
	_, err = arena.NewBuffer(f, g, nil)
	assert.ErrorIs(t, err, arena.ErrAuthority, "ByBuffer needs an authority")
	other := accounting.NewGovernor().Authority("gpu", accounting.GPU(0))
	_, err = arena.NewBuffer(f, g, other)
	assert.ErrorIs(t, err, arena.ErrAuthority, "authority on another device")

	pooled := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: a})
	_, err = arena.NewBuffer(pooled, g, a)
	assert.ErrorIs(t, err, arena.ErrAuthority, "ByBacking must not be charged twice")

	buf, err := arena.NewBuffer(f, 2*g, a)
	require.NoError(t, err)
	defer buf.Close()
	assert.ErrorIs(t, buf.Resize(-1), arena.ErrInvalidSize)
	assert.ErrorIs(t, buf.Resize(2*g+1), arena.ErrCapacity)
	assert.Equal(t, 0, buf.Committed(), "bad resizes change nothing")
	//lint:ignore SA1012 the nil context is the point: the call must panic on it
	assert.Panics(t, func() { _ = buf.ResizeCtx(nil, 1) })
	assert.PanicsWithValue(t, arena.PanicDeviceBytes, func() { buf.Bytes() })
	assert.ErrorIs(t, buf.ShareFrom(buf, 0, backing.ReadOnly), arena.ErrNoSharing, "a ByBuffer fake does not share")
}

func TestBufferBudgetRefusalChangesNothing(t *testing.T) {
	f, a := newFake(t, 3*g)
	buf, err := arena.NewBuffer(f, 8*g, a)
	require.NoError(t, err)
	defer buf.Close()
	require.NoError(t, buf.Resize(2*g))
	err = buf.Resize(5 * g)
	var be *accounting.BudgetError
	require.ErrorAs(t, err, &be)
	assert.Equal(t, int64(3*g), be.Requested)
	assert.Equal(t, int64(g), be.Available)
	assert.Equal(t, 2*g, buf.Len())
	assert.Equal(t, 2*g, buf.Committed())
	assert.Equal(t, 2, f.LiveGranules())
	assert.Equal(t, int64(2*g), a.Stats().Owned)
}

func TestBufferResizeCtxWaits(t *testing.T) {
	f, a := newFake(t, 2*g)
	hog, err := arena.NewBuffer(f, 2*g, a)
	require.NoError(t, err)
	require.NoError(t, hog.Resize(2*g))
	buf, err := arena.NewBuffer(f, 2*g, a)
	require.NoError(t, err)
	defer buf.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, buf.ResizeCtx(ctx, g), context.DeadlineExceeded)
	assert.Equal(t, 0, buf.Committed(), "a cancelled wait changes nothing")

	done := make(chan error)
	go func() { done <- buf.ResizeCtx(context.Background(), g) }()
	require.Eventually(t, func() bool { return a.Governor().Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	assert.True(t, hog.Close().OK())
	require.NoError(t, <-done)
	assert.Equal(t, g, buf.Committed())
}

func TestBufferCommitFailureChangesNothing(t *testing.T) {
	f, a := newFake(t, 1<<30)
	faulty := backingtest.NewFaulty[*backingtest.FakeReservation](f)
	buf, err := arena.NewBuffer(faulty, 4*g, a)
	require.NoError(t, err)
	boom := errors.New("boom")
	faulty.FailOp(backingtest.OpCommit, 1, boom)
	assert.ErrorIs(t, buf.Resize(g), boom)
	assert.Equal(t, 0, buf.Committed())
	assert.Equal(t, int64(0), a.Stats().Owned, "the charge taken before the commit is given back")

	require.NoError(t, buf.Resize(3*g))
	faulty.FailOp(backingtest.OpDecommit, 1, boom)
	assert.ErrorIs(t, buf.Resize(g), boom)
	assert.Equal(t, 3*g, buf.Committed())
	assert.Equal(t, int64(3*g), a.Stats().Owned)

	faulty.FailOp(backingtest.OpUnreserve, 1, boom)
	out := buf.Close()
	assert.Equal(t, accounting.Failed, out.Status, "nothing changed: the buffer is still usable")
	assert.Equal(t, 3*g, buf.Committed())
	out = buf.Close()
	assert.Equal(t, accounting.Complete, out.Status)
	assert.Equal(t, int64(0), a.Stats().Owned)
}

func TestBufferShareFrom(t *testing.T) {
	gov := accounting.NewGovernor()
	pool := gov.Authority("pool", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: pool})
	src, err := arena.NewBuffer(f, 4*g, nil)
	require.NoError(t, err)
	require.NoError(t, src.Resize(3*g))
	msg := []byte("shared prefix")
	require.NoError(t, f.CopyIn(src.Reservation(), g, msg))

	dst, err := arena.NewBuffer(f, 4*g, nil)
	require.NoError(t, err)
	assert.ErrorIs(t, dst.ShareFrom(src, g+1, backing.ReadOnly), arena.ErrInvalidSize)
	assert.ErrorIs(t, dst.ShareFrom(src, 4*g, backing.ReadOnly), arena.ErrInvalidSize, "more than src has committed")
	require.NoError(t, dst.ShareFrom(src, 2*g, backing.ReadOnly))
	assert.Equal(t, 2*g, dst.Shared())
	assert.Equal(t, 2*g, dst.Len())
	assert.ErrorIs(t, dst.ShareFrom(src, g, backing.ReadOnly), arena.ErrNotEmpty)
	got := make([]byte, len(msg))
	require.NoError(t, f.CopyOut(got, dst.Reservation(), g))
	assert.Equal(t, msg, got)
	assert.Equal(t, int64(3*g), pool.Stats().Owned, "shared granules are owned once")

	require.NoError(t, dst.Resize(3*g)) // one granule of its own past the shared part
	assert.Equal(t, int64(4*g), pool.Stats().Owned)
	require.NoError(t, dst.Resize(g)) // shrink into the shared part: unmaps
	assert.Equal(t, g, dst.Shared())

	assert.True(t, src.Close().OK())
	require.NoError(t, f.CopyOut(got, dst.Reservation(), 0))
	assert.Equal(t, int64(g), pool.Stats().Owned, "the granule dst still maps lives on")
	assert.True(t, dst.Close().OK())
	assert.Equal(t, int64(0), pool.Stats().Owned)
	assert.Zero(t, f.LiveGranules())
}

// A backing that owns its memory but can not wait itself: ResizeCtx waits in the
// governor's queue for the bytes the backing asked for.
func TestBufferResizeCtxWaitsByBacking(t *testing.T) {
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, g))
	pool := gov.Authority("pool", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: pool})
	a, err := arena.NewBuffer(f, 2*g, nil)
	require.NoError(t, err)
	b, err := arena.NewBuffer(f, 2*g, nil)
	require.NoError(t, err)
	require.NoError(t, a.Resize(g))
	shrunk := make(chan struct{})
	go func() {
		defer close(shrunk)
		time.Sleep(20 * time.Millisecond)
		assert.NoError(t, a.Resize(0))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.ResizeCtx(ctx, g))
	assert.Equal(t, g, b.Committed())
	<-shrunk

	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	assert.ErrorIs(t, a.ResizeCtx(ctx2, g), context.DeadlineExceeded)
	assert.ErrorIs(t, a.ResizeCtx(context.Background(), 2*g), accounting.ErrExceedsLimit, "never fits: no wait")
	assert.True(t, a.Close().OK())
	assert.True(t, b.Close().OK())
	assert.Zero(t, pool.Stats().Owned)
}
