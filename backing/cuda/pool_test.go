package cuda_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
)

func TestPoolLowMark(t *testing.T) {
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{Low: 3})
	g := int64(x.g)
	s := x.b.PoolStats()
	assert.Equal(t, backing.PoolStats{Granule: x.g, Owned: 3 * g, Idle: 3 * g, Resident: 3 * g, Low: 3, Created: 3}, s,
		"New fills the pool to Low")
	r := x.reserve(t, 3)
	assert.Zero(t, x.calls("cuMemCreate", func() { require.NoError(t, x.b.Commit(r, 0, 3*x.g)) }),
		"the commit only maps")
	assert.Zero(t, x.b.PoolStats().Idle, "no background refill without Background")
	require.True(t, x.b.Unreserve(r).OK())
}

func TestPoolLowMarkOverBudget(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	require.NoError(t, gov.SetLimit(accounting.GPU(0), 2<<21))
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{Authority: auth, Low: 5})
	assert.Equal(t, int64(2*x.g), x.b.PoolStats().Idle, "New fills what the budget allows")
	err := x.b.Prefill(3)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Equal(t, int64(2*x.g), x.b.PoolStats().Idle, "what Prefill made stays")
	x.checkBooks(t, "over budget")
}

func TestPoolHighMark(t *testing.T) {
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{High: 2})
	g := int64(x.g)
	r := x.reserve(t, 5)
	require.NoError(t, x.b.Commit(r, 0, 5*x.g))
	released := x.calls("cuMemRelease", func() { require.NoError(t, x.b.Decommit(r, 0, 4*x.g)) })
	assert.Equal(t, 2, released, "idle handles beyond High are released")
	s := x.b.PoolStats()
	assert.Equal(t, 2*g, s.Idle)
	assert.Equal(t, 3*g, s.Owned)
	assert.Equal(t, 3*g, x.auth.Stats().Owned, "and their bytes given back")
	assert.Equal(t, [2]int64{5, 2}, [2]int64{s.Created, s.GivenBack}, "5 handles made, 2 given back")
	x.checkBooks(t, "above High")
	// Prefill is explicit and may go above High.
	require.NoError(t, x.b.Prefill(4))
	assert.Equal(t, 4*g, x.b.PoolStats().Idle)
	n, err := x.b.Trim(1)
	require.NoError(t, err)
	assert.Equal(t, 3*g, n)
	require.True(t, x.b.Unreserve(r).OK())
	assert.Equal(t, 2*g, x.b.PoolStats().Idle, "Unreserve returns the last handle; within High")
}

func TestPoolTrimBadInput(t *testing.T) {
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{})
	_, err := x.b.Trim(-1)
	assert.ErrorIs(t, err, backing.ErrInvalidRange)
	assert.ErrorIs(t, x.b.Prefill(-1), backing.ErrInvalidRange)
	n, err := x.b.Trim(0)
	require.NoError(t, err)
	assert.Zero(t, n, "nothing to trim")
}

func TestPoolBackgroundRefill(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	require.NoError(t, gov.SetLimit(accounting.GPU(0), 6<<21))
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{Authority: auth, Low: 3, Background: true})
	g := int64(x.g)
	idle := func(want int64) func() bool {
		return func() bool { return x.b.PoolStats().Idle == want }
	}
	require.Eventually(t, idle(3*g), 5*time.Second, time.Millisecond, "the goroutine fills the pool to Low")
	r := x.reserve(t, 4)
	require.NoError(t, x.b.Commit(r, 0, 2*x.g))
	require.Eventually(t, idle(3*g), 5*time.Second, time.Millisecond, "and refills it after a commit")
	assert.Equal(t, 5*g, x.b.PoolStats().Owned)
	require.NoError(t, x.b.Commit(r, 2*x.g, 2*x.g))
	// The budget (6 granules) stops the refill at 2 idle; that is not an error.
	require.Eventually(t, idle(2*g), 5*time.Second, time.Millisecond)
	x.b.Quiesce() // let an attempt in flight finish
	assert.Equal(t, 6*g, x.b.PoolStats().Owned, "the refill stays within the budget")
	x.checkBooks(t, "refilled")
	require.True(t, x.b.Unreserve(r).OK())
}

