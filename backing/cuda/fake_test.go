package cuda_test

import (
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

const mib = 1 << 20

// rawFake is a fake driver initialised and bound on the test's (locked) thread, for
// tests that call the seam directly.
type rawFake struct {
	t   *testing.T
	f   *cudatest.FakeDriver
	d   *cuda.Driver
	ctx uintptr
}

func newRawFake(t *testing.T, opts cudatest.FakeDriverOptions) *rawFake {
	t.Helper()
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	f := cudatest.NewFakeDriver(opts)
	d := f.Driver()
	require.Equal(t, cuda.Success, d.Init(0))
	x := &rawFake{t: t, f: f, d: d}
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRetain(&x.ctx, 0))
	require.Equal(t, cuda.Success, d.CtxSetCurrent(x.ctx))
	return x
}

func (x *rawFake) prop() *cuda.MemAllocationProp {
	return &cuda.MemAllocationProp{Type: cuda.AllocationPinned, Location: cuda.MemLocation{Type: cuda.LocationDevice}}
}

func (x *rawFake) reserve(size uintptr) uint64 {
	x.t.Helper()
	var p uint64
	require.Equal(x.t, cuda.Success, x.d.MemAddressReserve(&p, size, 0, 0, 0))
	return p
}

func (x *rawFake) create(size uintptr) uint64 {
	x.t.Helper()
	var h uint64
	require.Equal(x.t, cuda.Success, x.d.MemCreate(&h, size, x.prop(), 0))
	return h
}

func (x *rawFake) access(va uint64, size uintptr, flags int32) cuda.Code {
	desc := cuda.MemAccessDesc{Location: cuda.MemLocation{Type: cuda.LocationDevice}, Flags: flags}
	return x.d.MemSetAccess(va, size, &desc, 1)
}

func (x *rawFake) write(va uint64, p []byte) cuda.Code {
	return x.d.MemcpyHtoD(va, unsafe.Pointer(&p[0]), uintptr(len(p)))
}

func (x *rawFake) read(va uint64, n int) ([]byte, cuda.Code) {
	p := make([]byte, n)
	return p, x.d.MemcpyDtoH(unsafe.Pointer(&p[0]), va, uintptr(n))
}

func TestFakeNeedsInit(t *testing.T) {
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	d := f.Driver()
	var n int32
	assert.Equal(t, cuda.CodeNotInitialized, d.DeviceGetCount(&n))
	var v int32
	assert.Equal(t, cuda.Success, d.DriverGetVersion(&v), "cuDriverGetVersion works before cuInit")
	assert.EqualValues(t, 12060, v)
	assert.Equal(t, cuda.CodeInvalidValue, d.Init(1), "cuInit flags must be 0")
	assert.Equal(t, cuda.Success, d.Init(0))
	assert.Equal(t, cuda.Success, d.DeviceGetCount(&n))
	assert.EqualValues(t, 1, n)

	for _, code := range []cuda.Code{cuda.CodeStubLibrary, cuda.CodeNoDevice} {
		d := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{InitResult: code}).Driver()
		assert.Equal(t, code, d.Init(0))
		assert.Equal(t, cuda.CodeNotInitialized, d.DeviceGetCount(&n))
	}
}

func TestFakeDeviceQueries(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{Devices: 2, Granularity: 64 << 10, Recommended: 2 * mib})
	d := x.d
	var dev, v int32
	assert.Equal(t, cuda.Success, d.DeviceGet(&dev, 1))
	assert.EqualValues(t, 1, dev)
	assert.Equal(t, cuda.CodeInvalidDevice, d.DeviceGet(&dev, 2))
	assert.Equal(t, cuda.CodeInvalidDevice, d.DeviceGet(&dev, -1))
	assert.Equal(t, cuda.Success, d.DeviceGetAttribute(&v, cuda.AttrVMMSupported, 0))
	assert.EqualValues(t, 1, v)
	assert.Equal(t, cuda.CodeInvalidValue, d.DeviceGetAttribute(&v, 9999, 0))
	var g uintptr
	assert.Equal(t, cuda.Success, d.MemGetAllocationGranularity(&g, x.prop(), cuda.GranularityMinimum))
	assert.EqualValues(t, 64<<10, g)
	assert.Equal(t, cuda.Success, d.MemGetAllocationGranularity(&g, x.prop(), cuda.GranularityRecommended))
	assert.EqualValues(t, 2*mib, g)
	bad := *x.prop()
	bad.Reserved[2] = 1
	assert.Equal(t, cuda.CodeInvalidValue, d.MemGetAllocationGranularity(&g, &bad, cuda.GranularityMinimum))

	noVMM := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{NoVMM: true}).Driver()
	require.Equal(t, cuda.Success, noVMM.Init(0))
	assert.Equal(t, cuda.Success, noVMM.DeviceGetAttribute(&v, cuda.AttrVMMSupported, 0))
	assert.EqualValues(t, 0, v)
}

