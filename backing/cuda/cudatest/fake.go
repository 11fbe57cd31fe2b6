package cudatest

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"unsafe"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
)

// FakeDriverOptions configures a FakeDriver. The zero value is one device with VMM
// support, 2 MiB granules and 1 GiB of memory.
type FakeDriverOptions struct {
	Devices     int       // device count; 0 means 1 (a machine without devices: InitResult cuda.CodeNoDevice)
	Memory      int64     // physical bytes per device; 0 means 1 GiB
	Granularity int       // minimum granularity in bytes, a power of two; 0 means 2 MiB
	Recommended int       // recommended granularity; 0 means Granularity
	NoVMM       bool      // attribute 102 reads 0 and cuMemCreate returns CUDA_ERROR_NOT_SUPPORTED
	InitResult  cuda.Code // what cuInit returns: cuda.CodeStubLibrary, cuda.CodeNoDevice, ...; 0 is success
	Version     int32     // what cuDriverGetVersion reports; 0 means 12060 (CUDA 12.6)
	// NoReadOnly makes cuMemSetAccess refuse PROT_READ with CUDA_ERROR_NOT_SUPPORTED,
	// as a driver without read-only device mappings does.
	NoReadOnly bool
	// MaxHostRegister is the largest range one cuMemHostRegister accepts; 0 means
	// 64 GiB. Larger ones fail with CUDA_ERROR_OUT_OF_MEMORY (see fake_host.go).
	MaxHostRegister int64
	// NoExport makes the device unable to export allocations: attribute 103
	// (HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) reads 0 and cuMemCreate asked
	// for an exportable allocation returns CUDA_ERROR_NOT_SUPPORTED. Off Linux the
	// fake can never export (fake_export.go).
	NoExport bool
	// AddressSpace is the device virtual address space cuMemAddressReserve hands out,
	// in bytes; 0 means 2^47 (128 TiB, the user half of x86-64's 48-bit addresses,
	// which unified addressing shares with the host). A reservation past what is
	// left fails with CUDA_ERROR_OUT_OF_MEMORY, as the driver's does; freed ranges
	// are not handed out again.
	AddressSpace int64
}

// FakeDriver is an in-memory model of the CUDA driver's VMM API that enforces the
// rules the real driver documents, and some it leaves undefined, strictly:
//
//   - cuInit first; every memory call needs the retained primary context current on
//     the calling OS thread (checked on Linux, where threads can be told apart);
//   - sizes, addresses and handles multiples of the minimum granularity; flags 0;
//   - cuMemMap only onto reserved, unmapped addresses, offset 0, a whole handle;
//   - cuMemUnmap and cuMemSetAccess only over whole adjacent mappings, no holes;
//   - each new mapping has no access: memset and memcpy need READWRITE (to write) or
//     READ (to read) on every byte they touch;
//   - cuMemAddressFree only of an exact reservation with no live mapping;
//   - a handle lives until it is released and its last mapping is gone; releasing
//     it twice fails; memory is limited (CUDA_ERROR_OUT_OF_MEMORY beyond it), and so
//     is the address space reservations take (FakeDriverOptions.AddressSpace).
//
// A handle's contents are one Go byte slice shared by all its mappings, so a write
// through one mapping reads back through every other (the shared-prefix aliasing).
// Contents are allocated on first write and read as zero before it. An allocation
// created exportable (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, Linux only) keeps
// them in a memfd instead, which cuMemExportToShareableHandle hands out and
// cuMemImportFromShareableHandle maps, in this process or another (fake_export.go).
//
// Faults are injected with Fail; LiveHandles, LiveReservations, LiveMappings and
// CheckLeaks tell what a test left behind. A FakeDriver is safe for concurrent use.
type FakeDriver struct {
	opts FakeDriverOptions
	drv  *cuda.Driver

	mu          sync.Mutex
	initialized bool
	used        []int64         // physical bytes per device
	retained    []int           // primary context retain count per device
	current     map[int]uintptr // OS thread id -> current context
	handles     map[uint64]*fakeHandle
	nextHandle  uint64
	res         []*fakeRes // ordered by base (bases only grow)
	nextVA      uint64
	calls       map[string]int
	total       int
	faults      []fakeFault
	host        fakeHost // pinned host memory and streams (fake_host.go)
}

