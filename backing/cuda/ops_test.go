package cuda_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

func (x *fx) reserve(t testing.TB, granules int) *cuda.Reservation {
	t.Helper()
	r, err := x.b.Reserve(granules * x.g)
	require.NoError(t, err)
	return r
}

// calls returns the driver calls of fn made while run ran.
func (x *fx) calls(fn string, run func()) int {
	before := x.f.Calls(fn)
	run()
	return x.f.Calls(fn) - before
}

func TestOneDriverCallPerRun(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	r := x.reserve(t, 8)
	var creates, maps, access int
	maps = x.calls("cuMemMap", func() {
		access = x.calls("cuMemSetAccess", func() {
			creates = x.calls("cuMemCreate", func() { require.NoError(t, x.b.Commit(r, 0, 8*g)) })
		})
	})
	assert.Equal(t, 8, creates, "one handle per granule")
	assert.Equal(t, 8, maps, "one mapping per handle")
	assert.Equal(t, 1, access, "one cuMemSetAccess for the run, not one per granule")
	assert.Equal(t, 1, x.calls("cuMemUnmap", func() { require.NoError(t, x.b.Decommit(r, 0, 8*g)) }),
		"one cuMemUnmap for the run")
	// Recommitting maps pooled handles: no cuMemCreate.
	assert.Zero(t, x.calls("cuMemCreate", func() { require.NoError(t, x.b.Commit(r, 2*g, 4*g)) }))
	// Unreserve: one cuMemUnmap per contiguous run of mappings.
	require.NoError(t, x.b.Commit(r, 0, g))
	require.NoError(t, x.b.Decommit(r, 3*g, g))
	require.NoError(t, x.b.Commit(r, 7*g, g))
	// Committed now: 0, 2, 4, 5, 7 -> runs [0,1), [2,3), [4,6), [7,8).
	var out accounting.ReleaseOutcome
	assert.Equal(t, 4, x.calls("cuMemUnmap", func() { out = x.b.Unreserve(r) }))
	assert.True(t, out.OK())
	assert.Equal(t, int64(5*g), out.Unmapped)
	x.checkBooks(t, "after Unreserve")
}

func TestCommitBudget(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{Authority: auth})
	g := x.g
	require.NoError(t, gov.SetLimit(accounting.GPU(0), int64(3*g)))
	r := x.reserve(t, 4)
	err := x.b.Commit(r, 0, 4*g)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	var op *backing.OpError
	assert.True(t, errors.As(err, &op))
	assert.Zero(t, x.f.LiveHandles(), "a refused commit creates nothing")
	assert.Zero(t, x.f.LiveMappings())
	require.NoError(t, x.b.Commit(r, 0, 3*g))
	x.checkBooks(t, "3 committed")
	err = x.b.Commit(r, 3*g, g)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded, "the budget is spent")
	// Decommitted handles go to the pool, still owned: a commit elsewhere reuses them
	// within the same budget.
	require.NoError(t, x.b.Decommit(r, 0, 2*g))
	require.NoError(t, x.b.Commit(r, 3*g, g))
	assert.Equal(t, 3, x.f.LiveHandles())
	assert.Equal(t, int64(3*g), auth.Stats().Owned)
	x.checkBooks(t, "reused")
	require.True(t, x.b.Unreserve(r).OK())
}

func TestCommitDriverOOM(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{Memory: 4 << 20}, cuda.Options{})
	g := x.g
	r := x.reserve(t, 3)
	err := x.b.Commit(r, 0, 3*g)
	require.Error(t, err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, accounting.ErrAllocationFailed)
	var res *cuda.Result
	require.True(t, errors.As(err, &res))
	assert.Equal(t, "cuMemCreate", res.Func)
	assert.Equal(t, cuda.CodeOutOfMemory, res.Code)
	assert.Zero(t, x.f.LiveMappings(), "nothing committed")
	assert.Equal(t, int64(2*g), x.b.PoolStats().Idle, "the handles made before the failure are pooled")
	x.checkBooks(t, "after OOM")
	require.NoError(t, x.b.Commit(r, 0, 2*g), "the pooled handles commit")
	require.True(t, x.b.Unreserve(r).OK())
}

func TestCommitNotSupported(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	r := x.reserve(t, 1)
	x.f.Fail("cuMemCreate", 1, cuda.CodeNotSupported)
	err := x.b.Commit(r, 0, x.g)
	assert.ErrorIs(t, err, backing.ErrUnsupported)
	x.checkBooks(t, "after NOT_SUPPORTED")
	require.True(t, x.b.Unreserve(r).OK())
}

