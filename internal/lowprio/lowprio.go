// Package lowprio runs background work at the lowest scheduling priority the OS
// gives a thread without privileges, so that it takes a CPU only when the token
// path's threads leave it one.
//
// A store into a tier copies and checksums megabytes; on a machine of few CPUs the
// kernel would otherwise share a CPU between it and a thread that writes a decode
// step's K and V, preempting the step for milliseconds. At the lowest priority the
// store still runs on every CPU the step leaves idle, and a step that becomes
// runnable takes its CPU back at once (Linux: nice 19, CFS weight 15 against 1024).
//
// Only work that holds no lock the token path waits for belongs here: a thread at
// the lowest priority that is descheduled while holding such a lock stalls the path
// behind it.
package lowprio

// Lower sets the calling thread's priority to the lowest. The caller MUST have locked
// its goroutine to the thread (runtime.LockOSThread) and MUST NOT unlock it: the
// priority stays with the thread, which ends with the goroutine, so that no other
// goroutine runs on it later. It returns whether the priority changed: false on an
// OS where it does nothing (all but Linux) or where the kernel refused.
func Lower() bool { return lower() }
