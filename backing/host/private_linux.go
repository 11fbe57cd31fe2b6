package host

import (
	"errors"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
)

// privateMapSlack is how close to vm.max_map_count the mapping count must be for an
// ENOMEM to be blamed on the limit: a commit in the middle of a mapping splits it in
// three (two more), and /proc/self/maps lists [vsyscall], which the count omits.
const privateMapSlack = 4

var (
	// privateNaming is 0 until a mapping was named, then 1 if the kernel names
	// anonymous mappings, 2 if it answered EINVAL (no CONFIG_ANON_VMA_NAME) and 3 on
	// any other error.
	privateNaming atomic.Int32
)

func privateInitOS() error { return nil }

// privateDecommitOS gives the pages of [addr, addr+n) back (MADV_DONTNEED: the next
// touch would read zeroes) and takes the access away, so that a touch faults.
func privateDecommitOS(addr uintptr, n int) error {
	b := privateBytes(addr, 0, n)
	if err := unix.Madvise(b, unix.MADV_DONTNEED); err != nil {
		return err
	}
	return unix.Mprotect(b, unix.PROT_NONE)
}

// privatePopulateOS makes the pages of the committed range [addr, addr+n) resident
// and writable without faults, keeping their contents.
func privatePopulateOS(addr uintptr, n, page int) error {
	return populate(privatePtr(addr), n, page, true)
}

// privateNameOS names the mapping [addr, addr+n) so that /proc/self/maps shows
// [anon:name]. Kernels without CONFIG_ANON_VMA_NAME answer EINVAL, which is not an
// error here: the name is a debugging aid.
func privateNameOS(addr uintptr, n int, name []byte) {
	// Safety: name is a NUL-terminated slice held by the Private backing, so it is
	// alive across the call; the conversion is in the syscall's argument list as
	// unsafe.Pointer's rule 4 requires.
	_, _, errno := unix.Syscall6(unix.SYS_PRCTL, unix.PR_SET_VMA, unix.PR_SET_VMA_ANON_NAME,
		addr, uintptr(n), uintptr(unsafe.Pointer(&name[0])), 0)
	switch errno {
	case 0:
		privateNaming.Store(1)
	case unix.EINVAL:
		privateNaming.Store(2)
	default:
		privateNaming.Store(3)
	}
}

// privateClassifyOS returns the backing sentinel for an errno and the cause to
// report: ENOMEM is ErrMapLimit when the process is at vm.max_map_count, else
// ErrOutOfMemory.
func privateClassifyOS(err error) (kind, cause error) {
	if !errors.Is(err, unix.ENOMEM) {
		return nil, err
	}
	if count, limit, cerr := mapCount(); cerr == nil && count >= limit-privateMapSlack {
		return backing.ErrMapLimit, &mapLimitError{count: count, limit: limit, errno: err,
			cost: "each run of committed granules between reserved ones is a mapping", fix: "commit contiguous ranges"}
	}
	return backing.ErrOutOfMemory, err
}
