package cuda_test

// Tests on a real GPU. Each skips itself where LoadDriver fails, or New reports no
// device, the stub library or no VMM support (errors matching ErrUnsupported), so
// they run on every machine and mean something only where a GPU is present.
// scripts/gpu-check.sh runs them on a GPU machine: -test.run GPU.

import (
	"bytes"
	"errors"
	"flag"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// fakeGPU runs the GPU tests on the fake driver, to check the tests themselves on a
// machine without a GPU: go test -run GPU -fakegpu.
var fakeGPU = flag.Bool("fakegpu", false, "run the GPU tests and benchmarks on the fake driver")

// gpuDriver returns the system driver (a fresh fake one with -fakegpu), or skips t.
func gpuDriver(t testing.TB) *cuda.Driver {
	t.Helper()
	if *fakeGPU {
		return cudatest.NewFakeDriver(cudatest.FakeDriverOptions{}).Driver()
	}
	d, err := cuda.LoadDriver()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	return d
}

// gpuBacking returns a Backing on GPU 0 of the real driver d (nil: the system
// driver), closed at cleanup, or skips t when there is no usable GPU.
func gpuBacking(t testing.TB, d *cuda.Driver, o cuda.Options) *cuda.Backing {
	t.Helper()
	if d == nil {
		d = gpuDriver(t)
	}
	if o.Authority == nil {
		o.Authority = gpuAuthority(0)
	}
	o.Driver = d
	b, err := cuda.New(o)
	if errors.Is(err, backing.ErrUnsupported) {
		t.Skipf("no usable GPU: %v", err)
	}
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, b.Close())
		s := o.Authority.Stats()
		assert.Zero(t, s.Owned, "owned bytes after Close")
		assert.Zero(t, s.Mapped, "mapped bytes after Close")
	})
	return b
}

// counting returns a copy of d whose VMM entry points count their calls.
type callCounts struct{ create, mapped, access, unmap, release atomic.Int64 }

func counting(d *cuda.Driver) (*cuda.Driver, *callCounts) {
	c := &callCounts{}
	w := *d
	w.MemCreate = func(h *uint64, size uintptr, p *cuda.MemAllocationProp, flags uint64) cuda.Code {
		c.create.Add(1)
		return d.MemCreate(h, size, p, flags)
	}
	w.MemMap = func(ptr uint64, size, off uintptr, h, flags uint64) cuda.Code {
		c.mapped.Add(1)
		return d.MemMap(ptr, size, off, h, flags)
	}
	w.MemSetAccess = func(ptr uint64, size uintptr, desc *cuda.MemAccessDesc, n uintptr) cuda.Code {
		c.access.Add(1)
		return d.MemSetAccess(ptr, size, desc, n)
	}
	w.MemUnmap = func(ptr uint64, size uintptr) cuda.Code {
		c.unmap.Add(1)
		return d.MemUnmap(ptr, size)
	}
	w.MemRelease = func(h uint64) cuda.Code {
		c.release.Add(1)
		return d.MemRelease(h)
	}
	return &w, c
}

func TestGPUDevice(t *testing.T) {
	b := gpuBacking(t, nil, cuda.Options{})
	free, total, err := b.MemInfo()
	require.NoError(t, err)
	t.Logf("driver %d, granularity %d KiB, memory free %d MiB of %d MiB",
		b.DriverVersion(), b.Granularity()>>10, free>>20, total>>20)
	assert.Positive(t, b.DriverVersion())
	assert.True(t, backing.IsPowerOfTwo(b.Granularity()))
	assert.Positive(t, total)
}

func TestGPUConformance(t *testing.T) {
	gpuBacking(t, nil, cuda.Options{}) // skips without a GPU
	backingtest.Run(t, func(t *testing.T) backing.Backing[*cuda.Reservation] {
		return gpuBacking(t, nil, cuda.Options{})
	})
}

func TestGPUConformancePooled(t *testing.T) {
	gpuBacking(t, nil, cuda.Options{})
	backingtest.Run(t, func(t *testing.T) backing.Backing[*cuda.Reservation] {
		return gpuBacking(t, nil, cuda.Options{Low: 2, High: 8})
	})
}

