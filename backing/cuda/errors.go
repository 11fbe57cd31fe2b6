package cuda

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/backing"
)

// Errors of loading the driver and opening a device. The first four also match
// errors.ErrUnsupported (backing.ErrUnsupported), so a caller can fall back to another
// backing with one test; they stay distinct from each other.
var (
	// ErrNoDriver: the driver library (libcuda.so.1, nvcuda.dll) could not be loaded.
	ErrNoDriver = fmt.Errorf("cuda: no CUDA driver library: %w", errors.ErrUnsupported)
	// ErrStubLibrary: the library loaded is the toolkit's stub, not a driver
	// (CUDA_ERROR_STUB_LIBRARY).
	ErrStubLibrary = fmt.Errorf("cuda: the CUDA toolkit stub library was loaded instead of the driver: %w", errors.ErrUnsupported)
	// ErrNoDevice: the driver found no CUDA device (CUDA_ERROR_NO_DEVICE).
	ErrNoDevice = fmt.Errorf("cuda: no CUDA device: %w", errors.ErrUnsupported)
	// ErrNoVMM: the device does not support virtual memory management (attribute 102
	// is 0), so address ranges can not be reserved and committed on it.
	ErrNoVMM = fmt.Errorf("cuda: device does not support virtual memory management: %w", errors.ErrUnsupported)
	// ErrMissingSymbol: the driver lacks an entry point this package needs (a driver
	// older than CUDA 10.2, or not a CUDA driver at all).
	ErrMissingSymbol = errors.New("cuda: driver lacks a required entry point")
	// ErrBadDevice: the device ordinal is negative or not below the device count.
	ErrBadDevice = errors.New("cuda: no such device ordinal")
	// ErrBadOptions: the Options are inconsistent (no authority, water marks).
	ErrBadOptions = errors.New("cuda: invalid options")
	// ErrBadGranularity: the driver reported a granularity that is not a power of two.
	ErrBadGranularity = errors.New("cuda: driver granularity is not a power of two")
	// ErrNoExport: Options.Exportable was asked for where the device can not export
	// allocations as POSIX file descriptors (attribute 103 is 0, or the system is
	// not Linux). It matches errors.ErrUnsupported.
	ErrNoExport = fmt.Errorf("cuda: device can not export allocations as file descriptors: %w", errors.ErrUnsupported)
)

// Errors of operations on a working backing.
var (
	// ErrReadOnly: a write (memset, copy) touches a granule mapped read-only (by
	// Share, or Protect), or Protect would make writable a granule shared read-only.
	// It matches backing.ErrReadOnly.
	ErrReadOnly = fmt.Errorf("cuda: range is mapped read-only: %w", backing.ErrReadOnly)
	// ErrBusy: Close was called while reservations are still live.
	ErrBusy = errors.New("cuda: backing still has live reservations")
	// ErrClosed: Close was called on a Backing closed already.
	ErrClosed = errors.New("cuda: backing closed")
	// ErrNotExportable: Export of a granule whose allocation can not be exported:
	// the Backing was made without Options.Exportable, or the granule was imported
	// from another process (only its exporter exports it).
	ErrNotExportable = errors.New("cuda: granule is not exportable")
	// ErrBadDescriptor: Import of a descriptor that is negative, or that the driver
	// does not take as an exported allocation of this device's granule size.
	ErrBadDescriptor = errors.New("cuda: not the descriptor of an exported allocation")
)

// Misuse panics with these messages.
const (
	// PanicClosed is the panic value for any use of a Backing after Close but a
	// second Close (ErrClosed).
	PanicClosed = "cuda: backing used after Close"
	// PanicNilReservation is the panic value for Base or Size of a nil reservation.
	PanicNilReservation = "cuda: nil reservation"
	// PanicHandleRefs is the panic value when a physical handle's reference count
	// would go negative: a mapping was dropped twice.
	PanicHandleRefs = "cuda: physical handle dropped more often than it was mapped"
)

