package host

import (
	"errors"

	"golang.org/x/sys/unix"
)

// memfdCreate creates an anonymous memory file, close-on-exec and, where the kernel
// knows the flag (6.3+), sealed against exec: nothing here ever maps it executable,
// and newer kernels warn about memfds that do not say so.
func memfdCreate(name string) (int, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_NOEXEC_SEAL)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	}
	return fd, err
}

func memfdTruncate(fd int, size int64) error { return unix.Ftruncate(fd, size) }

// memfdAllocate allocates the pages of [off, off+n) of the file, zeroed, without
// mapping them.
func memfdAllocate(fd int, off, n int64) error { return unix.Fallocate(fd, 0, off, n) }

// memfdPunch frees the pages of [off, off+n) of the file; the size stays.
func memfdPunch(fd int, off, n int64) error {
	return unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}
