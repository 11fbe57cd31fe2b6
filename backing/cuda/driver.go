package cuda

import (
	"fmt"
	"reflect"
	"strings"
	"sync"
	"unsafe"
)

// Driver is the seam between the backing and the CUDA driver: one Go function per
// driver entry point, with the driver's own argument shapes. LoadDriver fills it from
// libcuda through purego; cudatest.NewFakeDriver fills it with an in-memory model.
// Each field's comment names the exported symbol it is bound to.
//
// NB: several entry points are bound to their _v2 symbols. The unsuffixed names are
// still exported by the driver with the CUDA 2.0 ABI (32-bit device pointers and sizes),
// so binding "cuMemsetD8" instead of "cuMemsetD8_v2" would silently truncate addresses.
//
// A Driver's fields are set once and never changed, so one Driver may serve any number
// of goroutines and Backings.
type Driver struct {
	Init                        func(flags uint32) Code                                                        // cuInit
	DriverGetVersion            func(version *int32) Code                                                      // cuDriverGetVersion
	DeviceGetCount              func(count *int32) Code                                                        // cuDeviceGetCount
	DeviceGet                   func(dev *int32, ordinal int32) Code                                           // cuDeviceGet
	DeviceGetAttribute          func(value *int32, attr int32, dev int32) Code                                 // cuDeviceGetAttribute
	DevicePrimaryCtxRetain      func(ctx *uintptr, dev int32) Code                                             // cuDevicePrimaryCtxRetain
	DevicePrimaryCtxRelease     func(dev int32) Code                                                           // cuDevicePrimaryCtxRelease_v2
	CtxSetCurrent               func(ctx uintptr) Code                                                         // cuCtxSetCurrent
	CtxSynchronize              func() Code                                                                    // cuCtxSynchronize
	MemGetInfo                  func(free, total *uintptr) Code                                                // cuMemGetInfo_v2
	MemGetAllocationGranularity func(gran *uintptr, prop *MemAllocationProp, option int32) Code                // cuMemGetAllocationGranularity
	MemAddressReserve           func(ptr *uint64, size, alignment uintptr, addr uint64, flags uint64) Code     // cuMemAddressReserve
	MemAddressFree              func(ptr uint64, size uintptr) Code                                            // cuMemAddressFree
	MemCreate                   func(handle *uint64, size uintptr, prop *MemAllocationProp, flags uint64) Code // cuMemCreate
	MemRelease                  func(handle uint64) Code                                                       // cuMemRelease
	MemMap                      func(ptr uint64, size, offset uintptr, handle uint64, flags uint64) Code       // cuMemMap
	MemUnmap                    func(ptr uint64, size uintptr) Code                                            // cuMemUnmap
	MemSetAccess                func(ptr uint64, size uintptr, desc *MemAccessDesc, count uintptr) Code        // cuMemSetAccess
	MemsetD8                    func(dst uint64, value uint8, n uintptr) Code                                  // cuMemsetD8_v2
	MemcpyHtoD                  func(dst uint64, src unsafe.Pointer, n uintptr) Code                           // cuMemcpyHtoD_v2
	MemcpyDtoH                  func(dst unsafe.Pointer, src uint64, n uintptr) Code                           // cuMemcpyDtoH_v2
	MemcpyDtoD                  func(dst, src uint64, n uintptr) Code                                          // cuMemcpyDtoD_v2
	GetErrorName                func(code Code, name **byte) Code                                              // cuGetErrorName

	// Host memory and streams, for a tier of pinned host memory below the device
	// (host.go). Optional: a Driver without them still backs device memory, and
	// PinHost and NewStream then fail with ErrMissingSymbol.
	MemHostRegister   func(p unsafe.Pointer, size uintptr, flags uint32) Code              // cuMemHostRegister_v2
	MemHostUnregister func(p unsafe.Pointer) Code                                          // cuMemHostUnregister
	StreamCreate      func(stream *uintptr, flags uint32) Code                             // cuStreamCreate
	StreamSynchronize func(stream uintptr) Code                                            // cuStreamSynchronize
	StreamDestroy     func(stream uintptr) Code                                            // cuStreamDestroy_v2
	MemcpyHtoDAsync   func(dst uint64, src unsafe.Pointer, n uintptr, stream uintptr) Code // cuMemcpyHtoDAsync_v2
	MemcpyDtoHAsync   func(dst unsafe.Pointer, src uint64, n uintptr, stream uintptr) Code // cuMemcpyDtoHAsync_v2

	// Export and import of allocations between processes (export.go). Optional: a
	// Driver without them backs device memory, and Options.Exportable, Export and
	// Import then fail with ErrMissingSymbol. For HandleTypePosixFD, shareable
	// points at a C int that receives a new descriptor, and osHandle is the
	// descriptor's value itself.
	MemExportToShareableHandle   func(shareable unsafe.Pointer, handle uint64, handleType int32, flags uint64) Code // cuMemExportToShareableHandle
	MemImportFromShareableHandle func(handle *uint64, osHandle uintptr, handleType int32) Code                      // cuMemImportFromShareableHandle
}

