package filetier

import "golang.org/x/sys/windows"

// freeSpace returns the bytes of dir's volume available to this user
// (GetDiskFreeSpaceEx's free bytes available to the caller).
func freeSpace(dir string) (int64, error) {
	p, err := windows.UTF16PtrFromString(dir)
	if err != nil {
		return 0, err
	}
	var avail, total, free uint64
	if err := windows.GetDiskFreeSpaceEx(p, &avail, &total, &free); err != nil {
		return 0, err
	}
	return int64(avail), nil
}
