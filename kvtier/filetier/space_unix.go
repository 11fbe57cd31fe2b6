//go:build linux || darwin || freebsd

package filetier

import "golang.org/x/sys/unix"

// freeSpace returns the bytes of dir's file system an unprivileged writer may still
// take (statfs's f_bavail blocks).
func freeSpace(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(uint64(st.Bavail) * uint64(st.Bsize)), nil
}