type fakeHandle struct {
	id       uint64
	dev      int32
	size     uintptr
	data     []byte // nil until first written; shm's mapping when shm is set
	released bool
	maps     int
	shm      *fakeShm // the memfd behind an exportable or imported allocation, else nil
	imported bool     // cuMemImportFromShareableHandle made it: another process's memory
}

type fakeRes struct {
	base uint64
	size uintptr
	maps []*fakeMap // ordered by va
}

type fakeMap struct {
	va     uint64
	size   uintptr
	h      *fakeHandle
	access int32
}

type fakeFault struct {
	fn   string // "" for any entry point
	at   int    // fires on this call number of fn (or of all calls)
	code cuda.Code
}

const (
	fakeVABase  = 0x7e00_0000_0000
	fakeCtxBase = 0xc7c0_0000
	fakeVersion = 12060
)

// NewFakeDriver returns a fake driver configured by opts.
func NewFakeDriver(opts FakeDriverOptions) *FakeDriver {
	if opts.Devices <= 0 {
		opts.Devices = 1
	}
	if opts.Memory <= 0 {
		opts.Memory = 1 << 30
	}
	if opts.Granularity <= 0 {
		opts.Granularity = 2 << 20
	}
	if opts.Recommended <= 0 {
		opts.Recommended = opts.Granularity
	}
	if opts.Version == 0 {
		opts.Version = fakeVersion
	}
	if opts.AddressSpace <= 0 {
		opts.AddressSpace = 1 << 47
	}
	f := &FakeDriver{
		opts:       opts,
		used:       make([]int64, opts.Devices),
		retained:   make([]int, opts.Devices),
		current:    make(map[int]uintptr),
		handles:    make(map[uint64]*fakeHandle),
		nextHandle: 1,
		nextVA:     fakeVABase,
		calls:      make(map[string]int),
	}
	f.drv = &cuda.Driver{
		Init:                        f.init,
		DriverGetVersion:            f.driverGetVersion,
		DeviceGetCount:              f.deviceGetCount,
		DeviceGet:                   f.deviceGet,
		DeviceGetAttribute:          f.deviceGetAttribute,
		DevicePrimaryCtxRetain:      f.primaryCtxRetain,
		DevicePrimaryCtxRelease:     f.primaryCtxRelease,
		CtxSetCurrent:               f.ctxSetCurrent,
		CtxSynchronize:              f.ctxSynchronize,
		MemGetInfo:                  f.memGetInfo,
		MemGetAllocationGranularity: f.memGetAllocationGranularity,
		MemAddressReserve:           f.memAddressReserve,
		MemAddressFree:              f.memAddressFree,
		MemCreate:                   f.memCreate,
		MemRelease:                  f.memRelease,
		MemMap:                      f.memMap,
		MemUnmap:                    f.memUnmap,
		MemSetAccess:                f.memSetAccess,
		MemsetD8:                    f.memsetD8,
		MemcpyHtoD:                  f.memcpyHtoD,
		MemcpyDtoH:                  f.memcpyDtoH,
		MemcpyDtoD:                  f.memcpyDtoD,
		GetErrorName:                f.getErrorName,
	}
	f.bindHost(f.drv)
	f.bindExport(f.drv)
	return f
}

// Driver returns the driver seam backed by f.
func (f *FakeDriver) Driver() *cuda.Driver { return f.drv }

