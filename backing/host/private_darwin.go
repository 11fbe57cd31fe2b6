package host

import (
	"errors"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
)

func privateInitOS() error { return nil }

// privateDecommitOS replaces [addr, addr+n) with a fresh inaccessible anonymous
// mapping: the old pages go back to the OS and the next commit reads zeroes.
//
// NB: not MADV_DONTNEED, which on Darwin may leave the old contents in place (and
// MADV_FREE_REUSABLE keeps them until memory is short); CommitZeroes promises zero.
func privateDecommitOS(addr uintptr, n int) error {
	_, err := unix.MmapPtr(-1, 0, privatePtr(addr), uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE|unix.MAP_FIXED)
	return err
}

// privatePopulateOS touches every page of the committed range [addr, addr+n):
// Darwin has no MADV_POPULATE_WRITE.
func privatePopulateOS(addr uintptr, n, page int) error {
	touch(privatePtr(addr), n, page, true)
	return nil
}

// privateNameOS does nothing: Darwin can not name anonymous mappings.
func privateNameOS(addr uintptr, n int, name []byte) {}

// privateClassifyOS returns the backing sentinel for an errno: ENOMEM is
// ErrOutOfMemory.
func privateClassifyOS(err error) (kind, cause error) {
	if errors.Is(err, unix.ENOMEM) {
		return backing.ErrOutOfMemory, err
	}
	return nil, err
}
