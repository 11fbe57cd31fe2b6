package backingtest

import (
	"context"
	"errors"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
)

// The properties of [backing.Pool], [backing.Populator] and [backing.Waiter]: pooled
// granules are reused, prefilled and trimmed; Populate keeps contents and refuses what
// Commit would; CommitCtx commits like Commit. The waits on the budget are in
// suite_accounting.go.

// pool returns the backing's Pool if it pools, after checking that a refusal
// (ErrUnsupported) comes with a zero PoolStats.
func (e *env[R]) pool() (backing.Pool, bool) {
	p, ok := e.b.(backing.Pool)
	if !ok {
		e.t.Log("not a Pool")
		return nil, false
	}
	if err := p.Prefill(0); errors.Is(err, backing.ErrUnsupported) {
		assert.Zero(e.t, p.PoolStats(), "PoolStats of a backing whose Prefill is unsupported")
		_, err := p.Trim(0)
		assert.ErrorIs(e.t, err, backing.ErrUnsupported, "Trim of a backing whose Prefill is unsupported")
		e.t.Logf("Pool answers ErrUnsupported here: %v", err)
		return nil, false
	} else {
		require.NoError(e.t, err, "Prefill(0)")
	}
	s := p.PoolStats()
	require.Equal(e.t, e.g(), s.Granule, "PoolStats.Granule")
	require.True(e.t, e.b.Accounting().OwnedByBacking(), "a Pool owns its granules (ByBacking)")
	return p, true
}

func testPoolReuse[R any](e *env[R]) {
	p, ok := e.pool()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	x := e.reserve(2)
	require.NoError(t, e.b.Commit(x.r, 0, 2*g))
	require.NoError(t, e.b.Decommit(x.r, 0, 2*g))
	owned, _ := e.owned()
	for i := range 4 {
		require.NoError(t, e.b.Commit(x.r, 0, 2*g))
		e.checkZero(x.r, 0, 2*g, "a reused granule")
		e.mark(x.r, 0, 2*g, 22+i)
		require.NoError(t, e.b.Decommit(x.r, 0, 2*g))
		now, _ := e.owned()
		assert.Equal(t, owned, now, "cycle %d: pooled granules must be reused", i)
	}
	assert.GreaterOrEqual(t, p.PoolStats().Idle, int64(2*g), "decommitted granules go to the pool")
	e.unreserve(x, 0)
}

func testPoolPrefill[R any](e *env[R]) {
	p, ok := e.pool()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	require.NoError(t, p.Prefill(3))
	s := p.PoolStats()
	assert.GreaterOrEqual(t, s.Idle, int64(3*g), "Prefill(3) idle bytes")
	assert.Equal(t, s.Owned, s.Idle+s.Mapped, "nothing mapped yet: owned is idle")
	owned, _ := e.owned()
	x := e.reserve(3)
	require.NoError(t, e.b.Commit(x.r, 0, 3*g))
	now, _ := e.owned()
	assert.Equal(t, owned, now, "committing prefilled granules takes no new owned bytes")
	assert.Equal(t, s.Idle-int64(3*g), p.PoolStats().Idle, "three idle granules were taken")
	isOp(t, p.Prefill(-1), backing.ErrInvalidRange, "Prefill(-1)")
	e.unreserve(x, 3*g)
}