func TestFakeCreateRules(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{Memory: 4 * mib})
	d := x.d
	var h uint64
	p := x.prop()
	for _, tt := range []struct {
		name  string
		size  uintptr
		prop  func(*cuda.MemAllocationProp)
		flags uint64
	}{
		{"zero size", 0, nil, 0},
		{"misaligned size", mib, nil, 0},
		{"flags", 2 * mib, nil, 1},
		{"not pinned", 2 * mib, func(p *cuda.MemAllocationProp) { p.Type = 0 }, 0},
		{"host location", 2 * mib, func(p *cuda.MemAllocationProp) { p.Location.Type = 2 }, 0},
		{"bad device", 2 * mib, func(p *cuda.MemAllocationProp) { p.Location.ID = 3 }, 0},
		{"handle type", 2 * mib, func(p *cuda.MemAllocationProp) { p.RequestedHandleTypes = 2 }, 0}, // WIN32
		{"handle types", 2 * mib, func(p *cuda.MemAllocationProp) { p.RequestedHandleTypes = 3 }, 0},
		{"win32 metadata", 2 * mib, func(p *cuda.MemAllocationProp) { p.Win32HandleMetaData = 8 }, 0},
	} {
		// NB: no t.Run here: a subtest runs on another thread, where no context is current.
		q := *p
		if tt.prop != nil {
			tt.prop(&q)
		}
		assert.Equal(t, cuda.CodeInvalidValue, d.MemCreate(&h, tt.size, &q, tt.flags), tt.name)
	}
	assert.Zero(t, x.f.LiveHandles(), "refused creates make nothing")
	a := x.create(2 * mib)
	b := x.create(2 * mib)
	assert.Equal(t, cuda.CodeOutOfMemory, d.MemCreate(&h, 2*mib, p, 0), "beyond the device's memory")
	assert.EqualValues(t, 4*mib, x.f.UsedMemory(0))
	assert.Equal(t, cuda.Success, d.MemRelease(a))
	assert.Equal(t, cuda.CodeInvalidValue, d.MemRelease(a), "double release")
	assert.Equal(t, cuda.Success, d.MemRelease(b))
	assert.Zero(t, x.f.LiveHandles())
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, x.f.CheckLeaks())
}

func TestFakeReserveRules(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{})
	d := x.d
	var p uint64
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressReserve(&p, 0, 0, 0, 0), "zero size")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressReserve(&p, mib, 0, 0, 0), "misaligned size")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressReserve(&p, 2*mib, 3*mib, 0, 0), "alignment not a power of two")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressReserve(&p, 2*mib, 0, 0, 1), "flags")
	assert.Equal(t, cuda.Success, d.MemAddressReserve(&p, 4*mib, 64*mib, 0, 0))
	assert.Zero(t, p%(64*mib), "alignment honoured")
	q := x.reserve(2 * mib)
	assert.True(t, q >= p+4*mib || q+2*mib <= p, "reservations do not overlap")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressFree(p, 2*mib), "free of part of a reservation")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressFree(p+2*mib, 2*mib), "free of the tail")
	assert.Equal(t, cuda.Success, d.MemAddressFree(p, 4*mib))
	assert.Equal(t, cuda.CodeInvalidValue, d.MemAddressFree(p, 4*mib), "double free")
	assert.Equal(t, cuda.Success, d.MemAddressFree(q, 2*mib))
	assert.Zero(t, x.f.LiveReservations())
}

