package testutil

import (
	"testing"

	"golang.org/x/sys/unix"
)

// ThreadCPU returns the calling thread's CPU time in nanoseconds (a system call); a
// benchmark that times its own calls by it locks its goroutine to the thread
// (runtime.LockOSThread) first.
func ThreadCPU(tb testing.TB) int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		tb.Fatal(err)
	}
	return ts.Nano()
}
