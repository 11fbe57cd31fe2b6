package cuda

import (
	"syscall"

	"github.com/ebitengine/purego"
)

// driverLibrary is the driver's soname. NB: not "libcuda.so", which is often the
// toolkit's link-time stub (cuInit then returns CUDA_ERROR_STUB_LIBRARY).
const driverLibrary = "libcuda.so.1"

// posixFDs: allocations can be exported as POSIX file descriptors here
// (HandleTypePosixFD).
const posixFDs = true

func openLibrary(name string) (uintptr, error) {
	return purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_GLOBAL)
}

// lookupSymbol uses Dlsym, which reports a missing symbol as an error; purego's
// RegisterLibFunc would panic instead.
func lookupSymbol(lib uintptr, name string) (uintptr, error) { return purego.Dlsym(lib, name) }

func bindSymbol(fptr any, addr uintptr) { purego.RegisterFunc(fptr, addr) }

func closeLibrary(lib uintptr) { _ = purego.Dlclose(lib) }

// closeFD closes a descriptor Export made.
func closeFD(fd int) error { return syscall.Close(fd) }
