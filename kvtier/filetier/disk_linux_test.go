package filetier_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/kvtier/filetier"
)

// mountTmpfs mounts a tmpfs of size bytes (read-only with ro) on a fresh directory
// and returns it, unmounted when the test ends. It skips the test where mounting is
// not allowed (not root, or a container without CAP_SYS_ADMIN).
func mountTmpfs(t *testing.T, size string, ro bool) string {
	t.Helper()
	dir := t.TempDir()
	var flags uintptr
	if ro {
		flags = unix.MS_RDONLY
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", flags, "size="+size); err != nil {
		t.Skipf("can not mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// A read-only directory is a clear error at start: a read-only file system (root
// mounts one), or a directory without write permission (anyone else).
func TestReadOnlyDir(t *testing.T) {
	var dir string
	if os.Geteuid() == 0 {
		dir = mountTmpfs(t, "1m", true)
	} else {
		dir = t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o555))
	}
	_, err := filetier.New(filetier.Options{Dir: dir, Budget: 1 << 20, Logger: quiet})
	assert.ErrorIs(t, err, filetier.ErrDir)
	assert.True(t, errors.Is(err, unix.EROFS) || errors.Is(err, fs.ErrPermission), "%v: want EROFS or a permission error", err)
}

// On a tmpfs (which refused O_DIRECT before Linux 6.6) a tier that can not use
// direct I/O says so and goes through the page cache; when the file system fills behind its back, a store is a counted drop with
// the OS's error, and the blocks it held are still served.
func TestFullDisk(t *testing.T) {
	dir := mountTmpfs(t, "8m", false)
	var log logLines
	tr := newTier(t, filetier.Options{Dir: dir, Logger: log.logger()})
	st := tr.Stats()
	if st.IO == "buffered" {
		assert.Contains(t, log.String(), "refuses direct I/O")
	} else {
		assert.Equal(t, "O_DIRECT", st.IO)
	}
	assert.LessOrEqual(t, st.Budget, int64(8<<20))
	k := key(nsA, 0)
	store(t, tr, k, value(1<<20, 1))

	// Something else fills the file system.
	filler, err := os.Create(filepath.Join(dir, "filler"))
	require.NoError(t, err)
	_, err = filler.Write(make([]byte, 8<<20))
	require.ErrorIs(t, err, unix.ENOSPC)
	require.NoError(t, filler.Close())

	err = tr.Store(bg, key(nsA, 1), 1<<20, func(dst []byte) error { clear(dst); return nil })
	assert.ErrorIs(t, err, filetier.ErrWrite)
	assert.ErrorIs(t, err, unix.ENOSPC)
	st = tr.Stats()
	assert.EqualValues(t, 1, st.Drops)
	assert.EqualValues(t, 1, st.WriteErrors)
	got, err := load(tr, k)
	require.NoError(t, err)
	assert.Equal(t, value(1<<20, 1), got)
	files, err := os.ReadDir(filepath.Dir(path(dir, k)))
	require.NoError(t, err)
	assert.Len(t, files, 1, "the failed store left a file")

	// A full file system is refused at start, with a budget or without.
	require.NoError(t, tr.Close())
	for _, budget := range []int64{0, 4 << 20} {
		_, err = filetier.New(filetier.Options{Dir: dir, Budget: budget, Logger: quiet})
		assert.ErrorIs(t, err, filetier.ErrNoSpace, "budget %d", budget)
	}
}