// symbol binds one Driver field to the exported name it must be looked up by.
type symbol struct {
	name  string
	field func(d *Driver) any // a pointer to the field
}

// symbols is the lookup table of every entry point. Unit-tested: every field appears
// once, and the _v2 entry points are never bound to their legacy names.
var symbols = [...]symbol{
	{"cuInit", func(d *Driver) any { return &d.Init }},
	{"cuDriverGetVersion", func(d *Driver) any { return &d.DriverGetVersion }},
	{"cuDeviceGetCount", func(d *Driver) any { return &d.DeviceGetCount }},
	{"cuDeviceGet", func(d *Driver) any { return &d.DeviceGet }},
	{"cuDeviceGetAttribute", func(d *Driver) any { return &d.DeviceGetAttribute }},
	{"cuDevicePrimaryCtxRetain", func(d *Driver) any { return &d.DevicePrimaryCtxRetain }},
	{"cuDevicePrimaryCtxRelease_v2", func(d *Driver) any { return &d.DevicePrimaryCtxRelease }},
	{"cuCtxSetCurrent", func(d *Driver) any { return &d.CtxSetCurrent }},
	{"cuCtxSynchronize", func(d *Driver) any { return &d.CtxSynchronize }},
	{"cuMemGetInfo_v2", func(d *Driver) any { return &d.MemGetInfo }},
	{"cuMemGetAllocationGranularity", func(d *Driver) any { return &d.MemGetAllocationGranularity }},
	{"cuMemAddressReserve", func(d *Driver) any { return &d.MemAddressReserve }},
	{"cuMemAddressFree", func(d *Driver) any { return &d.MemAddressFree }},
	{"cuMemCreate", func(d *Driver) any { return &d.MemCreate }},
	{"cuMemRelease", func(d *Driver) any { return &d.MemRelease }},
	{"cuMemMap", func(d *Driver) any { return &d.MemMap }},
	{"cuMemUnmap", func(d *Driver) any { return &d.MemUnmap }},
	{"cuMemSetAccess", func(d *Driver) any { return &d.MemSetAccess }},
	{"cuMemsetD8_v2", func(d *Driver) any { return &d.MemsetD8 }},
	{"cuMemcpyHtoD_v2", func(d *Driver) any { return &d.MemcpyHtoD }},
	{"cuMemcpyDtoH_v2", func(d *Driver) any { return &d.MemcpyDtoH }},
	{"cuMemcpyDtoD_v2", func(d *Driver) any { return &d.MemcpyDtoD }},
	{"cuGetErrorName", func(d *Driver) any { return &d.GetErrorName }},
}

// hostSymbols are the optional entry points of pinned host memory and streams: bound
// when the driver has them, nil otherwise. NB: cuMemHostRegister, cuStreamDestroy and
// the async copies are bound to their _v2 symbols, as cuda.h's #defines do; the
// unsuffixed ones keep older ABIs.
var hostSymbols = [...]symbol{
	{"cuMemHostRegister_v2", func(d *Driver) any { return &d.MemHostRegister }},
	{"cuMemHostUnregister", func(d *Driver) any { return &d.MemHostUnregister }},
	{"cuStreamCreate", func(d *Driver) any { return &d.StreamCreate }},
	{"cuStreamSynchronize", func(d *Driver) any { return &d.StreamSynchronize }},
	{"cuStreamDestroy_v2", func(d *Driver) any { return &d.StreamDestroy }},
	{"cuMemcpyHtoDAsync_v2", func(d *Driver) any { return &d.MemcpyHtoDAsync }},
	{"cuMemcpyDtoHAsync_v2", func(d *Driver) any { return &d.MemcpyDtoHAsync }},
}