func TestCommitCtxWaitsForPooledHandles(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{Authority: auth})
	g := x.g
	require.NoError(t, gov.SetLimit(accounting.GPU(0), int64(2*g)))
	a := x.reserve(t, 2)
	b := x.reserve(t, 2)
	require.NoError(t, x.b.Commit(a, 0, 2*g))
	done := make(chan error, 1)
	go func() { done <- x.b.CommitCtx(context.Background(), b, 0, 2*g) }()
	// The waiter queues on the governor.
	require.Eventually(t, func() bool { return gov.Stats(accounting.GPU(0)).Waiters == 1 }, 5*time.Second, time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("CommitCtx returned before memory came back: %v", err)
	default:
	}
	// A decommit returns the handles to the pool (not to the governor); the waiter
	// must still wake and take them.
	require.NoError(t, x.b.Decommit(a, 0, 2*g))
	require.NoError(t, <-done)
	assert.Equal(t, 2, x.f.LiveHandles(), "the pooled handles were reused")
	assert.Zero(t, gov.Stats(accounting.GPU(0)).Waiters)
	x.checkBooks(t, "after the wait")
	require.True(t, x.b.Unreserve(a).OK())
	require.True(t, x.b.Unreserve(b).OK())
}

func TestCommitCtxWaitsForBudget(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	other := gov.Authority("someone else", accounting.GPU(0))
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{Authority: auth})
	g := x.g
	require.NoError(t, gov.SetLimit(accounting.GPU(0), int64(2*g)))
	require.NoError(t, other.TryAcquire(int64(g)))
	r := x.reserve(t, 2)
	done := make(chan error, 1)
	go func() { done <- x.b.CommitCtx(context.Background(), r, 0, 2*g) }()
	require.Eventually(t, func() bool { return gov.Stats(accounting.GPU(0)).Waiters == 1 }, 5*time.Second, time.Millisecond)
	other.Release(int64(g))
	require.NoError(t, <-done)
	x.checkBooks(t, "after the wait")

	// A cancelled wait returns ctx's error and leaks nothing.
	require.NoError(t, other.TryAcquire(0))
	s := x.reserve(t, 1)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- x.b.CommitCtx(ctx, s, 0, g) }()
	require.Eventually(t, func() bool { return gov.Stats(accounting.GPU(0)).Waiters == 1 }, 5*time.Second, time.Millisecond)
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	assert.Zero(t, gov.Stats(accounting.GPU(0)).Waiters)
	assert.Equal(t, 2, x.f.LiveHandles())
	x.checkBooks(t, "after the cancelled wait")
	assert.ErrorIs(t, x.b.Decommit(s, 0, g), backing.ErrNotCommitted)

	// A request larger than the whole limit fails at once, without waiting.
	require.NoError(t, x.b.Decommit(r, 0, 2*g))
	_, err := x.b.Trim(0)
	require.NoError(t, err)
	big := x.reserve(t, 3)
	err = x.b.CommitCtx(context.Background(), big, 0, 3*g)
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
	x.checkBooks(t, "after the oversized request")
	for _, res := range []*cuda.Reservation{r, s, big} {
		require.True(t, x.b.Unreserve(res).OK())
	}
}