// Code is a CUresult: the status every driver entry point returns.
type Code int32

// CUresult values this package names.
const (
	Success            Code = 0
	CodeInvalidValue   Code = 1
	CodeOutOfMemory    Code = 2
	CodeNotInitialized Code = 3
	CodeDeinitialized  Code = 4
	CodeStubLibrary    Code = 34
	CodeNoDevice       Code = 100
	CodeInvalidDevice  Code = 101
	CodeInvalidContext Code = 201
	CodeAlreadyMapped  Code = 208
	CodeNotMapped      Code = 211
	CodeInvalidHandle  Code = 400
	CodeIllegalState   Code = 401
	CodeIllegalAddress Code = 700
	CodeNotPermitted   Code = 800
	CodeNotSupported   Code = 801
	CodeUnknown        Code = 999
)

// codeNames is the built-in name table, used when the driver can not name a code.
var codeNames = map[Code]string{
	Success:            "CUDA_SUCCESS",
	CodeInvalidValue:   "CUDA_ERROR_INVALID_VALUE",
	CodeOutOfMemory:    "CUDA_ERROR_OUT_OF_MEMORY",
	CodeNotInitialized: "CUDA_ERROR_NOT_INITIALIZED",
	CodeDeinitialized:  "CUDA_ERROR_DEINITIALIZED",
	CodeStubLibrary:    "CUDA_ERROR_STUB_LIBRARY",
	CodeNoDevice:       "CUDA_ERROR_NO_DEVICE",
	CodeInvalidDevice:  "CUDA_ERROR_INVALID_DEVICE",
	CodeInvalidContext: "CUDA_ERROR_INVALID_CONTEXT",
	CodeAlreadyMapped:  "CUDA_ERROR_ALREADY_MAPPED",
	CodeNotMapped:      "CUDA_ERROR_NOT_MAPPED",
	CodeInvalidHandle:  "CUDA_ERROR_INVALID_HANDLE",
	CodeIllegalState:   "CUDA_ERROR_ILLEGAL_STATE",
	CodeIllegalAddress: "CUDA_ERROR_ILLEGAL_ADDRESS",
	CodeNotPermitted:   "CUDA_ERROR_NOT_PERMITTED",
	CodeNotSupported:   "CUDA_ERROR_NOT_SUPPORTED",
	CodeUnknown:        "CUDA_ERROR_UNKNOWN",
	803:                "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	804:                "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
}

// String returns the code's CUDA name from the built-in table, or "CUresult(n)".
func (c Code) String() string {
	if s, ok := codeNames[c]; ok {
		return s
	}
	return fmt.Sprintf("CUresult(%d)", int32(c))
}

// Result is a driver call that returned a status other than CUDA_SUCCESS. It matches
// backing.ErrOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY and backing.ErrUnsupported for
// CUDA_ERROR_NOT_SUPPORTED under errors.Is.
type Result struct {
	Func string // the entry point, as exported: "cuMemCreate"
	Code Code
	Name string // the driver's name for Code (cuGetErrorName), else the built-in one
}

func (e *Result) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d)", e.Func, e.Name, int32(e.Code))
}

// Is reports whether target is the backing sentinel that classifies e's code.
func (e *Result) Is(target error) bool {
	k := kindOf(e.Code)
	return k != nil && target == k
}

// kindOf returns the backing sentinel that classifies code c, or nil.
func kindOf(c Code) error {
	switch c {
	case CodeOutOfMemory:
		return backing.ErrOutOfMemory
	case CodeNotSupported:
		return backing.ErrUnsupported
	}
	return nil
}

// opError wraps a failure of op on [off, off+size) so that errors.Is finds both the
// classifying backing sentinel and the cause.
func opError(op string, off, size int, err error) error {
	var kind error
	var res *Result
	if errors.As(err, &res) {
		kind = kindOf(res.Code)
	}
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: err}
}