// Fail makes the nth call from now (1-based) of entry point fn return code instead of
// doing anything; fn is the exported symbol name ("cuMemCreate", "cuMemsetD8_v2"), or
// "" to count every call but cuGetErrorName. Several faults may be pending.
func (f *FakeDriver) Fail(fn string, nth int, code cuda.Code) {
	if nth < 1 || code == cuda.Success {
		panic("cudatest: FakeDriver.Fail needs nth >= 1 and a failing code")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	base := f.total
	if fn != "" {
		base = f.calls[fn]
	}
	f.faults = append(f.faults, fakeFault{fn: fn, at: base + nth, code: code})
}

// Pending returns how many injected faults have not fired yet.
func (f *FakeDriver) Pending() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.faults)
}

// ClearFaults drops every pending fault.
func (f *FakeDriver) ClearFaults() {
	f.mu.Lock()
	f.faults = nil
	f.mu.Unlock()
}

// Calls returns how many times entry point fn was called, or all calls for "".
func (f *FakeDriver) Calls(fn string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fn == "" {
		return f.total
	}
	return f.calls[fn]
}

// LiveHandles returns how many physical allocations exist: created and not yet freed
// (a released handle lives on while mapped).
func (f *FakeDriver) LiveHandles() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.handles)
}

// UnreleasedHandles returns how many handles were created and not yet released.
func (f *FakeDriver) UnreleasedHandles() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, h := range f.handles {
		if !h.released {
			n++
		}
	}
	return n
}

// LiveReservations returns how many address ranges are reserved.
func (f *FakeDriver) LiveReservations() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.res)
}

// LiveMappings returns how many mappings exist across all reservations.
func (f *FakeDriver) LiveMappings() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, r := range f.res {
		n += len(r.maps)
	}
	return n
}

// MappingAccess returns the access flags (cuda.AccessNone, cuda.AccessRead, cuda.AccessReadWrite)
// of the mapping at device address va, and false when nothing is mapped there.
func (f *FakeDriver) MappingAccess(va uint64) (int32, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	i := f.findRes(va, 1)
	if i < 0 {
		return 0, false
	}
	for _, m := range f.res[i].maps {
		if m.va <= va && va < m.va+uint64(m.size) {
			return m.access, true
		}
	}
	return 0, false
}

// UsedMemory returns the physical bytes allocated on device dev.
func (f *FakeDriver) UsedMemory(dev int) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.used[dev]
}

// RetainedContexts returns the primary context retain count of device dev.
func (f *FakeDriver) RetainedContexts(dev int) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.retained[dev]
}

// CheckLeaks returns an error naming whatever is still live: handles, reservations,
// mappings, retained contexts. Tests call it after releasing everything.
func (f *FakeDriver) CheckLeaks() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	var errs []error
	if n := len(f.handles); n > 0 {
		errs = append(errs, fmt.Errorf("%d live physical handles", n))
	}
	if n := len(f.res); n > 0 {
		errs = append(errs, fmt.Errorf("%d live reservations", n))
	}
	errs = append(errs, f.hostLeaks()...)
	for d, n := range f.retained {
		if n > 0 {
			errs = append(errs, fmt.Errorf("device %d primary context retained %d times", d, n))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("cudatest: fake driver leaks: %w", errors.Join(errs...))
	}
	return nil
}

// enter counts a call of fn, takes the lock and returns a pending fault's code, if
// one fires now. f.mu is held on return; the caller must unlock.
func (f *FakeDriver) enter(fn string) cuda.Code {
	f.mu.Lock()
	f.total++
	f.calls[fn]++
	for i, ft := range f.faults {
		if (ft.fn == "" && ft.at == f.total) || (ft.fn == fn && ft.at == f.calls[fn]) {
			f.faults = slices.Delete(f.faults, i, i+1)
			return ft.code
		}
	}
	if !f.initialized && fn != "cuInit" && fn != "cuDriverGetVersion" {
		return cuda.CodeNotInitialized
	}
	return cuda.Success
}