func TestShareRefcounts(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	a := x.reserve(t, 2)
	b := x.reserve(t, 2)
	c := x.reserve(t, 3)
	require.NoError(t, x.b.Commit(a, 0, 2*g))
	require.NoError(t, x.b.CopyIn(a, g-4, []byte("prefix!!")))
	assert.Equal(t, 1, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Share(b, 0, a, 0, 2*g, backing.ReadOnly))
	}), "one cuMemSetAccess per shared run")
	assert.Zero(t, x.calls("cuMemMap", func() {
		err := x.b.Share(c, g, b, 0, 2*g, backing.ReadWrite)
		assert.ErrorIs(t, err, cuda.ErrReadOnly, "a read-only share is never shared on writable")
		assert.ErrorIs(t, err, backing.ErrReadOnly)
	}), "the refused share maps nothing")
	require.NoError(t, x.b.Share(c, g, a, 0, 2*g, backing.ReadWrite))
	s := x.b.PoolStats()
	assert.Equal(t, int64(2*g), s.Owned, "owned once")
	assert.Equal(t, int64(6*g), s.Mapped, "mapped three times")
	assert.Equal(t, int64(6*g), x.auth.Stats().Mapped, "attributed three times")
	x.checkBooks(t, "shared")

	// Writes through the read-only mapping are refused on the Go side, before the
	// driver could fault the context.
	for name, err := range map[string]error{
		"CopyIn":   x.b.CopyIn(b, 0, []byte{1}),
		"Memset":   x.b.Memset(b, g-1, 2, 0),
		"CopyDtoD": x.b.CopyDtoD(b, 0, a, 0, 1),
	} {
		assert.ErrorIs(t, err, cuda.ErrReadOnly, name)
		var op *backing.OpError
		assert.True(t, errors.As(err, &op), name)
	}
	got := make([]byte, 8)
	require.NoError(t, x.b.CopyOut(got, b, g-4))
	assert.Equal(t, []byte("prefix!!"), got, "read through the read-only share")
	require.NoError(t, x.b.CopyIn(c, 2*g-4, []byte("PREFIX")), "the read-write share writes")
	require.NoError(t, x.b.CopyOut(got, a, g-4))
	assert.Equal(t, []byte("PREFIX!!"), got, "and the owner sees it")

	require.NoError(t, x.b.Decommit(a, 0, 2*g))
	assert.Zero(t, x.b.PoolStats().Idle, "still mapped by B and C")
	require.True(t, x.b.Unreserve(b).OK())
	assert.Zero(t, x.b.PoolStats().Idle, "still mapped by C")
	require.NoError(t, x.b.CopyOut(got, c, 2*g-4))
	assert.Equal(t, []byte("PREFIX!!"), got)
	require.True(t, x.b.Unreserve(c).OK())
	assert.Equal(t, int64(2*g), x.b.PoolStats().Idle, "the last mapping went: back to the pool")
	x.checkBooks(t, "unshared")
	require.True(t, x.b.Unreserve(a).OK())
}

func TestShareBadProtection(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	a, b := x.reserve(t, 1), x.reserve(t, 1)
	require.NoError(t, x.b.Commit(a, 0, x.g))
	var op *backing.OpError
	assert.True(t, errors.As(x.b.Share(b, 0, a, 0, x.g, backing.Protection(7)), &op))
	assert.ErrorIs(t, x.b.Decommit(b, 0, x.g), backing.ErrNotCommitted)
	require.True(t, x.b.Unreserve(a).OK())
	require.True(t, x.b.Unreserve(b).OK())
}

func TestCopyHelpers(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	a := x.reserve(t, 3)
	b := x.reserve(t, 2)
	require.NoError(t, x.b.Commit(a, 0, 2*g))
	require.NoError(t, x.b.Commit(b, 0, 2*g))
	require.NoError(t, x.b.Memset(a, 0, 2*g, 0x5A))
	require.NoError(t, x.b.CopyIn(a, g-2, []byte{1, 2, 3, 4}))
	require.NoError(t, x.b.CopyDtoD(b, 10, a, g-3, 6))
	require.NoError(t, x.b.Synchronize())
	got := make([]byte, 6)
	require.NoError(t, x.b.CopyOut(got, b, 10))
	assert.Equal(t, []byte{0x5A, 1, 2, 3, 4, 0x5A}, got)
	require.NoError(t, x.b.CopyDtoD(a, 0, a, g, 4), "within one reservation, no overlap")
	require.NoError(t, x.b.CopyDtoD(a, 0, b, 0, 0), "empty copy")
	require.NoError(t, x.b.Memset(a, 0, 0, 1), "empty memset")

	for _, tt := range []struct {
		name string
		err  error
		kind error
	}{
		{"memset into reserved", x.b.Memset(a, 2*g-1, 2, 0), backing.ErrNotCommitted},
		{"memset past the end", x.b.Memset(a, 3*g, 1, 0), backing.ErrOutOfRange},
		{"memset negative size", x.b.Memset(a, 0, -1, 0), backing.ErrInvalidRange},
		{"dtod overlap", x.b.CopyDtoD(a, 0, a, 2, 4), backing.ErrInvalidRange},
		{"dtod source reserved", x.b.CopyDtoD(b, 0, a, 2*g, 1), backing.ErrNotCommitted},
		{"dtod destination past the end", x.b.CopyDtoD(b, 2*g, a, 0, 1), backing.ErrOutOfRange},
		{"dtod overflow", x.b.CopyDtoD(b, 0, a, math.MaxInt, 2), backing.ErrInvalidRange},
		{"copy foreign", x.b.CopyIn(&cuda.Reservation{}, 0, []byte{1}), backing.ErrForeignReservation},
		{"dtod nil", x.b.CopyDtoD(nil, 0, a, 0, 1), backing.ErrForeignReservation},
	} {
		assert.ErrorIs(t, tt.err, tt.kind, tt.name)
	}
	free, total, err := x.b.MemInfo()
	require.NoError(t, err)
	assert.Equal(t, total-x.b.PoolStats().Owned, free, "MemInfo counts the pool's handles")
	require.True(t, x.b.Unreserve(a).OK())
	require.True(t, x.b.Unreserve(b).OK())
}

