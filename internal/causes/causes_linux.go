package causes

import (
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// tracked is the tracked thread's id, 0 for none.
var tracked atomic.Int64

// Track makes the calling thread the one counted, and turns counting on (Enable).
// The caller MUST have locked its goroutine to the thread (runtime.LockOSThread)
// and MUST call Untrack before it unlocks it.
func Track() error {
	Enable()
	tracked.Store(int64(unix.Gettid()))
	return nil
}

// Untrack stops counting for the tracked thread.
func Untrack() { tracked.Store(0) }

// onTracked reports whether the calling thread is the tracked one (a system call:
// only while counting is on).
func onTracked() bool {
	t := tracked.Load()
	return t != 0 && int64(unix.Gettid()) == t
}

// threadCounts returns the calling thread's faults and context switches.
func threadCounts() Counts {
	var u unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &u); err != nil {
		panic("causes: getrusage(RUSAGE_THREAD): " + err.Error()) // NB: it fails only on a bad argument
	}
	return Counts{Faults: int64(u.Minflt) + int64(u.Majflt), Slept: int64(u.Nvcsw), Preempted: int64(u.Nivcsw)}
}
