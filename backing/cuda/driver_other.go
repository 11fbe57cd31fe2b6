//go:build !linux && !windows

package cuda

import "errors"

// driverLibrary names no library: there is no CUDA driver on this system.
const driverLibrary = "libcuda"

func openLibrary(string) (uintptr, error) { return 0, errors.ErrUnsupported }

func lookupSymbol(uintptr, string) (uintptr, error) { return 0, errors.ErrUnsupported }

func bindSymbol(any, uintptr) {}

func closeLibrary(uintptr) {}