func testPoolTrim[R any](e *env[R]) {
	p, ok := e.pool()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	x := e.reserve(4)
	require.NoError(t, e.b.Commit(x.r, 0, 4*g))
	require.NoError(t, e.b.Decommit(x.r, 0, 3*g))
	before, _ := e.owned()
	s := p.PoolStats()
	require.GreaterOrEqual(t, s.Idle, int64(3*g))
	n, err := p.Trim(1)
	require.NoError(t, err)
	assert.Equal(t, s.Idle-int64(g), n, "Trim(1) gives back all idle granules but one")
	assert.Equal(t, s.GivenBack+n/int64(g), p.PoolStats().GivenBack, "PoolStats.GivenBack counts what Trim gave back")
	assert.GreaterOrEqual(t, s.Created, int64(4), "PoolStats.Created counts the 4 granules committed")
	after, _ := e.owned()
	assert.Equal(t, before-n, after, "owned bytes drop by what Trim gave back")
	assert.Equal(t, int64(g), p.PoolStats().Idle)
	n, err = p.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(g), n)
	assert.Zero(t, p.PoolStats().Idle)
	// The mapped granule is untouched by Trim.
	assert.Equal(t, int64(g), p.PoolStats().Mapped)
	_, err = p.Trim(-1)
	isOp(t, err, backing.ErrInvalidRange, "Trim(-1)")
	e.unreserve(x, g)
}

func testPopulate[R any](e *env[R]) {
	t := e.t
	p, ok := e.b.(backing.Populator[R])
	if !ok {
		t.Log("not a Populator")
		return
	}
	g := e.g()
	x := e.reserve(3)
	require.NoError(t, e.b.Commit(x.r, 0, 2*g))
	e.mark(x.r, 0, g, 25)
	if !e.supports(func() error { return p.Populate(x.r, 0, 2*g) }) {
		e.checkMark(x.r, 0, g, 25, "after a refused Populate")
		e.checkZero(x.r, g, g, "after a refused Populate")
		isOp(t, e.b.Decommit(x.r, 2*g, g), backing.ErrNotCommitted, "after a refused Populate")
		e.unreserve(x, 2*g)
		return
	}
	e.checkMark(x.r, 0, g, 25, "Populate keeps the contents")
	e.checkZero(x.r, g, g, "Populate of a fresh granule")
	e.mark(x.r, g, g, 25)
	assert.NoError(t, p.Populate(x.r, g, 0), "an empty Populate")
	isOp(t, p.Populate(x.r, 2*g, g), backing.ErrNotCommitted, "Populate of a reserved granule")
	isOp(t, p.Populate(x.r, g, 2*g), backing.ErrNotCommitted, "Populate over a reserved granule")
	isOp(t, p.Populate(x.r, 3*g, g), backing.ErrOutOfRange, "Populate past the end")
	if g > 1 {
		isOp(t, p.Populate(x.r, 1, g), backing.ErrInvalidRange, "misaligned Populate")
	}
	e.checkState(x.r, []bool{true, true, false}, 25, "after refused Populate calls")
	e.unreserve(x, 2*g)
}

func testCommitCtx[R any](e *env[R]) {
	t := e.t
	w, ok := e.b.(backing.Waiter[R])
	if !ok {
		t.Log("not a Waiter")
		return
	}
	g := e.g()
	x := e.reserve(2)
	ctx := context.Background()
	if !e.supports(func() error { return w.CommitCtx(ctx, x.r, 0, g) }) {
		e.checkState(x.r, []bool{false, false}, 0, "after a refused CommitCtx")
		e.unreserve(x, 0)
		return
	}
	e.checkZero(x.r, 0, g, "CommitCtx")
	e.mark(x.r, 0, g, 26)
	isOp(t, w.CommitCtx(ctx, x.r, 0, 2*g), backing.ErrCommitted, "CommitCtx over a committed granule")
	isOp(t, w.CommitCtx(ctx, x.r, g, 2*g), backing.ErrOutOfRange, "CommitCtx past the end")
	// An ended context may refuse, but only with its own error, and then changes nothing.
	done, cancel := context.WithCancel(ctx)
	cancel()
	if err := w.CommitCtx(done, x.r, g, g); err != nil {
		assert.ErrorIs(t, err, context.Canceled)
		e.checkState(x.r, []bool{true, false}, 26, "after a cancelled CommitCtx")
		require.NoError(t, w.CommitCtx(ctx, x.r, g, g))
	}
	e.checkMark(x.r, 0, g, 26, "CommitCtx keeps other granules")
	e.unreserve(x, 2*g)
}
