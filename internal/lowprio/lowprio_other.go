//go:build !linux

package lowprio

// lower does nothing: no thread priority is set outside Linux.
func lower() bool { return false }
