//go:build !linux && !windows

package host

import (
	"errors"
	"unsafe"
)

// The shared backing needs memfd_create (Linux) or placeholders (Windows); elsewhere
// NewShared returns an error wrapping errors.ErrUnsupported and these are never
// called.
const (
	sharedSupported      = false
	sharedPark           = false
	sharedMinGranularity = 1
	sharedCreateCall     = "memfd_create"
	sharedMapAllocates   = false
	sharedPrivate        = false
)

func sharedDefaultSys() sharedSys {
	return sharedSys{
		memfd:    func(string) (int, error) { return -1, errors.ErrUnsupported },
		truncate: func(int, int64) error { return errors.ErrUnsupported },
		allocate: func(int, int64, int64) error { return errors.ErrUnsupported },
		punch:    func(int, int64, int64) error { return errors.ErrUnsupported },
		closeFd:  func(int) error { return errors.ErrUnsupported },
		reserve:  func(int) (unsafe.Pointer, error) { return nil, errors.ErrUnsupported },
		mapFile:  func(unsafe.Pointer, int, int, int64, bool) error { return errors.ErrUnsupported },
		unmapTo:  func(unsafe.Pointer, int) error { return errors.ErrUnsupported },
		move:     func(unsafe.Pointer, unsafe.Pointer, int) error { return errors.ErrUnsupported },
		protect:  func(unsafe.Pointer, int, bool) error { return errors.ErrUnsupported },
		release:  func(unsafe.Pointer, int) error { return errors.ErrUnsupported },
		populate: func(unsafe.Pointer, int, bool) error { return errors.ErrUnsupported },
		advise:   func(unsafe.Pointer, int, bool) error { return errors.ErrUnsupported },
		discard:  func(unsafe.Pointer, int) error { return errors.ErrUnsupported },
		mapCount: func() (int, int, error) { return 0, 0, errors.ErrUnsupported },
	}
}

func sharedNoMemory(error) bool { return false }
