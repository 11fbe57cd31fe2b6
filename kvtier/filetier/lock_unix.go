//go:build linux || darwin || freebsd || netbsd || openbsd || dragonfly

package filetier

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// lockFile takes an exclusive flock on f without waiting: ErrLocked when another
// open file description holds it. The kernel drops it when the process dies, so a
// killed tier never leaves its directory locked.
func lockFile(f *os.File) error {
	err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return ErrLocked
	}
	return err
}
