package filetier

import (
	"os"

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
