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
)

// The OS helpers both backings use on Linux.

// noPopulate is set once the kernel turned MADV_POPULATE_* down with EINVAL (kernels
// before 5.14): from then on both backings touch the pages instead.
var noPopulate atomic.Bool

// populate makes the pages of the committed range [at, at+n) resident without
// faults, keeping their contents: for writing when write is true
// (MADV_POPULATE_WRITE), else for reading (MADV_POPULATE_READ), or with a touch per
// page of size page on kernels without them.
func populate(at unsafe.Pointer, n, page int, write bool) error {
	if !noPopulate.Load() {
		advice := unix.MADV_POPULATE_READ
		if write {
			advice = unix.MADV_POPULATE_WRITE
		}
		err := unix.Madvise(sharedBytes(at, n), advice)
		if !errors.Is(err, unix.EINVAL) {
			return err
		}
		noPopulate.Store(true)
	}
	touch(at, n, page, write)
	return nil
}

// mapCount returns the process's number of mappings (lines of /proc/self/maps) and
// vm.max_map_count. It runs on error paths, when the process may be at its mapping
// limit, so it reads with one small buffer: reading all of /proc/self/maps at once
// (megabytes there) could make the heap grow, which needs a mapping, and the runtime
// dies of that.
func mapCount() (count, limit int, err error) {
	b, err := os.ReadFile("/proc/sys/vm/max_map_count")
	if err != nil {
		return 0, 0, err
	}
	limit, err = strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil {
		return 0, 0, err
	}
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		count += bytes.Count(buf[:n], []byte{'\n'})
		if err == io.EOF {
			return count, limit, nil
		}
		if err != nil {
			return 0, 0, err
		}
	}
}
