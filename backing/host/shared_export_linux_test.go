package host

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sysCachestat is cachestat(2) (Linux 6.5+), which x/sys does not wrap. Unlike
// mincore and SEEK_DATA it counts shmem pages that fallocate allocated but nothing
// has written yet.
const sysCachestat = 451

type cachestatRange struct{ off, len uint64 }

type cachestat struct {
	cache, dirty, writeback, evicted, recentlyEvicted uint64
}

// SharedFileCheck checks the memfd's pages against the bookkeeping: no page of a
// Free slot is allocated (a leak no ledger would see), and every page of an idle
// slot the pool calls resident is (in memory or swapped). It also checks the file's
// size. Where the kernel lacks cachestat only the size is checked. It must be called
// while no operation is in flight.
func SharedFileCheck(s *Shared) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var st unix.Stat_t
	if err := unix.Fstat(s.fd, &st); err != nil {
		return err
	}
	if want := int64(len(s.slots)) << s.shift; st.Size != want {
		return fmt.Errorf("memfd is %d bytes, %d slots of %d", st.Size, len(s.slots), s.g)
	}
	per := uint64(s.g / os.Getpagesize())
	for i := range s.slots {
		rg := cachestatRange{off: uint64(i) << s.shift, len: uint64(s.g)}
		var cs cachestat
		// Safety: both pointers are to Go values that outlive the call.
		_, _, e := unix.Syscall(sysCachestat, uintptr(s.fd), uintptr(unsafe.Pointer(&rg)), uintptr(unsafe.Pointer(&cs)))
		if errors.Is(e, unix.ENOSYS) {
			return nil
		}
		if e != 0 {
			return fmt.Errorf("cachestat: %w", e)
		}
		pages := cs.cache + cs.evicted
		switch {
		case s.free.has(i) && pages > 0:
			return fmt.Errorf("slot %d is free but %d of its pages are allocated", i, pages)
		case s.idle.has(i) && s.slots[i].resident && pages < per:
			return fmt.Errorf("idle slot %d is called resident but %d of its %d pages are allocated", i, pages, per)
		}
	}
	return nil
}

// SetSharedNoPopulate makes Populate touch every page instead of calling
// MADV_POPULATE_*, as on kernels before 5.14, and returns the previous setting.
func SetSharedNoPopulate(v bool) bool { return noPopulate.Swap(v) }

// SetSharedNoMove makes the backing map granules afresh instead of moving them out
// of the park, as on kernels before 5.13, and returns the previous setting.
func SetSharedNoMove(v bool) bool { return sharedNoMove.Swap(v) }