func TestDriverFailureInCopy(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	r := x.reserve(t, 1)
	require.NoError(t, x.b.Commit(r, 0, x.g))
	x.f.Fail("cuMemcpyHtoD_v2", 1, cuda.CodeIllegalAddress)
	err := x.b.CopyIn(r, 0, []byte{1})
	var res *cuda.Result
	require.True(t, errors.As(err, &res))
	assert.Equal(t, "CUDA_ERROR_ILLEGAL_ADDRESS", res.Name)
	var op *backing.OpError
	require.True(t, errors.As(err, &op))
	assert.Equal(t, "copy in", op.Op)
	x.f.Fail("cuCtxSynchronize", 1, cuda.CodeUnknown)
	assert.Error(t, x.b.Synchronize())
	require.True(t, x.b.Unreserve(r).OK())
}

// Two commits that each need more than half of the budget wait in turn: neither holds
// part of what the other needs while it waits (no hold-and-wait deadlock), even when
// the handles come back one at a time.
func TestCommitCtxWaitersDoNotDeadlock(t *testing.T) {
	for range 10 {
		gov := accounting.NewGovernor()
		auth := gov.Authority("pool", accounting.GPU(0))
		x := fakeBacking(t, cudatest.FakeDriverOptions{Granularity: 64 << 10}, cuda.Options{Authority: auth})
		g := x.g
		require.NoError(t, gov.SetLimit(accounting.GPU(0), int64(4*g)))
		a := x.reserve(t, 4)
		require.NoError(t, x.b.Commit(a, 0, 4*g)) // the whole budget is mapped
		rs := []*cuda.Reservation{x.reserve(t, 3), x.reserve(t, 3)}
		done := make(chan int, 2)
		for i, r := range rs {
			go func() {
				assert.NoError(t, x.b.CommitCtx(context.Background(), r, 0, 3*g))
				done <- i
			}()
		}
		require.Eventually(t, func() bool { return gov.Stats(accounting.GPU(0)).Waiters >= 1 }, 5*time.Second, time.Millisecond)
		for i := range 4 {
			require.NoError(t, x.b.Decommit(a, i*g, g)) // one handle at a time
			time.Sleep(time.Millisecond)
		}
		var first int
		select {
		case first = <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("deadlock: both waiters hold part of the handles")
		}
		require.NoError(t, x.b.Decommit(rs[first], 0, 3*g))
		select {
		case second := <-done:
			assert.NotEqual(t, first, second)
		case <-time.After(5 * time.Second):
			t.Fatal("the second waiter never got the handles back")
		}
		x.checkBooks(t, "both served")
		for _, r := range append(rs, a) {
			require.True(t, x.b.Unreserve(r).OK())
		}
	}
}

func TestShareReadOnlyNotSupported(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	a, b, c := x.reserve(t, 1), x.reserve(t, 1), x.reserve(t, 1)
	require.NoError(t, x.b.Commit(a, 0, g))
	require.NoError(t, x.b.CopyIn(a, 0, []byte("ro")))
	x.f.Fail("cuMemSetAccess", 1, cuda.CodeNotSupported)
	assert.Equal(t, 2, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Share(b, 0, a, 0, g, backing.ReadOnly), "falls back to read-write")
	}))
	assert.ErrorIs(t, x.b.CopyIn(b, 0, []byte{1}), cuda.ErrReadOnly, "still read-only on the Go side")
	got := make([]byte, 2)
	require.NoError(t, x.b.CopyOut(got, b, 0))
	assert.Equal(t, []byte("ro"), got)
	assert.Equal(t, 1, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Share(c, 0, a, 0, g, backing.ReadOnly))
	}), "the driver is not asked again")
	assert.ErrorIs(t, x.b.Memset(c, 0, 1, 0), cuda.ErrReadOnly)
	for _, r := range []*cuda.Reservation{a, b, c} {
		require.True(t, x.b.Unreserve(r).OK())
	}
}
