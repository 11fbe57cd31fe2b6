package filetier

import (
	"errors"
	"os"
	"time"

	"golang.org/x/sys/windows"
)

// directName is what Stats.IO would say of direct I/O here: the tier does not open
// files with FILE_FLAG_NO_BUFFERING on Windows (it needs sector-aligned I/O through
// CreateFile's own handle; not done yet), so direct is always refused by the probe.
const directName = ""

// createFile creates name, which must not exist, for writing. Every handle the tier
// opens shares delete, so that a block being read may be replaced or removed.
func createFile(name string, _ bool) (*os.File, error) {
	return openShared(name, windows.GENERIC_WRITE, windows.CREATE_NEW)
}

// openFile opens name for reading.
func openFile(name string, _ bool) (*os.File, error) {
	return openShared(name, windows.GENERIC_READ, windows.OPEN_EXISTING)
}

func openShared(name string, access, disposition uint32) (*os.File, error) {
	p, err := windows.UTF16PtrFromString(name)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	h, err := windows.CreateFile(p, access, windows.FILE_SHARE_READ|windows.FILE_SHARE_WRITE|windows.FILE_SHARE_DELETE,
		nil, disposition, windows.FILE_ATTRIBUTE_NORMAL, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	return os.NewFile(uintptr(h), name), nil
}

// renameOver renames tmp to name, replacing it. NB: Windows refuses to replace (or
// to take the name of) a file that a reader still has open, sharing delete or not,
// where POSIX lets the reader keep the old file; a reader holds a block's file for
// one read, so the rename is tried again for up to about 20 ms before the store is
// given up (a counted drop).
func renameOver(tmp, name string) error {
	var err error
	for try := 0; try < 40; try++ {
		if err = os.Rename(tmp, name); err == nil || !busy(err) {
			return err
		}
		time.Sleep(500 * time.Microsecond)
	}
	return err
}

func busy(err error) bool {
	return errors.Is(err, windows.ERROR_ACCESS_DENIED) || errors.Is(err, windows.ERROR_SHARING_VIOLATION)
}
