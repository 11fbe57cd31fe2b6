// Package causes counts, per decode step, what a step pays beyond its writes: the
// system calls the backing makes on the step's thread, the page faults the thread
// takes, the locks it finds held, the times it sleeps or is preempted, and the
// other goroutines it wakes (docs/benchmarks/step.md). It is a measurement seam, off
// unless a caller turns it on: examples/kvcache's -causes and kv's tests.
//
// Counting is by thread. A caller locks its goroutine to its thread
// (runtime.LockOSThread), calls Track, and then reads Now around each step: a count
// made on any other thread (the map-ahead worker's, say) is not the step's and is
// left out. The counters are process-wide, so one thread is tracked at a time.
//
// Cost: Enable makes the backings built after it wrap their system calls in a
// counter; before it, they are built as they always are and nothing is wrapped.
// A lock site costs one load of a word that nothing writes while counting is off.
// Off Linux, Track returns errors.ErrUnsupported and nothing is counted.
package causes

import (
	"sync"
	"sync/atomic"
)

// Kind is one thing a step may pay for, counted by Add.
type Kind uint8

const (
	// The backing's system calls, by what they do to the address space.
	SysMap      Kind = iota // mmap: a granule mapped into a range, or a range made reserved
	SysMove                 // mremap: a granule's page tables moved
	SysProtect              // mprotect
	SysAdvise               // madvise: populate, huge-page advice, dontneed
	SysFile                 // fallocate, ftruncate, memfd_create, close
	SysUnmap                // munmap
	WaitAhead               // the map-ahead worker's lock found held, or a wait for its run
	WaitPrefix              // the prefix cache's lock found held
	WaitBacking             // the host backing's pool lock found held
	Wake                    // a kick or broadcast that may wake another goroutine
	nKinds
)

var kindNames = [nKinds]string{"mmap", "mremap", "mprotect", "madvise", "file", "munmap",
	"ahead-lock", "prefix-lock", "pool-lock", "wake"}

// String returns the kind's short name, as the tables print it.
func (k Kind) String() string {
	if k < nKinds {
		return kindNames[k]
	}
	return "unknown"
}

// Kinds returns every kind, in order.
func Kinds() []Kind {
	ks := make([]Kind, nKinds)
	for i := range ks {
		ks[i] = Kind(i)
	}
	return ks
}

var (
	enabled atomic.Bool
	counts  [nKinds]atomic.Int64
)

// Enable turns counting on for the process: the backings built from now on count
// their system calls, and lock sites check whether they wait. It can not be undone.
func Enable() { enabled.Store(true) }

// Enabled reports whether Enable was called.
func Enabled() bool { return enabled.Load() }

// Counts is what a thread paid so far, or between two readings (Sub).
type Counts struct {
	Faults    int64 // minor and major page faults (getrusage RUSAGE_THREAD)
	Slept     int64 // voluntary context switches: a wait in the kernel (a futex, the mm lock)
	Preempted int64 // involuntary context switches: the scheduler took the CPU
	Kinds     [nKinds]int64
}

// Of returns the count of kind k.
func (c Counts) Of(k Kind) int64 { return c.Kinds[k] }

// Syscalls returns the backing's system calls counted.
func (c Counts) Syscalls() int64 {
	var n int64
	for k := SysMap; k <= SysUnmap; k++ {
		n += c.Kinds[k]
	}
	return n
}

// Sub returns c less d, counter by counter.
func (c Counts) Sub(d Counts) Counts {
	c.Faults -= d.Faults
	c.Slept -= d.Slept
	c.Preempted -= d.Preempted
	for i := range c.Kinds {
		c.Kinds[i] -= d.Kinds[i]
	}
	return c
}

// Add counts one k if the calling thread is the tracked one.
func Add(k Kind) {
	if enabled.Load() && onTracked() {
		counts[k].Add(1)
	}
}

// Lock locks mu, and counts one k if mu was held and the calling thread is the
// tracked one.
func Lock(mu *sync.Mutex, k Kind) {
	if !enabled.Load() {
		mu.Lock()
		return
	}
	if mu.TryLock() {
		return
	}
	if onTracked() {
		counts[k].Add(1)
	}
	mu.Lock()
}

// Now returns what the tracked thread paid so far; only that thread calls it.
func Now() Counts {
	c := threadCounts()
	for i := range counts {
		c.Kinds[i] = counts[i].Load()
	}
	return c
}
