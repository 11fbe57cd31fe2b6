package cuda_test

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

func TestHostSymbols(t *testing.T) {
	names, _ := cuda.SymbolNames()
	for _, v2 := range []string{"cuMemHostRegister", "cuStreamDestroy", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync"} {
		assert.Contains(t, names, v2+"_v2")
		assert.NotContains(t, names, v2, "legacy ABI symbol %s", v2)
	}
	for _, plain := range []string{"cuMemHostUnregister", "cuStreamCreate", "cuStreamSynchronize"} {
		assert.Contains(t, names, plain)
	}
}

// reservedBytes returns size bytes of reserved, uncommitted host address space as a
// slice: the fake only records what is registered, so a test can pin more than the
// machine has without touching a page. Unreserved at cleanup.
func reservedBytes(t *testing.T, size int) []byte {
	t.Helper()
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: 2 << 20})
	require.NoError(t, err)
	r, err := p.Reserve(size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Unreserve(r).Err) })
	base := p.Base(r)
	// Safety: [base, base+size) is a live reservation for the test's life; the fake
	// driver never reads or writes these bytes (nothing is copied through them).
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&base))), size)
}

func TestPinHostChunks(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	const size = 2*cuda.MaxPinChunk + 2<<30 // 130 GiB: three registrations
	p := reservedBytes(t, size)
	require.NoError(t, x.b.PinHost(p))
	assert.Equal(t, []int{cuda.MaxPinChunk, cuda.MaxPinChunk, 2 << 30}, x.f.HostRegisterSizes())
	n, bytes := x.f.HostRegistered()
	assert.Equal(t, 3, n)
	assert.Equal(t, int64(size), bytes)
	assert.Equal(t, int64(size), x.b.PinnedHost())

	assert.ErrorIs(t, x.b.PinHost(p[4<<20:8<<20]), cuda.ErrPinned, "overlapping pin")
	assert.ErrorIs(t, x.b.UnpinHost(p[:4<<20]), cuda.ErrNotPinned, "not the slice pinned")
	assert.ErrorIs(t, x.b.UnpinHost(nil), cuda.ErrNotPinned)
	assert.Error(t, x.b.PinHost(nil))

	require.NoError(t, x.b.UnpinHost(p))
	n, _ = x.f.HostRegistered()
	assert.Zero(t, n)
	assert.Zero(t, x.b.PinnedHost())
	assert.ErrorIs(t, x.b.UnpinHost(p), cuda.ErrNotPinned, "twice")
}

// A registration the driver refuses midway leaves nothing pinned.
func TestPinHostFailureRollsBack(t *testing.T) {
	tests := []struct {
		name string
		fo   cudatest.FakeDriverOptions
		fail int // the failing cuMemHostRegister call; 0: none injected
	}{
		{"second chunk fails", cudatest.FakeDriverOptions{}, 2},
		{"driver limit below the chunk", cudatest.FakeDriverOptions{MaxHostRegister: 1 << 30}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := fakeBacking(t, tt.fo, cuda.Options{})
			if tt.fail > 0 {
				x.f.Fail("cuMemHostRegister_v2", tt.fail, cuda.CodeOutOfMemory)
			}
			p := reservedBytes(t, 2*cuda.MaxPinChunk+2<<20)
			err := x.b.PinHost(p)
			require.Error(t, err)
			assert.ErrorIs(t, err, backing.ErrOutOfMemory)
			n, _ := x.f.HostRegistered()
			assert.Zero(t, n, "nothing stays registered")
			assert.Zero(t, x.b.PinnedHost())
		})
	}
}

// streamFx is a fake backing with one committed 2-granule reservation and a stream.
func streamFx(t *testing.T) (*fx, *cuda.Reservation, *cuda.Stream) {
	t.Helper()
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	r, err := x.b.Reserve(2 * x.g)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, x.b.Unreserve(r).Err) })
	require.NoError(t, x.b.Commit(r, 0, 2*x.g))
	s, err := x.b.NewStream()
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			assert.ErrorIs(t, err, cuda.ErrStreamClosed)
		}
	})
	return x, r, s
}

func TestStreamRoundTripPinned(t *testing.T) {
	x, r, s := streamFx(t)
	n := 2*x.g - 100 // not granule-aligned, across both granules
	src := testutil.Pattern(n, 0x5a)
	hostIn := bytes.Clone(src)
	require.NoError(t, x.b.PinHost(hostIn))
	t.Cleanup(func() { require.NoError(t, x.b.UnpinHost(hostIn)) })

	require.NoError(t, s.CopyInAsync(r, 100, hostIn))
	dev := make([]byte, n)
	require.NoError(t, x.b.CopyOut(dev, r, 100))
	assert.Equal(t, make([]byte, n), dev, "a pinned copy has not run before Synchronize")
	require.NoError(t, s.Synchronize())

	hostOut := make([]byte, n)
	require.NoError(t, x.b.PinHost(hostOut))
	t.Cleanup(func() { require.NoError(t, x.b.UnpinHost(hostOut)) })
	require.NoError(t, s.CopyOutAsync(hostOut, r, 100))
	assert.Equal(t, make([]byte, n), hostOut, "not yet copied")
	require.NoError(t, s.Synchronize())
	assert.Equal(t, src, hostOut, "bytes round-trip exactly")
	assert.Zero(t, x.f.PageableCopies())
}

