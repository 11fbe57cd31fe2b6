package host

import (
	"errors"

	"golang.org/x/sys/unix"
)

// populateByTouchOS asks the kernel for MADV_POPULATE_WRITE on one page of its own:
// kernels before 5.14 answer EINVAL.
func populateByTouchOS() bool {
	b, err := unix.Mmap(-1, 0, unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return false // unknown: the populate calls themselves will tell
	}
	defer unix.Munmap(b)
	return errors.Is(unix.Madvise(b, unix.MADV_POPULATE_WRITE), unix.EINVAL)
}