func TestGPURoundTrip(t *testing.T) {
	d, c := counting(gpuDriver(t))
	b := gpuBacking(t, d, cuda.Options{})
	g := b.Granularity()
	r, err := b.Reserve(8 * g)
	require.NoError(t, err)
	defer func() { assert.True(t, b.Unreserve(r).OK()) }()
	require.NoError(t, b.Commit(r, 0, 4*g))
	assert.EqualValues(t, 4, c.mapped.Load())
	assert.EqualValues(t, 1, c.access.Load(), "one cuMemSetAccess for the run")
	require.NoError(t, b.Memset(r, 0, 4*g, 0x3C))
	p := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7}, 1000)
	require.NoError(t, b.CopyIn(r, g-100, p), "across a granule boundary")
	require.NoError(t, b.Synchronize())
	got := make([]byte, len(p)+2)
	require.NoError(t, b.CopyOut(got, r, g-101))
	assert.Equal(t, byte(0x3C), got[0])
	assert.Equal(t, p, got[1:len(p)+1])
	assert.Equal(t, byte(0x3C), got[len(p)+1])
	// Device to device, then the last byte of the run.
	require.NoError(t, b.CopyDtoD(r, 3*g, r, g-100, len(p)))
	require.NoError(t, b.Synchronize())
	require.NoError(t, b.CopyOut(got[:len(p)], r, 3*g))
	assert.Equal(t, p, got[:len(p)])
	last := make([]byte, 1)
	require.NoError(t, b.CopyOut(last, r, 4*g-1))
	assert.Equal(t, []byte{0x3C}, last)
	assert.ErrorIs(t, b.CopyOut(last, r, 4*g), backing.ErrNotCommitted, "refused in Go, never sent to the device")
	before := c.unmap.Load()
	require.NoError(t, b.Decommit(r, 0, 4*g))
	assert.EqualValues(t, 1, c.unmap.Load()-before, "one cuMemUnmap for the run")
}

func TestGPUSharedPrefixAliasing(t *testing.T) {
	b := gpuBacking(t, nil, cuda.Options{})
	g := b.Granularity()
	a, err := b.Reserve(2 * g)
	require.NoError(t, err)
	bb, err := b.Reserve(2 * g)
	require.NoError(t, err)
	cc, err := b.Reserve(3 * g)
	require.NoError(t, err)
	require.NoError(t, b.Commit(a, 0, 2*g))
	prompt := bytes.Repeat([]byte("system prompt; "), 300)
	require.NoError(t, b.Memset(a, 0, 2*g, 0))
	require.NoError(t, b.CopyIn(a, g-len(prompt)/2, prompt))
	require.NoError(t, b.Synchronize()) // writes visible through aliases once complete
	require.NoError(t, b.Share(bb, 0, a, 0, 2*g, backing.ReadOnly))
	require.NoError(t, b.Share(cc, g, a, 0, 2*g, backing.ReadWrite))

	got := make([]byte, len(prompt))
	require.NoError(t, b.CopyOut(got, bb, g-len(prompt)/2))
	assert.Equal(t, prompt, got, "written through A, read through B")
	// Written through C (read-write alias), visible through A and B after a sync;
	// past the prompt, which stays as it was.
	at := g + len(prompt)
	require.NoError(t, b.Memset(cc, g+at, 5, 0x77))
	require.NoError(t, b.Synchronize())
	five := make([]byte, 5)
	require.NoError(t, b.CopyOut(five, a, at))
	assert.Equal(t, bytes.Repeat([]byte{0x77}, 5), five, "written through C, read through A")
	require.NoError(t, b.CopyOut(five, bb, at))
	assert.Equal(t, bytes.Repeat([]byte{0x77}, 5), five, "written through C, read through B")
	// Device to device out of the read-only alias into the owner's other granule.
	require.NoError(t, b.CopyDtoD(a, 0, bb, g-len(prompt)/2, len(prompt)))
	require.NoError(t, b.Synchronize())
	require.NoError(t, b.CopyOut(got, a, 0))
	assert.Equal(t, prompt, got)
	assert.ErrorIs(t, b.CopyIn(bb, 0, []byte{1}), cuda.ErrReadOnly)

	// Unmap A: B and C still read the prefix.
	require.True(t, b.Unreserve(a).OK())
	require.NoError(t, b.CopyOut(got, bb, g-len(prompt)/2))
	assert.Equal(t, prompt, got, "B after A went")
	require.NoError(t, b.CopyOut(got, cc, 2*g-len(prompt)/2))
	assert.Equal(t, prompt, got, "C after A went")
	assert.Zero(t, b.PoolStats().Idle, "the handles live while B and C map them")
	require.True(t, b.Unreserve(bb).OK())
	require.True(t, b.Unreserve(cc).OK())
	assert.Equal(t, int64(2*g), b.PoolStats().Idle, "back to the pool with the last mapping")
}

func TestGPUPoolReuse(t *testing.T) {
	d, c := counting(gpuDriver(t))
	b := gpuBacking(t, d, cuda.Options{Low: 4})
	g := b.Granularity()
	assert.EqualValues(t, 4, c.create.Load(), "New filled the pool to Low")
	r, err := b.Reserve(4 * g)
	require.NoError(t, err)
	s, err := b.Reserve(4 * g)
	require.NoError(t, err)
	for range 3 {
		require.NoError(t, b.Commit(r, 0, 4*g))
		require.NoError(t, b.Memset(r, 0, 4*g, 9))
		require.NoError(t, b.Decommit(r, 0, 4*g))
		require.NoError(t, b.Commit(s, 0, 4*g), "the same handles, remapped elsewhere")
		require.NoError(t, b.Memset(s, 0, 4*g, 8), "a remapped handle needs (and got) access again")
		require.NoError(t, b.Decommit(s, 0, 4*g))
	}
	require.NoError(t, b.Synchronize())
	assert.EqualValues(t, 4, c.create.Load(), "no cuMemCreate after the pool was filled")
	assert.Zero(t, c.release.Load())
	require.True(t, b.Unreserve(r).OK())
	require.True(t, b.Unreserve(s).OK())
}

