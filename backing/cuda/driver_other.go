//go:build !linux && !windows

package cuda

import "errors"

// driverLibrary names no library: there is no CUDA driver on this system.
const driverLibrary = "libcuda"

// posixFDs is false: there is no driver to export with.
const posixFDs = false

func openLibrary(string) (uintptr, error) { return 0, errors.ErrUnsupported }

func lookupSymbol(uintptr, string) (uintptr, error) { return 0, errors.ErrUnsupported }

func bindSymbol(any, uintptr) {}

func closeLibrary(uintptr) {}

// closeFD is never reached: nothing is exported here (posixFDs is false).
func closeFD(int) error { return errors.ErrUnsupported }