// needCtx checks that a retained primary context is current on the calling thread.
// f.mu must be held.
func (f *FakeDriver) needCtx() cuda.Code {
	tid := gettid()
	if tid == 0 {
		return cuda.Success // threads can not be told apart here
	}
	ctx, ok := f.current[tid]
	if !ok || ctx == 0 {
		return cuda.CodeInvalidContext
	}
	dev := int(ctx - fakeCtxBase - 1)
	if dev < 0 || dev >= len(f.retained) || f.retained[dev] == 0 {
		return cuda.CodeInvalidContext
	}
	return cuda.Success
}

func (f *FakeDriver) gran() uintptr { return uintptr(f.opts.Granularity) }

func (f *FakeDriver) init(flags uint32) cuda.Code {
	c := f.enter("cuInit")
	defer f.mu.Unlock()
	switch {
	case c != cuda.Success:
		return c
	case flags != 0:
		return cuda.CodeInvalidValue
	case f.opts.InitResult != cuda.Success:
		return f.opts.InitResult
	}
	f.initialized = true
	return cuda.Success
}

func (f *FakeDriver) driverGetVersion(v *int32) cuda.Code {
	c := f.enter("cuDriverGetVersion")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if v == nil {
		return cuda.CodeInvalidValue
	}
	*v = f.opts.Version
	return cuda.Success
}

func (f *FakeDriver) deviceGetCount(n *int32) cuda.Code {
	c := f.enter("cuDeviceGetCount")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if n == nil {
		return cuda.CodeInvalidValue
	}
	*n = int32(f.opts.Devices)
	return cuda.Success
}

func (f *FakeDriver) deviceGet(dev *int32, ordinal int32) cuda.Code {
	c := f.enter("cuDeviceGet")
	defer f.mu.Unlock()
	switch {
	case c != cuda.Success:
		return c
	case dev == nil:
		return cuda.CodeInvalidValue
	case ordinal < 0 || int(ordinal) >= f.opts.Devices:
		return cuda.CodeInvalidDevice
	}
	*dev = ordinal
	return cuda.Success
}

func (f *FakeDriver) validDevice(dev int32) bool { return dev >= 0 && int(dev) < f.opts.Devices }

func (f *FakeDriver) deviceGetAttribute(v *int32, attr, dev int32) cuda.Code {
	c := f.enter("cuDeviceGetAttribute")
	defer f.mu.Unlock()
	switch {
	case c != cuda.Success:
		return c
	case v == nil:
		return cuda.CodeInvalidValue
	case !f.validDevice(dev):
		return cuda.CodeInvalidDevice
	}
	switch attr {
	case cuda.AttrVMMSupported:
		*v = 1
		if f.opts.NoVMM {
			*v = 0
		}
	case cuda.AttrUnifiedAddressing:
		*v = 1
	case cuda.AttrPosixFDSupported:
		*v = 0
		if f.canExport() {
			*v = 1
		}
	default:
		return cuda.CodeInvalidValue
	}
	return cuda.Success
}

func (f *FakeDriver) primaryCtxRetain(ctx *uintptr, dev int32) cuda.Code {
	c := f.enter("cuDevicePrimaryCtxRetain")
	defer f.mu.Unlock()
	switch {
	case c != cuda.Success:
		return c
	case ctx == nil:
		return cuda.CodeInvalidValue
	case !f.validDevice(dev):
		return cuda.CodeInvalidDevice
	}
	f.retained[dev]++
	*ctx = fakeCtxBase + uintptr(dev) + 1
	return cuda.Success
}

func (f *FakeDriver) primaryCtxRelease(dev int32) cuda.Code {
	c := f.enter("cuDevicePrimaryCtxRelease_v2")
	defer f.mu.Unlock()
	switch {
	case c != cuda.Success:
		return c
	case !f.validDevice(dev):
		return cuda.CodeInvalidDevice
	case f.retained[dev] == 0:
		return cuda.CodeInvalidContext
	}
	f.retained[dev]--
	return cuda.Success
}

