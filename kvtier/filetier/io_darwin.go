package filetier

import (
	"os"

	"golang.org/x/sys/unix"
)

// directName is what Stats.IO says of direct I/O here: macOS has no O_DIRECT; F_NOCACHE
// asks it to keep the file's pages out of its cache, which is the nearest it offers.
const directName = "F_NOCACHE"

// createFile creates name, which must not exist, for writing; with direct, with
// F_NOCACHE set.
func createFile(name string, direct bool) (*os.File, error) {
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil || !direct {
		return f, err
	}
	return noCache(f)
}

// openFile opens name for reading, with F_NOCACHE set with direct.
func openFile(name string, direct bool) (*os.File, error) {
	f, err := os.Open(name)
	if err != nil || !direct {
		return f, err
	}
	return noCache(f)
}

func noCache(f *os.File) (*os.File, error) {
	if _, err := unix.FcntlInt(f.Fd(), unix.F_NOCACHE, 1); err != nil {
		f.Close()
		return nil, &os.PathError{Op: "fcntl F_NOCACHE", Path: f.Name(), Err: err}
	}
	return f, nil
}

// renameOver renames tmp to name, replacing it in one step: a reader that has the old
// file open keeps reading it whole.
func renameOver(tmp, name string) error { return os.Rename(tmp, name) }
