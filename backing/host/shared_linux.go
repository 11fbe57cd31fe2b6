package host

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	sharedSupported = true
	// sharedPark says whether idle granules wait mapped in the park (see
	// shared_park.go).
	sharedPark = true
	// sharedMinGranularity is the least granule beyond the page size.
	sharedMinGranularity = 1
	// sharedCreateCall names what creates the pool's file, for errors.
	sharedCreateCall = "memfd_create"
	// sharedMapAllocates says whether mapping a new slot gives it memory (a
	// memfd's hole stays one until touched).
	sharedMapAllocates = false
	// sharedPrivate says whether new granules may be private anonymous memory,
	// which moves (mremap) into the park and into the memfd.
	sharedPrivate = true
)

// sharedDefaultSys returns the real system calls.
func sharedDefaultSys() sharedSys {
	return sharedSys{
		memfd:    memfdCreate,
		truncate: memfdTruncate,
		allocate: memfdAllocate,
		punch:    memfdPunch,
		closeFd:  unix.Close,
		reserve:  sharedReserve,
		mapFile:  sharedMapFile,
		unmapTo:  sharedUnmapTo,
		move:     sharedMove,
		protect:  sharedProtect,
		release:  sharedRelease,
		populate: sharedPopulate,
		advise:   sharedAdvise,
		discard:  sharedDiscard,
		mapCount: mapCount,
	}
}

// sharedNoMemory reports whether err says the system had no memory (or no room in
// the memfd's filesystem) to give.
func sharedNoMemory(err error) bool {
	return errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.ENOSPC)
}

func sharedReserve(n int) (unsafe.Pointer, error) {
	return unix.MmapPtr(-1, 0, nil, uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
}

func sharedMapFile(at unsafe.Pointer, n, fd int, off int64, ro bool) error {
	prot := unix.PROT_READ | unix.PROT_WRITE
	if ro {
		prot = unix.PROT_READ
	}
	_, err := unix.MmapPtr(fd, off, at, uintptr(n), prot, unix.MAP_SHARED|unix.MAP_FIXED)
	return err
}

// sharedUnmapTo replaces [at, at+n) with fresh reserved memory. NB: not munmap: the
// range must stay ours, or another mmap could land in the middle of a reservation.
// NB: the backing treats a failed MAP_FIXED mmap (here and in sharedMapFile) as
// having changed nothing, which holds on recent kernels; older ones could
// unmap the old range before failing, leaving a hole in the reservation.
func sharedUnmapTo(at unsafe.Pointer, n int) error {
	_, err := unix.MmapPtr(-1, 0, at, uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED)
	return err
}

// sharedAdvise asks for transparent huge pages on [at, at+n) (MADV_HUGEPAGE), or,
// when huge is false, for none (MADV_NOHUGEPAGE).
func sharedAdvise(at unsafe.Pointer, n int, huge bool) error {
	advice := unix.MADV_HUGEPAGE
	if !huge {
		advice = unix.MADV_NOHUGEPAGE
	}
	return unix.Madvise(sharedBytes(at, n), advice)
}

// sharedDiscard frees the pages of [at, at+n), private anonymous memory of a
// reservation, and takes the access away: the range is reserved again, in place.
// NB: if the second step fails the pages are gone but the range stays accessible.
func sharedDiscard(at unsafe.Pointer, n int) error {
	b := sharedBytes(at, n)
	if err := unix.Madvise(b, unix.MADV_DONTNEED); err != nil {
		return err
	}
	return unix.Mprotect(b, unix.PROT_NONE)
}

func sharedRelease(at unsafe.Pointer, n int) error { return unix.MunmapPtr(at, uintptr(n)) }

func sharedProtect(at unsafe.Pointer, n int, ro bool) error {
	prot := unix.PROT_READ | unix.PROT_WRITE
	if ro {
		prot = unix.PROT_READ
	}
	return unix.Mprotect(sharedBytes(at, n), prot)
}

// sharedNoMove is set once the kernel turned MREMAP_DONTUNMAP of a shared mapping
// down (before 5.13): granules are then mapped afresh and take their page faults.
var sharedNoMove atomic.Bool

// errSharedNoMove says that the kernel can not move a shared mapping and keep its
// source.
var errSharedNoMove = fmt.Errorf("host: mremap(MREMAP_DONTUNMAP) of a shared mapping: %w", errors.ErrUnsupported)

// sharedMove moves the page tables of the n bytes mapped at from to to, which it
// maps in the same place of the same file in their stead (mremap MREMAP_FIXED, so
// that what was at to goes in the same step). NB: MREMAP_DONTUNMAP keeps the source
// mapped, with no page table entries: the range never has a hole another mmap could
// take, and a failure after the move leaves nothing to undo. The kernel refuses it
// with EINVAL before 5.13 (our arguments are always page-aligned and the same
// size). A range over several mappings (a run of private granules that came out of
// the park at different times) is refused with EFAULT before Linux 6.17, which
// changes nothing (errSharedSpan), and moved mapping by mapping since, where a
// failure may leave it moved in part (see parkPriv).
func sharedMove(from, to unsafe.Pointer, n int) error {
	if sharedNoMove.Load() {
		return errSharedNoMove
	}
	_, err := unix.MremapPtr(from, uintptr(n), to, uintptr(n), unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED|unix.MREMAP_DONTUNMAP)
	if errors.Is(err, unix.EINVAL) {
		sharedNoMove.Store(true)
		return errSharedNoMove
	}
	if errors.Is(err, unix.EFAULT) {
		return fmt.Errorf("%w: %w", errSharedSpan, err)
	}
	return err
}

// sharedPopulate populates the pages of [at, at+n), for writing when write is true.
func sharedPopulate(at unsafe.Pointer, n int, write bool) error {
	return populate(at, n, os.Getpagesize(), write)
}