func (f *FakeDriver) ctxSetCurrent(ctx uintptr) cuda.Code {
	c := f.enter("cuCtxSetCurrent")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if ctx != 0 {
		dev := int(ctx - fakeCtxBase - 1)
		if dev < 0 || dev >= len(f.retained) || f.retained[dev] == 0 {
			return cuda.CodeInvalidContext
		}
	}
	if tid := gettid(); tid != 0 {
		f.current[tid] = ctx
	}
	return cuda.Success
}

func (f *FakeDriver) ctxSynchronize() cuda.Code {
	c := f.enter("cuCtxSynchronize")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	return f.needCtx()
}

func (f *FakeDriver) memGetInfo(free, total *uintptr) cuda.Code {
	c := f.enter("cuMemGetInfo_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if free == nil || total == nil {
		return cuda.CodeInvalidValue
	}
	// NB: device 0's figures: the fake does not track which device is current.
	*total = uintptr(f.opts.Memory)
	*free = uintptr(f.opts.Memory - f.used[0])
	return cuda.Success
}

// validProp checks an allocation property the way cuMemCreate does.
func (f *FakeDriver) validProp(p *cuda.MemAllocationProp) bool {
	return p != nil && p.Type == cuda.AllocationPinned &&
		(p.RequestedHandleTypes == cuda.HandleTypeNone || p.RequestedHandleTypes == cuda.HandleTypePosixFD) &&
		p.Location.Type == cuda.LocationDevice && f.validDevice(p.Location.ID) &&
		p.Win32HandleMetaData == 0 && p.Reserved == [4]uint8{}
}

func (f *FakeDriver) memGetAllocationGranularity(g *uintptr, p *cuda.MemAllocationProp, option int32) cuda.Code {
	c := f.enter("cuMemGetAllocationGranularity")
	defer f.mu.Unlock()
	switch {
	case c != cuda.Success:
		return c
	case g == nil || !f.validProp(p):
		return cuda.CodeInvalidValue
	}
	switch option {
	case cuda.GranularityMinimum:
		*g = uintptr(f.opts.Granularity)
	case cuda.GranularityRecommended:
		*g = uintptr(f.opts.Recommended)
	default:
		return cuda.CodeInvalidValue
	}
	return cuda.Success
}

func (f *FakeDriver) memAddressReserve(ptr *uint64, size, align uintptr, addr uint64, flags uint64) cuda.Code {
	c := f.enter("cuMemAddressReserve")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	g := f.gran()
	switch {
	case ptr == nil || flags != 0 || size == 0 || size%g != 0:
		return cuda.CodeInvalidValue
	case align != 0 && !backing.IsPowerOfTwo(int(align)):
		return cuda.CodeInvalidValue
	case addr%uint64(g) != 0:
		return cuda.CodeInvalidValue
	}
	a := uint64(max(align, g))
	base := (f.nextVA + a - 1) &^ (a - 1)
	if end := fakeVABase + uint64(f.opts.AddressSpace); base+uint64(size) < base || base+uint64(size) > end {
		return cuda.CodeOutOfMemory // address space exhausted
	}
	f.nextVA = base + uint64(size)
	f.res = append(f.res, &fakeRes{base: base, size: size})
	*ptr = base
	return cuda.Success
}

// findRes returns the index of the reservation holding [va, va+n), or -1.
func (f *FakeDriver) findRes(va uint64, n uintptr) int {
	i := sort.Search(len(f.res), func(i int) bool { return f.res[i].base+uint64(f.res[i].size) > va })
	if i == len(f.res) {
		return -1
	}
	r := f.res[i]
	if va < r.base || va+uint64(n) < va || va+uint64(n) > r.base+uint64(r.size) {
		return -1
	}
	return i
}

func (f *FakeDriver) memAddressFree(ptr uint64, size uintptr) cuda.Code {
	c := f.enter("cuMemAddressFree")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	i := f.findRes(ptr, size)
	if i < 0 || f.res[i].base != ptr || f.res[i].size != size {
		return cuda.CodeInvalidValue // only an exact reservation may be freed
	}
	if len(f.res[i].maps) > 0 {
		// Undefined in the driver's documentation; refused here.
		return cuda.CodeIllegalState
	}
	f.res = slices.Delete(f.res, i, i+1)
	return cuda.Success
}

