package cuda

import (
	"syscall"

	"github.com/ebitengine/purego"
)

// driverLibrary is the driver's DLL, installed in System32 by the display driver.
const driverLibrary = "nvcuda.dll"

func openLibrary(name string) (uintptr, error) {
	h, err := syscall.LoadLibrary(name)
	return uintptr(h), err
}

func lookupSymbol(lib uintptr, name string) (uintptr, error) {
	return syscall.GetProcAddress(syscall.Handle(lib), name)
}

func bindSymbol(fptr any, addr uintptr) { purego.RegisterFunc(fptr, addr) }

func closeLibrary(lib uintptr) { _ = syscall.FreeLibrary(syscall.Handle(lib)) }
