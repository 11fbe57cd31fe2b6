//go:build !linux

package cudatest

// gettid returns 0: the fake driver can not tell threads apart here and skips its
// current-context check.
func gettid() int { return 0 }
