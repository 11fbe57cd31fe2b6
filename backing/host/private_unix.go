//go:build linux || darwin

package host

import (
	"math"
	"os"

	"golang.org/x/sys/unix"
)

// privateReserveOS maps size bytes of inaccessible, unreserved (MAP_NORESERVE)
// address space aligned to align, a power of two: it maps align-page bytes more and
// unmaps the slack on either side.
func privateReserveOS(size, align int) (uintptr, error) {
	page := os.Getpagesize()
	span := size
	if align > page {
		if size > math.MaxInt-align {
			return 0, unix.ENOMEM
		}
		span = size + align - page
	}
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(span), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE)
	if err != nil {
		return 0, err
	}
	base := uintptr(p)
	aligned := (base + uintptr(align) - 1) &^ (uintptr(align) - 1)
	if head := aligned - base; head > 0 {
		if err := unix.MunmapPtr(p, head); err != nil {
			_ = unix.MunmapPtr(p, uintptr(span))
			return 0, err
		}
	}
	if tail := base + uintptr(span) - (aligned + uintptr(size)); tail > 0 {
		if err := unix.MunmapPtr(privatePtr(aligned+uintptr(size)), tail); err != nil {
			_ = unix.MunmapPtr(privatePtr(aligned), uintptr(size)+tail)
			return 0, err
		}
	}
	return aligned, nil
}

// privateReleaseOS unmaps [addr, addr+n), whatever its pages' state.
func privateReleaseOS(addr uintptr, n int) error {
	return unix.MunmapPtr(privatePtr(addr), uintptr(n))
}

// privateCommitOS makes [addr, addr+n) readable and writable. Pages come on first
// touch (or from privatePopulateOS).
func privateCommitOS(addr uintptr, n int) error {
	return unix.Mprotect(privateBytes(addr, 0, n), unix.PROT_READ|unix.PROT_WRITE)
}
