package cuda

import (
	"errors"
	"syscall"

	"github.com/ebitengine/purego"
)

// driverLibrary is the driver's DLL, installed in System32 by the display driver.
const driverLibrary = "nvcuda.dll"

// posixFDs is false: the driver exports allocations on Windows as Win32 handles,
// which this package does not take (Options.Exportable fails with ErrNoExport).
const posixFDs = false

func openLibrary(name string) (uintptr, error) {
	h, err := syscall.LoadLibrary(name)
	return uintptr(h), err
}

func lookupSymbol(lib uintptr, name string) (uintptr, error) {
	return syscall.GetProcAddress(syscall.Handle(lib), name)
}

func bindSymbol(fptr any, addr uintptr) { purego.RegisterFunc(fptr, addr) }

func closeLibrary(lib uintptr) { _ = syscall.FreeLibrary(syscall.Handle(lib)) }

// closeFD is never reached: nothing is exported here (posixFDs is false).
func closeFD(int) error { return errors.ErrUnsupported }
