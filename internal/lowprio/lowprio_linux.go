package lowprio

import "golang.org/x/sys/unix"

// lower sets the calling thread's nice value to 19: on Linux setpriority with
// PRIO_PROCESS and a thread id sets that thread's alone.
func lower() bool {
	return unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19) == nil
}
