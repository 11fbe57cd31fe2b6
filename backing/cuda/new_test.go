package cuda_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

func TestNewErrors(t *testing.T) {
	for _, tt := range []struct {
		name string
		fo   cudatest.FakeDriverOptions
		o    cuda.Options
		want error
		code cuda.Code // the driver result the error also carries, if any
	}{
		{"no authority", cudatest.FakeDriverOptions{}, cuda.Options{Authority: nil}, cuda.ErrBadOptions, 0},
		{"negative ordinal", cudatest.FakeDriverOptions{}, cuda.Options{Device: -1}, cuda.ErrBadDevice, 0},
		{"negative low", cudatest.FakeDriverOptions{}, cuda.Options{Low: -1}, cuda.ErrBadOptions, 0},
		{"negative high", cudatest.FakeDriverOptions{}, cuda.Options{High: -1}, cuda.ErrBadOptions, 0},
		{"low above high", cudatest.FakeDriverOptions{}, cuda.Options{Low: 3, High: 2}, cuda.ErrBadOptions, 0},
		{"authority on another device", cudatest.FakeDriverOptions{}, cuda.Options{Authority: accounting.NewGovernor().Authority("x", accounting.GPU(1))}, cuda.ErrBadOptions, 0},
		{"authority on the host", cudatest.FakeDriverOptions{}, cuda.Options{Authority: accounting.NewGovernor().Authority("x", accounting.HostKey)}, cuda.ErrBadOptions, 0},
		{"stub library", cudatest.FakeDriverOptions{InitResult: cuda.CodeStubLibrary}, cuda.Options{}, cuda.ErrStubLibrary, cuda.CodeStubLibrary},
		{"no device", cudatest.FakeDriverOptions{InitResult: cuda.CodeNoDevice}, cuda.Options{}, cuda.ErrNoDevice, cuda.CodeNoDevice},
		{"ordinal past the count", cudatest.FakeDriverOptions{Devices: 2}, cuda.Options{Device: 2}, cuda.ErrBadDevice, 0},
		{"no VMM", cudatest.FakeDriverOptions{NoVMM: true}, cuda.Options{}, cuda.ErrNoVMM, 0},
		{"granularity not a power of two", cudatest.FakeDriverOptions{Granularity: 3 << 20}, cuda.Options{}, cuda.ErrBadGranularity, 0},
		{"deinitialized", cudatest.FakeDriverOptions{InitResult: cuda.CodeDeinitialized}, cuda.Options{}, nil, cuda.CodeDeinitialized},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := cudatest.NewFakeDriver(tt.fo)
			o := tt.o
			o.Driver = f.Driver()
			if o.Authority == nil && tt.want != cuda.ErrBadOptions {
				o.Authority = gpuAuthority(max(o.Device, 0))
			}
			b, err := cuda.New(o)
			require.Error(t, err)
			assert.Nil(t, b)
			if tt.want != nil {
				assert.ErrorIs(t, err, tt.want)
			}
			var res *cuda.Result
			if tt.code != 0 {
				require.True(t, errors.As(err, &res), "%v carries the driver result", err)
				assert.Equal(t, tt.code, res.Code)
				assert.Equal(t, tt.code.String(), res.Name, "the name comes from cuGetErrorName")
			}
			assert.NoError(t, f.CheckLeaks(), "a failed New leaves nothing behind")
		})
	}
}

func TestNewIncompleteDriver(t *testing.T) {
	d := *cudatest.NewFakeDriver(cudatest.FakeDriverOptions{}).Driver()
	d.MemSetAccess = nil
	_, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: &d})
	assert.ErrorIs(t, err, cuda.ErrMissingSymbol)
	assert.Contains(t, err.Error(), "cuMemSetAccess")
}

func TestNewDriverFailures(t *testing.T) {
	// Every driver call New makes may fail; New then returns the *Result and leaves
	// no context retained and no handle behind.
	for n := 1; ; n++ {
		f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
		f.Fail("", n, cuda.CodeUnknown)
		b, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: f.Driver(), Low: 2})
		if f.Pending() == 1 {
			require.NoError(t, err)
			f.ClearFaults()
			require.NoError(t, b.Close())
			require.NoError(t, f.CheckLeaks())
			require.Greater(t, n, 8, "New makes at least this many calls")
			return
		}
		if err == nil {
			// A failing cuDriverGetVersion is only reported, never fatal.
			require.NoError(t, b.Close(), "call %d", n)
			assert.Zero(t, b.DriverVersion(), "call %d", n)
		} else {
			var res *cuda.Result
			assert.True(t, errors.As(err, &res), "call %d: %v", n, err)
		}
		assert.NoError(t, f.CheckLeaks(), "call %d", n)
	}
}