// exportSymbols are the optional entry points of exporting allocations to other
// processes: bound when the driver has them, nil otherwise. Both date from CUDA 10.2
// with the rest of the VMM API and have no suffix.
var exportSymbols = [...]symbol{
	{"cuMemExportToShareableHandle", func(d *Driver) any { return &d.MemExportToShareableHandle }},
	{"cuMemImportFromShareableHandle", func(d *Driver) any { return &d.MemImportFromShareableHandle }},
}

// loadDriverOnce loads the system driver once per process: dlopen is reference
// counted and the bound functions never change, so every Backing can share it.
var loadDriverOnce = sync.OnceValues(func() (*Driver, error) { return loadDriver(driverLibrary) })

// LoadDriver returns the system's CUDA driver (libcuda.so.1 on Linux, nvcuda.dll on
// Windows) with every entry point looked up. It returns an error matching ErrNoDriver
// when the library is missing and ErrMissingSymbol when it lacks an entry point; it
// never panics. It does not initialise the driver (New does), so it succeeds on a
// machine with a driver but no device.
func LoadDriver() (*Driver, error) { return loadDriverOnce() }

// loadDriver opens library lib and looks up every entry point in it.
func loadDriver(lib string) (*Driver, error) {
	h, err := openLibrary(lib)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrNoDriver, lib, err)
	}
	d := &Driver{}
	var missing []string
	for _, s := range symbols {
		addr, err := lookupSymbol(h, s.name)
		if err != nil || addr == 0 {
			missing = append(missing, s.name)
			continue
		}
		bindSymbol(s.field(d), addr)
	}
	for _, s := range append(hostSymbols[:], exportSymbols[:]...) {
		if addr, err := lookupSymbol(h, s.name); err == nil && addr != 0 {
			bindSymbol(s.field(d), addr)
		}
	}
	if len(missing) > 0 {
		closeLibrary(h)
		return nil, fmt.Errorf("%w: %s lacks %s", ErrMissingSymbol, lib, strings.Join(missing, ", "))
	}
	// NB: the library is never closed once bound: the Driver's functions point into it.
	return d, nil
}

// call returns nil for Success, else a *Result naming fn and the code.
func (d *Driver) call(fn string, c Code) error {
	if c == Success {
		return nil
	}
	return &Result{Func: fn, Code: c, Name: d.errorName(c)}
}

// errorName asks the driver to name c, falling back to the built-in table.
func (d *Driver) errorName(c Code) string {
	if d.GetErrorName != nil {
		var p *byte
		if d.GetErrorName(c, &p) == Success && p != nil {
			return goString(p)
		}
	}
	return c.String()
}

// checkComplete reports the fields of d that are nil: a hand-built Driver must set all.
func (d *Driver) checkComplete() error { return d.missing(symbols[:]) }

// checkHost returns an error matching ErrMissingSymbol naming the host-memory entry
// points d lacks.
func (d *Driver) checkHost() error { return d.missing(hostSymbols[:]) }

// checkExport returns an error matching ErrMissingSymbol naming the export entry
// points d lacks.
func (d *Driver) checkExport() error { return d.missing(exportSymbols[:]) }

// missing returns an error matching ErrMissingSymbol naming the entry points of table
// that d leaves nil, or nil.
func (d *Driver) missing(table []symbol) error {
	var missing []string
	for _, s := range table {
		if isNilFunc(s.field(d)) {
			missing = append(missing, s.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: Driver lacks %s", ErrMissingSymbol, strings.Join(missing, ", "))
	}
	return nil
}

// isNilFunc reports whether fptr, a pointer to a func field, holds nil.
func isNilFunc(fptr any) bool { return reflect.ValueOf(fptr).Elem().IsNil() }