func TestFakeMapRules(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{})
	d := x.d
	va := x.reserve(8 * mib)
	h := x.create(2 * mib)
	h4 := x.create(4 * mib)
	for _, tt := range []struct {
		name   string
		ptr    uint64
		size   uintptr
		offset uintptr
		handle uint64
		flags  uint64
		want   cuda.Code
	}{
		{"not reserved", va + 64*mib, 2 * mib, 0, h, 0, cuda.CodeInvalidValue},
		{"straddles the end", va + 6*mib, 4 * mib, 0, h4, 0, cuda.CodeInvalidValue},
		{"misaligned address", va + mib, 2 * mib, 0, h, 0, cuda.CodeInvalidValue},
		{"offset", va, 2 * mib, 2 * mib, h4, 0, cuda.CodeInvalidValue},
		{"part of a handle", va, 2 * mib, 0, h4, 0, cuda.CodeInvalidValue},
		{"unknown handle", va, 2 * mib, 0, 999, 0, cuda.CodeInvalidValue},
		{"flags", va, 2 * mib, 0, h, 1, cuda.CodeInvalidValue},
	} {
		assert.Equal(t, tt.want, d.MemMap(tt.ptr, tt.size, tt.offset, tt.handle, tt.flags), tt.name)
	}
	assert.Zero(t, x.f.LiveMappings())
	require.Equal(t, cuda.Success, d.MemMap(va, 2*mib, 0, h, 0))
	assert.Equal(t, cuda.CodeAlreadyMapped, d.MemMap(va, 2*mib, 0, h, 0), "map over a mapping")
	assert.Equal(t, cuda.CodeAlreadyMapped, d.MemMap(va, 4*mib, 0, h4, 0), "overlap a mapping")
	require.Equal(t, cuda.Success, d.MemMap(va+2*mib, 4*mib, 0, h4, 0))
	// The handle mapped twice (at two addresses) is the shared-prefix case.
	require.Equal(t, cuda.Success, d.MemMap(va+6*mib, 2*mib, 0, h, 0))
	assert.Equal(t, 3, x.f.LiveMappings())

	// Unmap and SetAccess take whole adjacent mappings only.
	for _, tt := range []struct {
		name string
		ptr  uint64
		size uintptr
	}{
		{"inside a mapping", va + 2*mib, 2 * mib},
		{"tail of a mapping", va + 4*mib, 2 * mib},
		{"past the last mapping", va + 6*mib, 4 * mib},
		{"zero size", va, 0},
		{"unreserved", va + 64*mib, 2 * mib},
	} {
		assert.Equal(t, cuda.CodeInvalidValue, d.MemUnmap(tt.ptr, tt.size), "unmap %s", tt.name)
		assert.Equal(t, cuda.CodeInvalidValue, x.access(tt.ptr, tt.size, cuda.AccessReadWrite), "set access %s", tt.name)
	}
	assert.Equal(t, cuda.CodeInvalidValue, x.access(va, 8*mib, 7), "bad flags")
	desc := cuda.MemAccessDesc{Location: cuda.MemLocation{Type: cuda.LocationDevice}, Flags: cuda.AccessReadWrite}
	assert.Equal(t, cuda.CodeInvalidValue, d.MemSetAccess(va, 8*mib, &desc, 0), "no descriptor")
	assert.Equal(t, cuda.Success, x.access(va, 8*mib, cuda.AccessReadWrite), "three adjacent mappings at once")
	// Release while mapped is fine: the memory lives until the last mapping goes.
	require.Equal(t, cuda.Success, d.MemRelease(h))
	assert.Equal(t, cuda.CodeInvalidValue, d.MemMap(va+6*mib, 2*mib, 0, h, 0), "a released handle maps no more")
	assert.Equal(t, 2, x.f.LiveHandles())
	assert.Equal(t, cuda.CodeIllegalState, d.MemAddressFree(va, 8*mib), "free with live mappings")
	require.Equal(t, cuda.Success, d.MemUnmap(va, 6*mib), "two adjacent mappings at once")
	assert.Equal(t, 2, x.f.LiveHandles(), "h is still mapped at va+6MiB")
	require.Equal(t, cuda.Success, d.MemUnmap(va+6*mib, 2*mib))
	assert.Equal(t, 1, x.f.LiveHandles(), "h freed with its last mapping")
	require.Equal(t, cuda.Success, d.MemRelease(h4))
	require.Equal(t, cuda.Success, d.MemAddressFree(va, 8*mib))
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, x.f.CheckLeaks())
}

