package host

import (
	"errors"
	"math"

	"golang.org/x/sys/windows"

	"github.com/vmarena/vmarena/backing"
)

// privateAlignTries bounds the attempts to place a reservation at an aligned address
// that another thread may take between the probe and the reservation.
const privateAlignTries = 8

func privateInitOS() error { return nil }

// privateReserveOS reserves size bytes of inaccessible address space (MEM_RESERVE).
// Windows aligns reservations to 64 KiB; for a larger align it probes for a free
// aligned range and reserves there, and falls back to 64 KiB alignment if another
// thread keeps taking the spot.
func privateReserveOS(size, align int) (uintptr, error) {
	const allocGranularity = 64 << 10
	if align > allocGranularity && size <= math.MaxInt-align {
		for range privateAlignTries {
			probe, err := windows.VirtualAlloc(0, uintptr(size+align), windows.MEM_RESERVE, windows.PAGE_NOACCESS)
			if err != nil {
				break
			}
			aligned := (probe + uintptr(align) - 1) &^ (uintptr(align) - 1)
			if err := windows.VirtualFree(probe, 0, windows.MEM_RELEASE); err != nil {
				return 0, err
			}
			if p, err := windows.VirtualAlloc(aligned, uintptr(size), windows.MEM_RESERVE, windows.PAGE_NOACCESS); err == nil {
				return p, nil
			}
		}
	}
	return windows.VirtualAlloc(0, uintptr(size), windows.MEM_RESERVE, windows.PAGE_NOACCESS)
}

// privateReleaseOS releases the whole reservation at addr (MEM_RELEASE needs size 0).
func privateReleaseOS(addr uintptr, n int) error {
	return windows.VirtualFree(addr, 0, windows.MEM_RELEASE)
}

// privateCommitOS commits [addr, addr+n) read-write (MEM_COMMIT): charged to the
// commit limit now, zeroed pages on first touch.
func privateCommitOS(addr uintptr, n int) error {
	_, err := windows.VirtualAlloc(addr, uintptr(n), windows.MEM_COMMIT, windows.PAGE_READWRITE)
	return err
}

// privateDecommitOS decommits [addr, addr+n) (MEM_DECOMMIT): the pages go back and
// the range stays reserved; a touch faults and a recommit reads zeroes.
func privateDecommitOS(addr uintptr, n int) error {
	return windows.VirtualFree(addr, uintptr(n), windows.MEM_DECOMMIT)
}

// privatePopulateOS makes the pages of the committed range [addr, addr+n) resident
// and writable without faults, keeping their contents.
func privatePopulateOS(addr uintptr, n, page int) error {
	return populate(privatePtr(addr), n, page, true)
}

// privateNameOS does nothing: Windows can not name anonymous mappings.
func privateNameOS(addr uintptr, n int, name []byte) {}

// privateClassifyOS returns the backing sentinel for a Windows error: the commit
// limit and the out-of-memory errors are ErrOutOfMemory.
func privateClassifyOS(err error) (kind, cause error) {
	switch {
	case errors.Is(err, windows.ERROR_NOT_ENOUGH_MEMORY),
		errors.Is(err, windows.ERROR_OUTOFMEMORY),
		errors.Is(err, windows.ERROR_COMMITMENT_LIMIT):
		return backing.ErrOutOfMemory, err
	}
	return nil, err
}
