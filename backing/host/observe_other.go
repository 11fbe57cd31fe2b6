//go:build !linux

package host

// populateByTouchOS: only Linux has MADV_POPULATE_WRITE; elsewhere pages are touched.
func populateByTouchOS() bool { return true }