func TestFakeAccessAndAliasing(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{})
	d := x.d
	a := x.reserve(4 * mib)
	b := x.reserve(2 * mib)
	h := x.create(2 * mib)
	h2 := x.create(2 * mib)
	require.Equal(t, cuda.Success, d.MemMap(a, 2*mib, 0, h, 0))
	require.Equal(t, cuda.Success, d.MemMap(a+2*mib, 2*mib, 0, h2, 0))
	require.Equal(t, cuda.Success, d.MemMap(b, 2*mib, 0, h, 0))
	msg := []byte("written through A")
	assert.Equal(t, cuda.CodeInvalidValue, x.write(a, msg), "a new mapping has no access")
	_, c := x.read(a, 4)
	assert.Equal(t, cuda.CodeInvalidValue, c, "not even to read")
	require.Equal(t, cuda.Success, x.access(a, 2*mib, cuda.AccessReadWrite))
	require.Equal(t, cuda.Success, x.access(b, 2*mib, cuda.AccessRead))
	require.Equal(t, cuda.Success, x.write(a+100, msg))
	got, c := x.read(b+100, len(msg))
	require.Equal(t, cuda.Success, c)
	assert.Equal(t, msg, got, "the write through A reads back through B")
	assert.Equal(t, cuda.CodeInvalidValue, x.write(b, msg), "B is read-only")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemsetD8(b, 1, 8), "B is read-only to memset")
	assert.Equal(t, cuda.CodeInvalidValue, x.write(a+2*mib-4, msg), "a copy running into the granule without access")
	require.Equal(t, cuda.Success, x.access(a+2*mib, 2*mib, cuda.AccessReadWrite))
	require.Equal(t, cuda.Success, x.write(a+2*mib-4, msg), "now it may span both mappings")
	got, c = x.read(a+2*mib-4, len(msg))
	require.Equal(t, cuda.Success, c)
	assert.Equal(t, msg, got)
	require.Equal(t, cuda.Success, d.MemsetD8(a, 0xAB, 2*mib))
	got, c = x.read(b+2*mib-3, 3)
	require.Equal(t, cuda.Success, c)
	assert.Equal(t, []byte{0xAB, 0xAB, 0xAB}, got)
	require.Equal(t, cuda.Success, d.MemcpyDtoD(a+2*mib, b, 16), "device to device")
	got, c = x.read(a+2*mib, 16)
	require.Equal(t, cuda.Success, c)
	assert.Equal(t, []byte{0xAB, 0xAB, 0xAB, 0xAB}, got[:4])
	assert.Equal(t, cuda.CodeInvalidValue, d.MemcpyDtoD(b, a, 16), "device to device into read-only")
	require.Equal(t, cuda.Success, x.write(a+100, msg))
	// Unmapping A leaves B readable: the handle lives while mapped anywhere.
	require.Equal(t, cuda.Success, d.MemUnmap(a, 2*mib))
	got, c = x.read(b+100, len(msg))
	require.Equal(t, cuda.Success, c)
	assert.Equal(t, msg, got)
	// A remap starts without access again.
	require.Equal(t, cuda.Success, d.MemMap(a, 2*mib, 0, h, 0))
	assert.Equal(t, cuda.CodeInvalidValue, x.write(a, msg))
	require.Equal(t, cuda.Success, d.MemUnmap(a, 4*mib))
	require.Equal(t, cuda.Success, d.MemUnmap(b, 2*mib))
	for _, hh := range []uint64{h, h2} {
		require.Equal(t, cuda.Success, d.MemRelease(hh))
	}
	require.Equal(t, cuda.Success, d.MemAddressFree(a, 4*mib))
	require.Equal(t, cuda.Success, d.MemAddressFree(b, 2*mib))
	var free, total uintptr
	require.Equal(t, cuda.Success, d.MemGetInfo(&free, &total))
	assert.Equal(t, total, free, "everything freed")
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, x.f.CheckLeaks())
}