func TestGPUMemInfo(t *testing.T) {
	b := gpuBacking(t, nil, cuda.Options{})
	g := b.Granularity()
	const n = 64
	free0, _, err := b.MemInfo()
	require.NoError(t, err)
	r, err := b.Reserve(n * g)
	require.NoError(t, err)
	require.NoError(t, b.Commit(r, 0, n*g))
	free1, _, err := b.MemInfo()
	require.NoError(t, err)
	t.Logf("free: %d MiB before, %d MiB with %d MiB committed", free0>>20, free1>>20, n*g>>20)
	// Other processes may allocate meanwhile; the commit itself must show.
	assert.GreaterOrEqual(t, free0-free1, int64(n*g)*3/4, "committed memory is physical")
	require.True(t, b.Unreserve(r).OK())
	free2, _, err := b.MemInfo()
	require.NoError(t, err)
	assert.Less(t, free2, free0-int64(n*g)/2, "the pool still holds the handles")
	released, err := b.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(n*g), released)
	free3, _, err := b.MemInfo()
	require.NoError(t, err)
	t.Logf("free: %d MiB pooled, %d MiB trimmed", free2>>20, free3>>20)
	assert.Greater(t, free3, free2+int64(n*g)/2, "trimmed handles go back to the device")
}

// rawGPU binds the real driver's primary context of device 0 on a locked thread.
func rawGPU(t *testing.T) (*cuda.Driver, cuda.MemAllocationProp, uintptr) {
	t.Helper()
	d := gpuDriver(t)
	b := gpuBacking(t, d, cuda.Options{}) // skips without a usable GPU; keeps the context retained
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	var ctx uintptr
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRetain(&ctx, 0))
	t.Cleanup(func() { d.DevicePrimaryCtxRelease(0) })
	require.Equal(t, cuda.Success, d.CtxSetCurrent(ctx))
	prop := cuda.MemAllocationProp{Type: cuda.AllocationPinned, Location: cuda.MemLocation{Type: cuda.LocationDevice}}
	return d, prop, uintptr(b.Granularity())
}

// The driver's own rules, as the fake models them: release while mapped frees the
// memory only with the last mapping; a partial unmap fails and changes nothing.
func TestGPURawDriverRules(t *testing.T) {
	d, prop, g := rawGPU(t)
	var va uint64
	require.Equal(t, cuda.Success, d.MemAddressReserve(&va, 4*g, g, 0, 0))
	defer d.MemAddressFree(va, 4*g)
	var h, h2 uint64
	require.Equal(t, cuda.Success, d.MemCreate(&h, g, &prop, 0))
	require.Equal(t, cuda.Success, d.MemCreate(&h2, g, &prop, 0))
	require.Equal(t, cuda.Success, d.MemMap(va, g, 0, h, 0))
	require.Equal(t, cuda.Success, d.MemMap(va+uint64(g), g, 0, h2, 0))
	assert.NotEqual(t, cuda.Success, d.MemMap(va, g, 0, h2, 0), "map over a mapping")
	assert.NotEqual(t, cuda.Success, d.MemUnmap(va, g/2), "unmap of part of a mapping")
	require.Equal(t, cuda.Success, d.MemMap(va+3*uint64(g), g, 0, h, 0), "the same handle twice")
	desc := cuda.MemAccessDesc{Location: prop.Location, Flags: cuda.AccessReadWrite}
	require.Equal(t, cuda.Success, d.MemSetAccess(va, 2*g, &desc, 1), "one call over two mappings")
	require.Equal(t, cuda.Success, d.MemSetAccess(va+3*uint64(g), g, &desc, 1))
	require.Equal(t, cuda.Success, d.MemsetD8(va, 0x42, 2*g))
	require.Equal(t, cuda.Success, d.CtxSynchronize())
	var free0, free1, free2, total uintptr
	require.Equal(t, cuda.Success, d.MemGetInfo(&free0, &total))
	require.Equal(t, cuda.Success, d.MemRelease(h), "release while mapped")
	require.Equal(t, cuda.Success, d.MemUnmap(va, 2*g), "one unmap over two mappings")
	require.Equal(t, cuda.Success, d.MemGetInfo(&free1, &total))
	t.Logf("free %d, %d after release + unmap of one of two mappings", free0, free1)
	got := make([]byte, 1)
	require.Equal(t, cuda.Success, d.MemcpyDtoH(cuda.BytesAddr(got), va+3*uint64(g), 1), "the other mapping still reads")
	assert.Equal(t, byte(0x42), got[0])
	require.Equal(t, cuda.Success, d.MemUnmap(va+3*uint64(g), g))
	require.Equal(t, cuda.Success, d.MemRelease(h2))
	require.Equal(t, cuda.Success, d.MemGetInfo(&free2, &total))
	t.Logf("free %d after the last unmap", free2)
	assert.Greater(t, free2, free1, "memory freed with the last mapping")
}