func TestPoolBackgroundStopsOnClose(t *testing.T) {
	// Close while the goroutine may be creating: it stops, then the pool is released.
	for range 20 {
		x := newFx(t, cuda.FakeDriverOptions{}, cuda.Options{Low: 8, Background: true})
		require.NoError(t, x.b.Close())
		x.checkClosed(t)
	}
}

func TestPoolTrimPausesBackgroundRefill(t *testing.T) {
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{Low: 3, Background: true})
	g := int64(x.g)
	idle := func(want int64) func() bool {
		return func() bool { return x.b.PoolStats().Idle == want }
	}
	require.Eventually(t, idle(3*g), 5*time.Second, time.Millisecond)
	n, err := x.b.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, 3*g, n)
	time.Sleep(20 * time.Millisecond)
	assert.Zero(t, x.b.PoolStats().Owned, "the refill does not undo a trim")
	r := x.reserve(t, 1)
	require.NoError(t, x.b.Commit(r, 0, x.g))
	require.Eventually(t, idle(3*g), 5*time.Second, time.Millisecond, "a commit resumes the refill")
	x.b.Quiesce()
	x.checkBooks(t, "resumed")
	require.True(t, x.b.Unreserve(r).OK())
}

// While the background refill creates a handle the ledger is ahead of the pool (it is
// charged first); Quiesce waits for that handle to land, and holds the refill, so
// that the books then agree and stay put.
func TestPoolQuiesce(t *testing.T) {
	f := cuda.NewFakeDriver(cuda.FakeDriverOptions{})
	d := *f.Driver()
	// Each cuMemCreate waits for the test until the cleanup lets every one through.
	entered, proceed, free := make(chan struct{}), make(chan struct{}), make(chan struct{})
	create := d.MemCreate
	d.MemCreate = func(h *uint64, size uintptr, p *cuda.MemAllocationProp, flags uint64) cuda.Code {
		select {
		case entered <- struct{}{}:
			<-proceed
		case <-free:
		}
		return create(h, size, p, flags)
	}
	auth := gpuAuthority(0)
	b, err := cuda.New(cuda.Options{Authority: auth, Driver: &d, Low: 3, Background: true})
	require.NoError(t, err)
	x := &fx{b: b, f: f, auth: auth, g: b.Granularity()}
	g := int64(x.g)
	t.Cleanup(func() {
		close(free) // let any create through, so Close can stop the refill
		require.NoError(t, x.b.Close())
		x.checkClosed(t)
	})

	<-entered // the refill is inside cuMemCreate for its first handle
	assert.Equal(t, g, auth.Stats().Owned, "the ledger is charged before the handle exists")
	assert.Zero(t, x.b.PoolStats().Owned, "the pool counts it once it exists")
	quiet := make(chan struct{})
	go func() {
		x.b.Quiesce()
		close(quiet)
	}()
	require.Eventually(t, x.b.RefillHeld, time.Minute, time.Millisecond, "Quiesce holds the refill first")
	proceed <- struct{}{} // the first create returns; a second would block on entered
	<-quiet
	assert.Equal(t, g, x.b.PoolStats().Owned, "the handle in flight landed; the held refill made no other")
	assert.Equal(t, 1, f.Calls("cuMemCreate"))
	x.checkBooks(t, "quiesced")

	// A commit resumes the refill.
	r := x.reserve(t, 1)
	require.NoError(t, x.b.Commit(r, 0, x.g))
	for range 3 {
		<-entered
		proceed <- struct{}{}
	}
	x.b.Quiesce()
	assert.Equal(t, 4*g, x.b.PoolStats().Owned, "one mapped, three idle again")
	x.checkBooks(t, "refilled and quiesced")
	require.True(t, x.b.Unreserve(r).OK())
}

// A reclaim that runs after the request that started it was served finds nobody
// waiting and keeps the warm handles.
func TestPoolStaleReclaimKeepsHandles(t *testing.T) {
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{Low: 2})
	g := int64(x.g)
	require.Equal(t, 2*g, x.b.PoolStats().Idle)
	x.b.Reclaim()
	assert.Equal(t, 2*g, x.b.PoolStats().Idle, "nobody waits on the device: nothing to reclaim for")
	x.checkBooks(t, "after a stale reclaim")
}
