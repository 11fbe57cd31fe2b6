package backingtest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
)

func TestNewFakeBadGranularity(t *testing.T) {
	for _, g := range []int{-1, 3, 1000, 64<<10 + 1} {
		t.Run(fmt.Sprint(g), func(t *testing.T) {
			assert.Panics(t, func() { backingtest.NewFake(backingtest.FakeOptions{Granularity: g}) })
		})
	}
	f := backingtest.NewFake(backingtest.FakeOptions{})
	assert.Equal(t, 64<<10, f.Granularity(), "default granule")
	assert.Equal(t, accounting.HostKey, f.Device())
	assert.False(t, f.Accounting().OwnedByBacking())
	assert.False(t, backing.IsHostAccessible(f))
}

func TestFakeAddresses(t *testing.T) {
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096})
	a, err := f.Reserve(3 * 4096)
	require.NoError(t, err)
	z, err := f.Reserve(0)
	require.NoError(t, err)
	b, err := f.Reserve(4096)
	require.NoError(t, err)
	assert.Equal(t, uintptr(1<<40), f.Base(a), "the fake address space starts at 1<<40")
	assert.Less(t, f.Base(a)+3*4096-1, f.Base(z), "bases ascend without overlap")
	assert.Less(t, f.Base(z), f.Base(b), "an empty reservation still has its own base")
	assert.Zero(t, f.Base(b)%4096, "bases are granule-aligned")
	assert.Equal(t, 3, f.LiveReservations())
	for _, r := range []*backingtest.FakeReservation{a, z, b} {
		assert.True(t, f.Unreserve(r).OK())
	}
	assert.Zero(t, f.LiveReservations())
}

func TestFakeSharingRefcounts(t *testing.T) {
	auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096, Authority: auth})
	a, _ := f.Reserve(2 * 4096)
	b, _ := f.Reserve(2 * 4096)
	require.NoError(t, f.Commit(a, 0, 2*4096))
	require.NoError(t, f.Share(b, 0, a, 0, 2*4096, backing.ReadOnly))
	assert.Equal(t, 2, f.LiveGranules(), "two granules, mapped twice each")
	assert.Equal(t, int64(2*4096), auth.Stats().Owned)
	err := f.CopyIn(b, 4095, []byte{1, 2})
	assert.Error(t, err, "writing a read-only mapping fails")
	var op *backing.OpError
	assert.True(t, errors.As(err, &op))
	got := make([]byte, 2)
	require.NoError(t, f.CopyOut(got, a, 4095))
	assert.Equal(t, []byte{0, 0}, got, "a refused write writes nothing")
	require.NoError(t, f.CopyIn(a, 4095, []byte{1, 2}))
	require.NoError(t, f.CopyOut(got, b, 4095))
	assert.Equal(t, []byte{1, 2}, got, "the read-only mapping sees the owner's write")
	require.True(t, f.Unreserve(a).OK())
	assert.Equal(t, 2, f.LiveGranules(), "b still maps them")
	require.NoError(t, f.Decommit(b, 0, 4096))
	assert.Equal(t, 1, f.LiveGranules())
	assert.Equal(t, int64(4096), auth.Stats().Owned)
	require.True(t, f.Unreserve(b).OK())
	assert.Zero(t, f.LiveGranules())
	assert.Zero(t, auth.Stats().Owned)
}

func TestFakeBudget(t *testing.T) {
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 3*4096))
	auth := gov.Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096, Authority: auth})
	r, _ := f.Reserve(8 * 4096)
	require.NoError(t, f.Commit(r, 0, 2*4096))
	err := f.Commit(r, 2*4096, 2*4096)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded, "a commit past the budget is refused")
	var op *backing.OpError
	assert.True(t, errors.As(err, &op))
	assert.Equal(t, 2, f.LiveGranules(), "and creates nothing")
	assert.ErrorIs(t, f.Decommit(r, 2*4096, 4096), backing.ErrNotCommitted)
	require.NoError(t, f.Commit(r, 2*4096, 4096))
	assert.True(t, f.Unreserve(r).OK())
	assert.Zero(t, auth.Stats().Owned)
}

// FuzzFake drives random operation sequences against the Fake and a model.
func FuzzFake(f *testing.F) {
	for _, seed := range backingtest.SeedOps() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
		fake := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096, Authority: auth})
		backingtest.RunOps(t, fake, ops)
		assert.Zero(t, fake.LiveGranules(), "granules left")
		assert.Zero(t, fake.LiveReservations(), "reservations left")
		assert.Zero(t, auth.Stats().Owned, "owned bytes left")
	})
}

func FuzzFakeByBuffer(f *testing.F) {
	for _, seed := range backingtest.SeedOps() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		fake := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096})
		backingtest.RunOps(t, backingtest.NewFaulty[*backingtest.FakeReservation](fake), ops)
		assert.Zero(t, fake.LiveGranules(), "granules left")
		assert.Zero(t, fake.LiveReservations(), "reservations left")
	})
}

func TestFakeShareUnknownProtection(t *testing.T) {
	auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Authority: auth})
	a, _ := f.Reserve(f.Granularity())
	b, _ := f.Reserve(f.Granularity())
	require.NoError(t, f.Commit(a, 0, f.Granularity()))
	assert.Error(t, f.Share(b, 0, a, 0, f.Granularity(), backing.Protection(9)))
	assert.ErrorIs(t, f.Decommit(b, 0, f.Granularity()), backing.ErrNotCommitted, "nothing was mapped")
	assert.True(t, f.Unreserve(a).OK())
	assert.True(t, f.Unreserve(b).OK())
}

