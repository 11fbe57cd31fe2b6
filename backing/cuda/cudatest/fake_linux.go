package cudatest

import "syscall"

// gettid identifies the calling OS thread, so the fake driver can check that the
// context is current on the thread that calls it.
func gettid() int { return syscall.Gettid() }
