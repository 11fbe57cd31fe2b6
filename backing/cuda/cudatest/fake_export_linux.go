package cudatest

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// fakeShmSupported: the fake exports allocations here, as memfds.
const fakeShmSupported = true

// fakeShmName is the memfd name prefix; the device ordinal follows it.
const fakeShmName = "cudatest-dev"

// fakeShm is the memfd behind an exportable or imported allocation, and its mapping.
type fakeShm struct {
	fd   int
	data []byte
}

// newFakeShm creates a memfd of size bytes for an allocation on device dev, mapped
// shared.
func newFakeShm(dev int32, size uintptr) (*fakeShm, error) {
	fd, err := unix.MemfdCreate(fakeShmName+strconv.Itoa(int(dev)), unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return mapFakeShm(fd, size)
}

// mapFakeShm maps size bytes of fd shared; on error it closes fd.
func mapFakeShm(fd int, size uintptr) (*fakeShm, error) {
	data, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return &fakeShm{fd: fd, data: data}, nil
}

// identifyFakeShm reports the device and size of the allocation whose descriptor
// (another process's export, perhaps) is fd, and false when fd is not one.
func identifyFakeShm(fd int) (int32, uintptr, bool) {
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, 0, false
	}
	// A memfd's link reads "/memfd:NAME (deleted)".
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		return 0, 0, false
	}
	rest, ok := strings.CutPrefix(link, "/memfd:"+fakeShmName)
	if !ok {
		return 0, 0, false
	}
	rest, _ = strings.CutSuffix(rest, " (deleted)")
	dev, err := strconv.Atoi(rest)
	if err != nil || dev < 0 || st.Size <= 0 {
		return 0, 0, false
	}
	return int32(dev), uintptr(st.Size), true
}

// openFakeShm maps size bytes of the allocation behind descriptor fd, through a
// descriptor of its own (fd stays the caller's).
func openFakeShm(fd int, size uintptr) (*fakeShm, error) {
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return mapFakeShm(own, size)
}

// dup returns a new descriptor of s's memfd: an export.
func (s *fakeShm) dup() (int, error) { return unix.FcntlInt(uintptr(s.fd), unix.F_DUPFD_CLOEXEC, 0) }

// close unmaps s and closes its descriptor.
func (s *fakeShm) close() {
	_ = unix.Munmap(s.data)
	_ = unix.Close(s.fd)
}
