//go:build !linux && !darwin && !freebsd && !windows

package filetier

import "errors"

// freeSpace is not known here: New then takes Options.Budget as given (and requires
// one).
func freeSpace(string) (int64, error) { return 0, errors.ErrUnsupported }