func TestNewRecommendedGranularity(t *testing.T) {
	for _, tt := range []struct {
		name     string
		min, rec int
		want     int
	}{
		{"equal", 2 << 20, 2 << 20, 2 << 20},
		{"recommended a multiple", 64 << 10, 2 << 20, 2 << 20},
		{"recommended not a multiple", 2 << 20, 3 << 20, 2 << 20},
		{"recommended below minimum", 2 << 20, 1 << 20, 2 << 20},
	} {
		t.Run(tt.name, func(t *testing.T) {
			x := fakeBacking(t, cudatest.FakeDriverOptions{Granularity: tt.min, Recommended: tt.rec}, cuda.Options{})
			assert.Equal(t, tt.want, x.b.Granularity())
		})
	}
}

func TestIdentity(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{Devices: 2, Version: 13000}, cuda.Options{Device: 1})
	assert.Equal(t, accounting.GPU(1), x.b.Device())
	assert.True(t, x.b.Accounting().OwnedByBacking())
	assert.Same(t, x.auth, x.b.Accounting().Authority())
	assert.False(t, x.b.CommitZeroes(), "pooled handles keep old contents")
	assert.False(t, backing.IsHostAccessible(x.b))
	assert.Equal(t, 13000, x.b.DriverVersion())
	assert.Equal(t, 1, x.f.RetainedContexts(1), "the primary context is retained once")
	assert.Zero(t, x.f.RetainedContexts(0))
}

func TestClose(t *testing.T) {
	x := newFx(t, cudatest.FakeDriverOptions{}, cuda.Options{Low: 2})
	r, err := x.b.Reserve(2 * x.g)
	require.NoError(t, err)
	require.NoError(t, x.b.Commit(r, 0, x.g))
	err = x.b.Close()
	assert.ErrorIs(t, err, cuda.ErrBusy)
	require.NoError(t, x.b.Commit(r, x.g, x.g), "a refused Close changes nothing")
	require.True(t, x.b.Unreserve(r).OK())
	require.NoError(t, x.b.Close())
	x.checkClosed(t)
	for name, fn := range map[string]func(){
		"Reserve":   func() { _, _ = x.b.Reserve(x.g) },
		"Commit":    func() { _ = x.b.Commit(r, 0, x.g) },
		"Prefill":   func() { _ = x.b.Prefill(1) },
		"Trim":      func() { _, _ = x.b.Trim(0) },
		"Memset":    func() { _ = x.b.Memset(r, 0, 1, 0) },
		"Sync":      func() { _ = x.b.Synchronize() },
		"MemInfo":   func() { _, _, _ = x.b.MemInfo() },
		"Unreserve": func() { x.b.Unreserve(r) },
	} {
		assert.PanicsWithValue(t, cuda.PanicClosed, fn, name)
	}
	assert.ErrorIs(t, x.b.Close(), cuda.ErrClosed, "a second Close changes nothing")
	assert.PanicsWithValue(t, cuda.PanicNilReservation, func() { x.b.Base(nil) })
	assert.PanicsWithValue(t, cuda.PanicNilReservation, func() { x.b.Size(nil) })
}

func TestCloseStuckHandles(t *testing.T) {
	// A handle the driver refuses to release stays owned, is retried by Trim, and
	// Close reports what it could not give back.
	x := newFx(t, cudatest.FakeDriverOptions{}, cuda.Options{Low: 2})
	x.f.Fail("cuMemRelease", 1, cuda.CodeUnknown)
	n, err := x.b.Trim(0)
	assert.Error(t, err)
	assert.Equal(t, int64(x.g), n, "one of two released")
	assert.Equal(t, int64(x.g), x.b.PoolStats().Owned, "the stuck handle stays owned")
	assert.Zero(t, x.b.PoolStats().Idle, "but is not handed out")
	x.checkBooks(t, "stuck")
	n, err = x.b.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(x.g), n, "Trim retries the stuck handle")
	require.NoError(t, x.b.Close())
	x.checkClosed(t)
}