func (f *FakeDriver) memCreate(h *uint64, size uintptr, p *cuda.MemAllocationProp, flags uint64) cuda.Code {
	c := f.enter("cuMemCreate")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	switch {
	case h == nil || flags != 0 || size == 0 || size%f.gran() != 0 || !f.validProp(p):
		return cuda.CodeInvalidValue
	case f.opts.NoVMM:
		return cuda.CodeNotSupported
	case p.RequestedHandleTypes == cuda.HandleTypePosixFD && !f.canExport():
		return cuda.CodeNotSupported
	}
	dev := p.Location.ID
	if f.used[dev]+int64(size) > f.opts.Memory {
		return cuda.CodeOutOfMemory
	}
	fh := &fakeHandle{dev: dev, size: size}
	if p.RequestedHandleTypes == cuda.HandleTypePosixFD {
		shm, err := newFakeShm(dev, size)
		if err != nil {
			return cuda.CodeOutOfMemory // out of descriptors or memory for the memfd
		}
		fh.shm, fh.data = shm, shm.data
	}
	f.used[dev] += int64(size)
	fh.id = f.nextHandle
	f.nextHandle++
	f.handles[fh.id] = fh
	*h = fh.id
	return cuda.Success
}

// freeIfDead frees h's memory once it is released and mapped nowhere. f.mu held.
func (f *FakeDriver) freeIfDead(h *fakeHandle) {
	if h.released && h.maps == 0 {
		if !h.imported {
			f.used[h.dev] -= int64(h.size) // an import's memory is its exporter's
		}
		if h.shm != nil {
			h.shm.close()
			h.shm = nil
		}
		h.data = nil
		delete(f.handles, h.id)
	}
}

func (f *FakeDriver) memRelease(id uint64) cuda.Code {
	c := f.enter("cuMemRelease")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	h := f.handles[id]
	if h == nil || h.released {
		return cuda.CodeInvalidValue
	}
	h.released = true
	f.freeIfDead(h)
	return cuda.Success
}

func (f *FakeDriver) memMap(ptr uint64, size, offset uintptr, id uint64, flags uint64) cuda.Code {
	c := f.enter("cuMemMap")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	g := f.gran()
	h := f.handles[id]
	switch {
	case flags != 0 || offset != 0 || size == 0 || size%g != 0 || ptr%uint64(g) != 0:
		return cuda.CodeInvalidValue
	case h == nil || h.released:
		return cuda.CodeInvalidValue
	case size != h.size:
		return cuda.CodeInvalidValue // the fake maps whole handles only
	}
	i := f.findRes(ptr, size)
	if i < 0 {
		return cuda.CodeInvalidValue // not inside one reservation
	}
	r := f.res[i]
	j := sort.Search(len(r.maps), func(j int) bool { return r.maps[j].va+uint64(r.maps[j].size) > ptr })
	if j < len(r.maps) && r.maps[j].va < ptr+uint64(size) {
		return cuda.CodeAlreadyMapped
	}
	r.maps = slices.Insert(r.maps, j, &fakeMap{va: ptr, size: size, h: h, access: cuda.AccessNone})
	h.maps++
	return cuda.Success
}

// wholeMaps returns the reservation and the index range [lo, hi) of the mappings that
// exactly cover [ptr, ptr+size) with no holes, or ok false. f.mu held.
func (f *FakeDriver) wholeMaps(ptr uint64, size uintptr) (r *fakeRes, lo, hi int, ok bool) {
	if size == 0 {
		return nil, 0, 0, false
	}
	i := f.findRes(ptr, size)
	if i < 0 {
		return nil, 0, 0, false
	}
	r = f.res[i]
	lo = sort.Search(len(r.maps), func(j int) bool { return r.maps[j].va >= ptr })
	if lo == len(r.maps) || r.maps[lo].va != ptr {
		return nil, 0, 0, false
	}
	end := ptr + uint64(size)
	at := ptr
	hi = lo
	for hi < len(r.maps) && at < end {
		m := r.maps[hi]
		if m.va != at {
			return nil, 0, 0, false // a hole
		}
		at += uint64(m.size)
		hi++
	}
	if at != end {
		return nil, 0, 0, false // ends inside a mapping, or runs past the last one
	}
	return r, lo, hi, true
}

