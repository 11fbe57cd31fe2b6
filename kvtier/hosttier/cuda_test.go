package hosttier_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// gpuFx is a CUDA backing on the fake driver with one committed device range.
type gpuFx struct {
	f   *cudatest.FakeDriver
	b   *cuda.Backing
	r   *cuda.Reservation
	gpu *accounting.Authority
}

func newGPU(t *testing.T, granules int) *gpuFx {
	t.Helper()
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	gpu := accounting.NewGovernor().Authority("gpu", accounting.GPU(0))
	b, err := cuda.New(cuda.Options{Authority: gpu, Driver: f.Driver()})
	require.NoError(t, err)
	r, err := b.Reserve(granules * b.Granularity())
	require.NoError(t, err)
	require.NoError(t, b.Commit(r, 0, granules*b.Granularity()))
	x := &gpuFx{f: f, b: b, r: r, gpu: gpu}
	t.Cleanup(func() {
		require.NoError(t, b.Unreserve(r).Err)
		require.NoError(t, b.Close())
		assert.NoError(t, f.CheckLeaks(), "registrations, streams and handles all gone")
	})
	return x
}

// cudaTier is a tier pinned for x's device; registered first so that it is closed
// before the backing.
func cudaTier(t *testing.T, x *gpuFx, budget int64, chunk int) (*hosttier.Tier, *accounting.Authority) {
	t.Helper()
	a := ledger(t, budget)
	tr, err := hosttier.New(hosttier.Options{Budget: budget, Authority: a, CUDA: x.b, PinChunk: chunk, Granule: 2 << 20})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, tr.Close())
		assert.Zero(t, a.Stats().Owned)
	})
	return tr, a
}

// storeFromDevice stores the device bytes [off, off+n) under key i as the cache
// would: copied by the DMA engine into the tier's memory inside fill.
func storeFromDevice(tr *hosttier.Tier, x *gpuFx, i, off, n int, pinned *bool) error {
	return tr.Store(bg, key(i), n, func(dst []byte) error {
		if pinned != nil {
			*pinned = tr.IsPinned(dst)
		}
		if err := tr.Stream().CopyOutAsync(dst, x.r, off); err != nil {
			return err
		}
		return tr.Stream().Synchronize()
	})
}

func loadToDevice(tr *hosttier.Tier, x *gpuFx, i, off int) error {
	return tr.Load(bg, key(i), func(src []byte) error {
		if err := tr.Stream().CopyInAsync(x.r, off, src); err != nil {
			return err
		}
		return tr.Stream().Synchronize()
	})
}

func TestCUDARoundTrip(t *testing.T) {
	x := newGPU(t, 4)
	g := x.b.Granularity()
	tr, a := cudaTier(t, x, 16<<20, 4<<20)
	require.NoError(t, tr.WaitPinned(bg))
	s := tr.Stats()
	assert.Equal(t, int64(16<<20), s.Pinned)
	assert.Equal(t, int64(16<<20), s.Held, "a CUDA tier commits its region at once")
	assert.Equal(t, s.Held, a.Stats().Owned)
	assert.Equal(t, []int{4 << 20, 4 << 20, 4 << 20, 4 << 20}, x.f.HostRegisterSizes(), "pinned in chunks")

	want := content(7, 2*g)
	require.NoError(t, x.b.CopyIn(x.r, 0, want))
	var pinned bool
	require.NoError(t, storeFromDevice(tr, x, 7, 0, 2*g, &pinned))
	assert.True(t, pinned, "fill got pinned memory")

	require.NoError(t, loadToDevice(tr, x, 7, 2*g))
	got := make([]byte, 2*g)
	require.NoError(t, x.b.CopyOut(got, x.r, 2*g))
	assert.True(t, bytes.Equal(want, got), "every byte read back on the device")
	assert.Zero(t, x.f.PageableCopies(), "both copies used pinned memory")
	n, _ := x.f.HostRegistered()
	assert.Equal(t, 4, n)

	_, err := tr.Trim()
	require.NoError(t, err)
	assert.Equal(t, int64(16<<20), tr.Stats().Held, "Trim keeps a pinned region")
}

