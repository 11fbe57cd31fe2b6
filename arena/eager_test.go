package arena_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
)

var _ arena.Allocator = (*arena.Eager[*backingtest.FakeReservation, *backingtest.Fake])(nil)

func TestEagerAllocateRelease(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("eager", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 64 << 10})
	e, err := arena.NewEager(f, auth)
	require.NoError(t, err)

	a, err := e.Allocate(100<<10, 4096) // two granules, committed at once
	require.NoError(t, err)
	b, err := e.Allocate(1, 64<<10)
	require.NoError(t, err)
	assert.Zero(t, a.Ptr%4096)
	assert.Zero(t, b.Ptr%(64<<10))
	assert.Equal(t, 100<<10, a.Size)
	assert.Equal(t, 2, e.Live())
	assert.Equal(t, 3, f.LiveGranules())
	assert.Equal(t, int64(3*64<<10), auth.Stats().Owned)
	assert.Equal(t, accounting.HostKey, e.Device())
	assert.False(t, arena.IsVirtual(e))
	assert.False(t, arena.CanShare(e))

	out := e.Release(a)
	require.True(t, out.OK(), "%v", out)
	assert.Equal(t, int64(2*64<<10), out.Unmapped)
	assert.Equal(t, int64(64<<10), auth.Stats().Owned)
	require.True(t, e.Release(b).OK())
	assert.Zero(t, e.Live())
	assert.Zero(t, f.LiveGranules())
	assert.Zero(t, f.LiveReservations())
	assert.Zero(t, auth.Stats().Owned)
	assert.Zero(t, auth.Stats().Mapped)
}

func TestEagerBadInput(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("eager", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 64 << 10})

	_, err := arena.NewEager(f, nil)
	assert.ErrorIs(t, err, arena.ErrAuthority, "ByBuffer without an authority")
	pooled := backingtest.NewFake(backingtest.FakeOptions{Authority: auth})
	_, err = arena.NewEager(pooled, auth)
	assert.ErrorIs(t, err, arena.ErrAuthority, "ByBacking with an authority")
	_, err = arena.NewEager(f, gov.Authority("gpu", accounting.DeviceKey{Tier: accounting.Device, Index: 0}))
	assert.ErrorIs(t, err, arena.ErrAuthority, "an authority on another device")

	e, err := arena.NewEager(f, auth)
	require.NoError(t, err)
	for _, tt := range []struct {
		name        string
		size, align int
		want        error
	}{
		{"negative size", -1, 8, arena.ErrInvalidSize},
		{"zero alignment", 8, 0, arena.ErrInvalidAlignment},
		{"alignment not a power of two", 8, 24, arena.ErrInvalidAlignment},
		{"alignment above the granule", 8, 128 << 10, arena.ErrInvalidAlignment},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := e.Allocate(tt.size, tt.align)
			assert.ErrorIs(t, err, tt.want)
		})
	}
	assert.Zero(t, e.Live())
	assert.Zero(t, f.LiveReservations())

	a, err := e.Allocate(8, 8)
	require.NoError(t, err)
	other, err := arena.NewEager(f, auth)
	require.NoError(t, err)
	assert.PanicsWithValue(t, arena.PanicForeignAllocation, func() { other.Release(a) })
	assert.PanicsWithValue(t, arena.PanicForeignAllocation, func() { e.Release(arena.Allocation{}) })
	require.True(t, e.Release(a).OK())
	assert.PanicsWithValue(t, arena.PanicReleased, func() { e.Release(a) })
	assert.PanicsWithValue(t, arena.PanicReleased, func() { e.Bytes(a) })
	assert.PanicsWithValue(t, arena.PanicForeignAllocation, func() { e.Bytes(arena.Allocation{}) })
	b, err := e.Allocate(8, 8)
	require.NoError(t, err)
	assert.PanicsWithValue(t, arena.PanicDeviceBytes, func() { e.Bytes(b) }, "the fake's memory is not host memory")
	require.True(t, e.Release(b).OK())
	assert.Zero(t, auth.Stats().Owned)
}

// A refused budget and a failing backing leave nothing held and nothing charged; a
// release the backing refuses keeps the allocation, and a later one succeeds.
func TestEagerFailures(t *testing.T) {
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 128<<10))
	auth := gov.Authority("eager", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 64 << 10})
	faulty := backingtest.NewFaulty[*backingtest.FakeReservation](f)
	e, err := arena.NewEager(faulty, auth)
	require.NoError(t, err)

	_, err = e.Allocate(192<<10, 8)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	boom := errors.New("boom")
	faulty.FailOp(backingtest.OpReserve, 1, boom)
	_, err = e.Allocate(8, 8)
	assert.ErrorIs(t, err, boom)
	faulty.Reset()
	faulty.FailOp(backingtest.OpCommit, 1, boom)
	_, err = e.Allocate(8, 8)
	assert.ErrorIs(t, err, boom)
	assert.Zero(t, e.Live())
	assert.Zero(t, f.LiveReservations())
	assert.Zero(t, auth.Stats().Owned)

	faulty.Reset()
	a, err := e.Allocate(8, 8)
	require.NoError(t, err)
	faulty.FailOp(backingtest.OpUnreserve, 1, boom)
	out := e.Release(a)
	assert.Equal(t, accounting.Failed, out.Status)
	assert.ErrorIs(t, out.Err, boom)
	assert.Equal(t, 1, e.Live(), "a failed release keeps the allocation")
	assert.Equal(t, int64(64<<10), auth.Stats().Owned)
	require.True(t, e.Release(a).OK())
	assert.Zero(t, auth.Stats().Owned)
	assert.Zero(t, f.LiveGranules())
}

func TestEagerConcurrent(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("eager", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096})
	e, err := arena.NewEager(f, auth)
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := range 50 {
				a, err := e.Allocate(1+(w*50+i)%20000, 8)
				if err != nil {
					errs <- err
					return
				}
				if out := e.Release(a); !out.OK() {
					errs <- fmt.Errorf("release: %v", out)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	assert.Zero(t, e.Live())
	assert.Zero(t, f.LiveGranules())
	assert.Zero(t, auth.Stats().Owned)
}

// Eager over a ByBacking backing: the backing charges, the allocator charges nothing
// more.
func TestEagerByBacking(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Authority: auth})
	require.True(t, f.Accounting().OwnedByBacking())
	e, err := arena.NewEager[*backingtest.FakeReservation](f, nil)
	require.NoError(t, err)
	a, err := e.Allocate(1, 1)
	require.NoError(t, err)
	assert.Equal(t, int64(f.Granularity()), auth.Stats().Owned)
	require.True(t, e.Release(a).OK())
	assert.Zero(t, auth.Stats().Owned)
}