func (f *FakeDriver) memUnmap(ptr uint64, size uintptr) cuda.Code {
	c := f.enter("cuMemUnmap")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	r, lo, hi, ok := f.wholeMaps(ptr, size)
	if !ok {
		return cuda.CodeInvalidValue
	}
	for _, m := range r.maps[lo:hi] {
		m.h.maps--
		f.freeIfDead(m.h)
	}
	r.maps = slices.Delete(r.maps, lo, hi)
	return cuda.Success
}

func (f *FakeDriver) memSetAccess(ptr uint64, size uintptr, desc *cuda.MemAccessDesc, count uintptr) cuda.Code {
	c := f.enter("cuMemSetAccess")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if desc == nil || count == 0 {
		return cuda.CodeInvalidValue
	}
	descs := descSlice(desc, count)
	for _, d := range descs {
		if d.Location.Type != cuda.LocationDevice || !f.validDevice(d.Location.ID) {
			return cuda.CodeInvalidValue
		}
		if d.Flags != cuda.AccessNone && d.Flags != cuda.AccessRead && d.Flags != cuda.AccessReadWrite {
			return cuda.CodeInvalidValue
		}
		if d.Flags == cuda.AccessRead && f.opts.NoReadOnly {
			return cuda.CodeNotSupported
		}
	}
	r, lo, hi, ok := f.wholeMaps(ptr, size)
	if !ok {
		return cuda.CodeInvalidValue
	}
	for _, m := range r.maps[lo:hi] {
		for _, d := range descs {
			if d.Location.ID == m.h.dev {
				m.access = d.Flags
			}
		}
	}
	return cuda.Success
}

// span calls fn for each piece of [va, va+n) in turn: the handle behind it and the
// offset in the handle. Every byte must be mapped with at least access need; otherwise
// it returns cuda.CodeInvalidValue and calls fn for nothing. f.mu held.
func (f *FakeDriver) span(va uint64, n uintptr, need int32, fn func(h *fakeHandle, off, n uintptr)) cuda.Code {
	if n == 0 {
		return cuda.Success
	}
	i := f.findRes(va, n)
	if i < 0 {
		return cuda.CodeInvalidValue
	}
	r := f.res[i]
	j := sort.Search(len(r.maps), func(j int) bool { return r.maps[j].va+uint64(r.maps[j].size) > va })
	end := va + uint64(n)
	type piece struct {
		h      *fakeHandle
		off, n uintptr
	}
	var pieces []piece
	for at := va; at < end; j++ {
		if j >= len(r.maps) {
			return cuda.CodeInvalidValue
		}
		m := r.maps[j]
		if m.va > at || m.access&need != need {
			return cuda.CodeInvalidValue // unmapped, or mapped without the access
		}
		off := uintptr(at - m.va)
		k := min(m.size-off, uintptr(end-at))
		pieces = append(pieces, piece{m.h, off, k})
		at += uint64(k)
	}
	for _, p := range pieces {
		fn(p.h, p.off, p.n)
	}
	return cuda.Success
}

// bytes returns h's contents, allocating them for a write.
func (h *fakeHandle) bytes(write bool) []byte {
	if h.data == nil && write {
		h.data = make([]byte, h.size)
	}
	return h.data
}

func (f *FakeDriver) memsetD8(dst uint64, v uint8, n uintptr) cuda.Code {
	c := f.enter("cuMemsetD8_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	return f.span(dst, n, cuda.AccessReadWrite, func(h *fakeHandle, off, k uintptr) {
		if v == 0 && h.data == nil {
			return // reads as zero already
		}
		b := h.bytes(true)[off : off+k]
		for i := range b {
			b[i] = v
		}
	})
}