// Pinning that fails partway leaves the rest pageable; values there still round-trip.
func TestCUDAPinningFails(t *testing.T) {
	x := newGPU(t, 2)
	g := x.b.Granularity()
	x.f.Fail("cuMemHostRegister_v2", 2, cuda.CodeOutOfMemory)
	tr, _ := cudaTier(t, x, 8<<20, 2<<20)
	err := tr.WaitPinned(bg)
	require.Error(t, err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.Equal(t, int64(2<<20), tr.Stats().Pinned, "the first piece stays pinned")

	require.NoError(t, x.b.CopyIn(x.r, 0, content(1, g)))
	var pinned bool
	require.NoError(t, storeFromDevice(tr, x, 1, 0, g, &pinned))
	assert.True(t, pinned, "the first granule is pinned")
	require.NoError(t, x.b.CopyIn(x.r, g, content(2, g)))
	require.NoError(t, storeFromDevice(tr, x, 2, g, g, &pinned))
	assert.False(t, pinned, "the second is not")
	assert.Equal(t, 1, x.f.PageableCopies())

	require.NoError(t, x.b.Memset(x.r, 0, 2*g, 0))
	require.NoError(t, loadToDevice(tr, x, 2, 0))
	require.NoError(t, loadToDevice(tr, x, 1, g))
	got := make([]byte, 2*g)
	require.NoError(t, x.b.CopyOut(got, x.r, 0))
	assert.True(t, bytes.Equal(append(content(2, g), content(1, g)...), got))
}

// A copy the driver fails is a failed store or load, never a crash or a wrong value:
// the cache counts it as a miss and goes on.
func TestCUDACopyFailures(t *testing.T) {
	x := newGPU(t, 1)
	g := x.b.Granularity()
	tr, _ := cudaTier(t, x, 4<<20, 0)
	require.NoError(t, tr.WaitPinned(bg))
	require.NoError(t, x.b.CopyIn(x.r, 0, content(3, g)))

	x.f.Fail("cuMemcpyDtoHAsync_v2", 1, cuda.CodeUnknown)
	err := storeFromDevice(tr, x, 3, 0, g, nil)
	var res *cuda.Result
	require.ErrorAs(t, err, &res)
	assert.Equal(t, cuda.CodeUnknown, res.Code)
	_, err = load(tr, 3)
	assert.ErrorIs(t, err, kv.ErrTierMiss, "a failed store keeps nothing")

	x.f.Fail("cuStreamSynchronize", 1, cuda.CodeIllegalAddress)
	assert.Error(t, storeFromDevice(tr, x, 3, 0, g, nil), "a copy that fails on the device")
	_, err = load(tr, 3)
	assert.ErrorIs(t, err, kv.ErrTierMiss)

	require.NoError(t, storeFromDevice(tr, x, 3, 0, g, nil), "the tier goes on")
	x.f.Fail("cuMemcpyHtoDAsync_v2", 1, cuda.CodeUnknown)
	assert.Error(t, loadToDevice(tr, x, 3, 0))
	require.NoError(t, x.b.Memset(x.r, 0, g, 0))
	require.NoError(t, loadToDevice(tr, x, 3, 0), "the value is still held after a failed load")
	got := make([]byte, g)
	require.NoError(t, x.b.CopyOut(got, x.r, 0))
	assert.True(t, bytes.Equal(content(3, g), got))
	s := tr.Stats()
	assert.Equal(t, int64(1), s.Stores)
	assert.Equal(t, int64(2), s.Hits)
}

func TestCUDABadOptions(t *testing.T) {
	x := newGPU(t, 1)
	// A stream the driver can not create: New fails and leaves nothing behind.
	x.f.Fail("cuStreamCreate", 1, cuda.CodeOutOfMemory)
	a := ledger(t, 4<<20)
	_, err := hosttier.New(hosttier.Options{Budget: 4 << 20, Authority: a, CUDA: x.b})
	require.Error(t, err)
	assert.Zero(t, a.Stats().Owned)
	// A ledger that can not cover the region refuses the eager commit.
	small := ledger(t, 2<<20)
	_, err = hosttier.New(hosttier.Options{Budget: 4 << 20, Authority: small, CUDA: x.b})
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
}

func TestCUDAWaitPinnedCancelled(t *testing.T) {
	x := newGPU(t, 1)
	tr, _ := cudaTier(t, x, 4<<20, 0)
	ctx, cancel := context.WithCancel(bg)
	cancel()
	err := tr.WaitPinned(ctx)
	if err != nil { // pinning may be over already; if not, the wait ends with ctx
		assert.ErrorIs(t, err, context.Canceled)
	}
	require.NoError(t, tr.WaitPinned(bg))
	assert.False(t, tr.IsPinned(nil))
	assert.Equal(t, 4<<20, tr.MaxValueSize())
}