func TestFakeContextRules(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the fake tells threads apart on Linux only")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	d := f.Driver()
	require.Equal(t, cuda.Success, d.Init(0))
	var p uint64
	assert.Equal(t, cuda.CodeInvalidContext, d.MemAddressReserve(&p, 2*mib, 0, 0, 0), "no context current")
	assert.Equal(t, cuda.CodeInvalidContext, d.CtxSetCurrent(0xdead), "not a retained context")
	var ctx uintptr
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRetain(&ctx, 0))
	require.Equal(t, cuda.Success, d.CtxSetCurrent(ctx))
	assert.Equal(t, cuda.CodeInvalidContext, onOtherThread(func() cuda.Code { return d.MemAddressReserve(&p, 2*mib, 0, 0, 0) }),
		"the context is current on this thread only")
	require.Equal(t, cuda.Success, d.MemAddressReserve(&p, 2*mib, 0, 0, 0))
	require.Equal(t, cuda.Success, d.MemAddressFree(p, 2*mib))
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
	assert.Equal(t, cuda.CodeInvalidContext, d.DevicePrimaryCtxRelease(0), "released more often than retained")
	assert.Equal(t, cuda.CodeInvalidContext, d.CtxSynchronize(), "a released context is no longer usable")
	assert.NoError(t, f.CheckLeaks())
}

// onOtherThread runs fn on a fresh goroutine locked to a thread other than the
// caller's (the caller is locked to its own).
func onOtherThread(fn func() cuda.Code) cuda.Code {
	ch := make(chan cuda.Code)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		ch <- fn()
	}()
	return <-ch
}

func TestFakeFaults(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{})
	f, d := x.f, x.d
	var h uint64
	f.Fail("cuMemCreate", 2, cuda.CodeOutOfMemory)
	assert.Equal(t, 1, f.Pending())
	first := x.create(2 * mib)
	assert.Equal(t, cuda.CodeOutOfMemory, d.MemCreate(&h, 2*mib, x.prop(), 0), "the 2nd create fails")
	assert.Equal(t, 1, f.LiveHandles(), "a failed call does nothing")
	assert.Zero(t, f.Pending())
	second := x.create(2 * mib)

	f.Fail("", 1, cuda.CodeNotSupported)
	assert.Equal(t, cuda.CodeNotSupported, d.MemRelease(first), "the next call of any kind")
	assert.Equal(t, 2, f.UnreleasedHandles())
	calls := f.Calls("cuMemRelease")
	require.Equal(t, cuda.Success, d.MemRelease(first))
	require.Equal(t, cuda.Success, d.MemRelease(second))
	assert.Equal(t, calls+2, f.Calls("cuMemRelease"))

	f.Fail("cuMemMap", 1, cuda.CodeUnknown)
	f.ClearFaults()
	assert.Zero(t, f.Pending())
	assert.Panics(t, func() { f.Fail("cuMemMap", 0, cuda.CodeUnknown) })
	assert.Panics(t, func() { f.Fail("cuMemMap", 1, cuda.Success) })

	var name *byte
	assert.Equal(t, cuda.Success, d.GetErrorName(cuda.CodeOutOfMemory, &name))
	assert.Equal(t, cuda.CodeInvalidValue, d.GetErrorName(cuda.Code(12345), &name))
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, f.CheckLeaks())
}

func TestFakeCheckLeaks(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{})
	va := x.reserve(2 * mib)
	h := x.create(2 * mib)
	err := x.f.CheckLeaks()
	require.Error(t, err)
	for _, want := range []string{"1 live physical handles", "1 live reservations", "retained 1 times"} {
		assert.Contains(t, err.Error(), want)
	}
	require.Equal(t, cuda.Success, x.d.MemRelease(h))
	require.Equal(t, cuda.Success, x.d.MemAddressFree(va, 2*mib))
	require.Equal(t, cuda.Success, x.d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, x.f.CheckLeaks())
}

// TestFakeErrorNames checks that the fake's cuGetErrorName names exactly the codes
// package cuda names, with the same names, and refuses the rest as the driver does.
func TestFakeErrorNames(t *testing.T) {
	d := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{}).Driver()
	named := 0
	for c := cuda.Code(0); c < 1000; c++ {
		var name *byte
		got := d.GetErrorName(c, &name)
		want := c.String()
		if strings.HasPrefix(want, "CUresult(") {
			assert.Equal(t, cuda.CodeInvalidValue, got, "code %d has no name", c)
			continue
		}
		named++
		if assert.Equal(t, cuda.Success, got, "code %d (%s)", c, want) && assert.NotNil(t, name) {
			// The name is NUL-terminated: read one byte more than its length.
			b := unsafe.Slice(name, len(want)+1)
			assert.Equal(t, want+"\x00", string(b), "code %d", c)
		}
	}
	assert.Greater(t, named, 10, "package cuda names its codes")
}
