package backingtest_test

import (
	"errors"
	"fmt"
	"testing"

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