func TestFakeAttributesMappings(t *testing.T) {
	auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096, Authority: auth})
	a, _ := f.Reserve(3 * 4096)
	b, _ := f.Reserve(2 * 4096)
	require.NoError(t, f.Commit(a, 0, 3*4096))
	assert.Equal(t, int64(3*4096), auth.Stats().Mapped, "Commit maps")
	require.NoError(t, f.Share(b, 0, a, 4096, 2*4096, backing.ReadWrite))
	assert.Equal(t, int64(5*4096), auth.Stats().Mapped, "Share maps")
	assert.Equal(t, int64(3*4096), auth.Stats().Owned, "Share owns nothing more")
	assert.ErrorIs(t, f.Commit(a, 0, 4096), backing.ErrCommitted)
	assert.Equal(t, int64(5*4096), auth.Stats().Mapped, "a refused Commit maps nothing")
	require.NoError(t, f.Decommit(a, 4096, 4096))
	assert.Equal(t, int64(4*4096), auth.Stats().Mapped, "Decommit unmaps")
	assert.Equal(t, int64(3*4096), auth.Stats().Owned, "b still maps the granule")
	require.True(t, f.Unreserve(a).OK())
	assert.Equal(t, int64(2*4096), auth.Stats().Mapped, "Unreserve unmaps")
	assert.Equal(t, int64(2*4096), auth.Stats().Owned)
	require.True(t, f.Unreserve(b).OK())
	assert.Equal(t, accounting.AuthorityStats{Name: "fake", Device: accounting.HostKey, OwnedPeak: 3 * 4096}, auth.Stats())

	byBuffer := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096})
	r, _ := byBuffer.Reserve(4096)
	require.NoError(t, byBuffer.Commit(r, 0, 4096), "ByBuffer has no ledger to map in")
	assert.True(t, byBuffer.Unreserve(r).OK())
}

func TestFakeCommitCtx(t *testing.T) {
	const g = 4096
	gov := accounting.NewGovernor()
	auth := gov.Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: auth, Wait: true})
	r, _ := f.Reserve(4 * g)
	ctx := context.Background()
	for _, tt := range []struct {
		name      string
		off, size int
		kind      error
	}{
		{"misaligned", 1, g, backing.ErrInvalidRange},
		{"negative size", 0, -g, backing.ErrInvalidRange},
		{"past the end", 4 * g, g, backing.ErrOutOfRange},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, f.CommitCtx(ctx, r, tt.off, tt.size), tt.kind)
		})
	}
	assert.ErrorIs(t, f.CommitCtx(ctx, &backingtest.FakeReservation{}, 0, g), backing.ErrForeignReservation)
	//lint:ignore SA1012 the nil context is the point: the call must panic on it
	assert.PanicsWithValue(t, "backingtest: CommitCtx with a nil context", func() { _ = f.CommitCtx(nil, r, 0, g) })
	require.NoError(t, f.CommitCtx(ctx, r, 0, g))
	assert.ErrorIs(t, f.CommitCtx(ctx, r, 0, 2*g), backing.ErrCommitted)

	// Under a full budget it waits until a decommit frees enough.
	require.NoError(t, gov.SetLimit(accounting.HostKey, 2*g))
	require.NoError(t, f.Commit(r, g, g))
	done := make(chan error, 1)
	go func() { done <- f.CommitCtx(ctx, r, 2*g, g) }()
	for gov.Stats(accounting.HostKey).Waiters == 0 {
		time.Sleep(100 * time.Microsecond)
	}
	require.NoError(t, f.Decommit(r, 0, g))
	require.NoError(t, <-done)
	assert.Equal(t, 2, f.LiveGranules())
	assert.Equal(t, int64(2*g), auth.Stats().Mapped)
	// A request larger than the whole limit fails at once rather than wait forever.
	err := f.CommitCtx(ctx, r, 0, 3*g)
	assert.ErrorIs(t, err, backing.ErrCommitted, "state is checked before the budget")
	require.NoError(t, f.Decommit(r, g, 2*g))
	assert.ErrorIs(t, f.CommitCtx(ctx, r, 0, 3*g), accounting.ErrExceedsLimit)
	assert.True(t, f.Unreserve(r).OK())
	assert.Zero(t, auth.Stats().Owned)

	for _, opts := range []backingtest.FakeOptions{
		{Granularity: g, Authority: auth},
		{Granularity: g, Wait: true},
	} {
		f := backingtest.NewFake(opts)
		r, _ := f.Reserve(g)
		assert.ErrorIs(t, f.CommitCtx(ctx, r, 0, g), backing.ErrUnsupported, "Wait %v, ByBacking %v", opts.Wait, opts.Authority != nil)
		assert.ErrorIs(t, f.Decommit(r, 0, g), backing.ErrNotCommitted, "a refused CommitCtx commits nothing")
		assert.True(t, f.Unreserve(r).OK())
	}
}

// An empty commit is a no-op even while others wait for the budget.
func TestFakeEmptyCommitWhileWaiting(t *testing.T) {
	const g = 4096
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, g))
	auth := gov.Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: auth, Wait: true})
	r, _ := f.Reserve(2 * g)
	require.NoError(t, f.Commit(r, 0, g))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- auth.Acquire(ctx, g) }()
	for gov.Stats(accounting.HostKey).Waiters == 0 {
		time.Sleep(100 * time.Microsecond)
	}
	assert.NoError(t, f.Commit(r, g, 0), "empty Commit")
	assert.NoError(t, f.CommitCtx(context.Background(), r, g, 0), "empty CommitCtx")
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	assert.True(t, f.Unreserve(r).OK())
}
