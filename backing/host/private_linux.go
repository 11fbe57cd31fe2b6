package host

import (
	"bytes"
	"errors"
	"io"
	"os"
	"strconv"
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
	// privateNoPopulateWrite is set once MADV_POPULATE_WRITE answered EINVAL (kernels
	// before 5.14): from then on pages are touched instead.
	privateNoPopulateWrite atomic.Bool
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
	if !privateNoPopulateWrite.Load() {
		err := unix.Madvise(privateBytes(addr, 0, n), unix.MADV_POPULATE_WRITE)
		if !errors.Is(err, unix.EINVAL) {
			return err
		}
		privateNoPopulateWrite.Store(true)
	}
	privateTouch(addr, n, page)
	return nil
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
	if count, limit, ok := privateMapCount(); ok && count >= limit-privateMapSlack {
		return backing.ErrMapLimit, &privateMapLimitError{count: count, limit: limit, errno: err}
	}
	return backing.ErrOutOfMemory, err
}

// privateMapCount returns the process's number of mappings and vm.max_map_count. It
// runs only on the error path, and reads with one small buffer since the process may
// be at its mapping limit.
func privateMapCount() (count, limit int, ok bool) {
	b, err := os.ReadFile("/proc/sys/vm/max_map_count")
	if err != nil {
		return 0, 0, false
	}
	limit, err = strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil {
		return 0, 0, false
	}
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return 0, 0, false
	}
	defer f.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		count += bytes.Count(buf[:n], []byte{'\n'})
		if err == io.EOF {
			return count, limit, true
		}
		if err != nil {
			return 0, 0, false
		}
	}
}
