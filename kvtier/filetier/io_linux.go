package filetier

import (
	"os"

	"golang.org/x/sys/unix"
)

// directName is what Stats.IO says of direct I/O here.
const directName = "O_DIRECT"

// createFile creates name, which must not exist, for writing; with direct, by
// O_DIRECT: the page cache is bypassed, so buffers, offsets and lengths must be
// aligned (tier.go aligns them to Options.Align). A file system that refuses O_DIRECT
// (tmpfs) fails the open with EINVAL.
func createFile(name string, direct bool) (*os.File, error) {
	flag := os.O_WRONLY | os.O_CREATE | os.O_EXCL
	if direct {
		flag |= unix.O_DIRECT
	}
	return os.OpenFile(name, flag, 0o644)
}

// openFile opens name for reading, by O_DIRECT with direct.
func openFile(name string, direct bool) (*os.File, error) {
	flag := os.O_RDONLY
	if direct {
		flag |= unix.O_DIRECT
	}
	return os.OpenFile(name, flag, 0)
}

// renameOver renames tmp to name, replacing it in one step: a reader that has the old
// file open keeps reading it whole.
func renameOver(tmp, name string) error { return os.Rename(tmp, name) }
