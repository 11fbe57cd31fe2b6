package main

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// undumpable makes this process undumpable: other processes of its user can then
// neither ptrace it nor open its descriptors (every granule's memfd) through
// /proc/<pid>/fd.
func undumpable() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE, 0): %w", err)
	}
	return nil
}
