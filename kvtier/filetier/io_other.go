//go:build !linux && !darwin && !windows

package filetier

import "os"

// directName is "": direct I/O is not tried here (see the package doc).
const directName = ""

// createFile creates name, which must not exist, for writing, through the page cache.
func createFile(name string, _ bool) (*os.File, error) {
	return os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
}

// openFile opens name for reading, through the page cache.
func openFile(name string, _ bool) (*os.File, error) { return os.Open(name) }

// renameOver renames tmp to name, replacing it in one step: a reader that has the old
// file open keeps reading it whole.
func renameOver(tmp, name string) error { return os.Rename(tmp, name) }
