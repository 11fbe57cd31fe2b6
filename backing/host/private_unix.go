//go:build linux || darwin

package host

import (
	"math"
	"os"

	"golang.org/x/sys/unix"
)

// privateReserveOS maps size bytes of inaccessible, unreserved (MAP_NORESERVE)
// address space aligned to align, a power of two, between two guard pages: it maps
// align+page bytes more and unmaps the slack on either side.
//
// NB: the guard pages stay inaccessible for the reservation's life, so that a
// committed granule at either end is never next to another mapping's read-write
// memory: the kernel would merge the two, and then neither the mapping count nor
// smaps (PrivateHugePages) could tell the reservation's memory apart.
func privateReserveOS(size, align int) (uintptr, error) {
	page := os.Getpagesize()
	align = max(align, page)
	if size > math.MaxInt-align-2*page {
		return 0, unix.ENOMEM
	}
	span := size + align + page
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(span), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE)
	if err != nil {
		return 0, err
	}
	base := uintptr(p)
	// The first aligned address with a page below it that is ours.
	aligned := (base + uintptr(page) + uintptr(align) - 1) &^ (uintptr(align) - 1)
	lo, hi := aligned-uintptr(page), aligned+uintptr(size)+uintptr(page)
	if head := lo - base; head > 0 {
		if err := unix.MunmapPtr(p, head); err != nil {
			_ = unix.MunmapPtr(p, uintptr(span))
			return 0, err
		}
	}
	if tail := base + uintptr(span) - hi; tail > 0 {
		if err := unix.MunmapPtr(privatePtr(hi), tail); err != nil {
			_ = unix.MunmapPtr(privatePtr(lo), hi-lo+tail)
			return 0, err
		}
	}
	return aligned, nil
}

// privateReleaseOS unmaps the reservation [addr, addr+n) that privateReserveOS
// made, its guard pages included, whatever its pages' state.
func privateReleaseOS(addr uintptr, n int) error {
	page := uintptr(os.Getpagesize())
	return unix.MunmapPtr(privatePtr(addr-page), uintptr(n)+2*page)
}

// privateCommitOS makes [addr, addr+n) readable and writable. Pages come on first
// touch (or from privatePopulateOS).
func privateCommitOS(addr uintptr, n int) error {
	return unix.Mprotect(privateBytes(addr, 0, n), unix.PROT_READ|unix.PROT_WRITE)
}