func (f *FakeDriver) memcpyHtoD(dst uint64, src unsafe.Pointer, n uintptr) cuda.Code {
	c := f.enter("cuMemcpyHtoD_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if src == nil && n > 0 {
		return cuda.CodeInvalidValue
	}
	s := hostSlice(src, n)
	return f.span(dst, n, cuda.AccessReadWrite, func(h *fakeHandle, off, k uintptr) {
		copy(h.bytes(true)[off:off+k], s[:k])
		s = s[k:]
	})
}

func (f *FakeDriver) memcpyDtoH(dst unsafe.Pointer, src uint64, n uintptr) cuda.Code {
	c := f.enter("cuMemcpyDtoH_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	if dst == nil && n > 0 {
		return cuda.CodeInvalidValue
	}
	d := hostSlice(dst, n)
	return f.span(src, n, cuda.AccessRead, func(h *fakeHandle, off, k uintptr) {
		if b := h.bytes(false); b != nil {
			copy(d[:k], b[off:off+k])
		} else {
			clear(d[:k])
		}
		d = d[k:]
	})
}

func (f *FakeDriver) memcpyDtoD(dst, src uint64, n uintptr) cuda.Code {
	c := f.enter("cuMemcpyDtoD_v2")
	defer f.mu.Unlock()
	if c != cuda.Success {
		return c
	}
	if c := f.needCtx(); c != cuda.Success {
		return c
	}
	// Check the destination before reading, so a failed copy changes nothing.
	if c := f.span(dst, n, cuda.AccessReadWrite, func(*fakeHandle, uintptr, uintptr) {}); c != cuda.Success {
		return c
	}
	tmp := make([]byte, n)
	t := tmp
	if c := f.span(src, n, cuda.AccessRead, func(h *fakeHandle, off, k uintptr) {
		if b := h.bytes(false); b != nil {
			copy(t[:k], b[off:off+k])
		}
		t = t[k:]
	}); c != cuda.Success {
		return c
	}
	return f.span(dst, n, cuda.AccessReadWrite, func(h *fakeHandle, off, k uintptr) {
		copy(h.bytes(true)[off:off+k], tmp[:k])
		tmp = tmp[k:]
	})
}

// fakeErrorNames holds NUL-terminated copies of the code names for cuGetErrorName.
var fakeErrorNames = sync.OnceValue(func() map[cuda.Code][]byte {
	m := make(map[cuda.Code][]byte, len(fakeCodes))
	for _, c := range fakeCodes {
		m[c] = append([]byte(c.String()), 0)
	}
	return m
})

// fakeCodes are the codes cuGetErrorName names: every code package cuda names.
var fakeCodes = []cuda.Code{
	cuda.Success,
	cuda.CodeAlreadyMapped,
	cuda.CodeDeinitialized,
	cuda.CodeIllegalAddress,
	cuda.CodeIllegalState,
	cuda.CodeInvalidContext,
	cuda.CodeInvalidDevice,
	cuda.CodeInvalidHandle,
	cuda.CodeInvalidValue,
	cuda.CodeNoDevice,
	cuda.CodeNotInitialized,
	cuda.CodeNotMapped,
	cuda.CodeNotPermitted,
	cuda.CodeNotSupported,
	cuda.CodeOutOfMemory,
	cuda.CodeStubLibrary,
	cuda.CodeUnknown,
	cuda.Code(803), // CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
	cuda.Code(804), // CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
}

func (f *FakeDriver) getErrorName(code cuda.Code, name **byte) cuda.Code {
	// Not counted and never failed: it runs on error paths only.
	if name == nil {
		return cuda.CodeInvalidValue
	}
	b, ok := fakeErrorNames()[code]
	if !ok {
		return cuda.CodeInvalidValue
	}
	*name = &b[0]
	return cuda.Success
}
