//go:build !linux && !darwin && !windows

package host

import (
	"errors"
	"fmt"
)

// privateInitOS refuses: this system has no private backing.
func privateInitOS() error {
	return fmt.Errorf("host: private backing on this system: %w", errors.ErrUnsupported)
}

// The rest is never reached, since NewPrivate fails first.

func privateReserveOS(size, align int) (uintptr, error) { return 0, errors.ErrUnsupported }
func privateReleaseOS(addr uintptr, n int) error        { return errors.ErrUnsupported }
func privateCommitOS(addr uintptr, n int) error         { return errors.ErrUnsupported }
func privateDecommitOS(addr uintptr, n int) error       { return errors.ErrUnsupported }
func privatePopulateOS(addr uintptr, n, page int) error { return errors.ErrUnsupported }
func privateNameOS(addr uintptr, n int, name []byte)    {}
func privateClassifyOS(err error) (kind, cause error)   { return nil, err }