// Copies from and to memory that is not pinned still work: the driver stages them.
func TestStreamRoundTripPageable(t *testing.T) {
	x, r, s := streamFx(t)
	src := testutil.Pattern(x.g, 3)
	require.NoError(t, s.CopyInAsync(r, x.g, src))
	dst := make([]byte, x.g)
	require.NoError(t, s.CopyOutAsync(dst, r, x.g))
	require.NoError(t, s.Synchronize())
	assert.Equal(t, src, dst)
	assert.Equal(t, 2, x.f.PageableCopies())
}

func TestStreamErrors(t *testing.T) {
	x, r, s := streamFx(t)
	buf := make([]byte, 64)

	t.Run("range", func(t *testing.T) {
		assert.ErrorIs(t, s.CopyOutAsync(buf, r, 2*x.g-10), backing.ErrOutOfRange)
		assert.ErrorIs(t, s.CopyInAsync(r, -1, buf), backing.ErrInvalidRange)
		assert.NoError(t, s.CopyInAsync(r, 0, nil), "an empty copy is nothing")
	})
	t.Run("foreign", func(t *testing.T) {
		y := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r2, err := y.b.Reserve(y.g)
		require.NoError(t, err)
		defer func() { require.NoError(t, y.b.Unreserve(r2).Err) }()
		assert.ErrorIs(t, s.CopyOutAsync(buf, r2, 0), backing.ErrForeignReservation)
	})
	t.Run("not committed", func(t *testing.T) {
		require.NoError(t, x.b.Decommit(r, x.g, x.g))
		defer func() { require.NoError(t, x.b.Commit(r, x.g, x.g)) }()
		assert.ErrorIs(t, s.CopyOutAsync(buf, r, x.g), backing.ErrNotCommitted)
	})
	t.Run("decommitted before synchronize", func(t *testing.T) {
		pinned := make([]byte, 64)
		require.NoError(t, x.b.PinHost(pinned))
		defer func() { require.NoError(t, x.b.UnpinHost(pinned)) }()
		require.NoError(t, s.CopyOutAsync(pinned, r, x.g))
		require.NoError(t, x.b.Decommit(r, x.g, x.g))
		defer func() { require.NoError(t, x.b.Commit(r, x.g, x.g)) }()
		err := s.Synchronize()
		var res *cuda.Result
		require.ErrorAs(t, err, &res)
		assert.Equal(t, cuda.CodeIllegalAddress, res.Code)
	})
	t.Run("driver fault", func(t *testing.T) {
		x.f.Fail("cuMemcpyDtoHAsync_v2", 1, cuda.CodeUnknown)
		var res *cuda.Result
		require.ErrorAs(t, s.CopyOutAsync(buf, r, 0), &res)
		assert.Equal(t, "cuMemcpyDtoHAsync_v2", res.Func)
	})
	t.Run("closed", func(t *testing.T) {
		s2, err := x.b.NewStream()
		require.NoError(t, err)
		require.NoError(t, s2.Close())
		assert.ErrorIs(t, s2.Close(), cuda.ErrStreamClosed)
		assert.ErrorIs(t, s2.Synchronize(), cuda.ErrStreamClosed)
		assert.ErrorIs(t, s2.CopyInAsync(r, 0, buf), cuda.ErrStreamClosed)
	})
}

// A Driver without the host-memory entry points still backs device memory; pinning
// and streams then fail cleanly.
func TestHostSymbolsMissing(t *testing.T) {
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	d := *f.Driver()
	d.MemHostRegister, d.StreamCreate = nil, nil
	b, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: &d})
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	_, err = b.NewStream()
	assert.ErrorIs(t, err, cuda.ErrMissingSymbol)
	err = b.PinHost(make([]byte, 8))
	assert.ErrorIs(t, err, cuda.ErrMissingSymbol)
	assert.Contains(t, err.Error(), "cuMemHostRegister_v2")
}

func TestFakeHostLeaks(t *testing.T) {
	x := newFx(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	s, err := x.b.NewStream()
	require.NoError(t, err)
	p := make([]byte, 8)
	require.NoError(t, x.b.PinHost(p))
	require.NoError(t, x.b.Close())
	err = x.f.CheckLeaks()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "1 registered host ranges")
	assert.Contains(t, err.Error(), "1 live streams")
	_ = s
}
