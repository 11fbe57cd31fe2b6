package causes_test

import (
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/internal/causes"
)

// track locks the test's goroutine to its thread and tracks it until the test ends.
func track(t *testing.T) {
	t.Helper()
	runtime.LockOSThread()
	require.NoError(t, causes.Track())
	t.Cleanup(func() {
		causes.Untrack()
		runtime.UnlockOSThread()
	})
}

func TestCountsOnTheTrackedThreadOnly(t *testing.T) {
	track(t)
	before := causes.Now()
	causes.Add(causes.SysMap)
	causes.Add(causes.Wake)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		runtime.LockOSThread() // NB: a thread of its own, never the tracked one
		defer runtime.UnlockOSThread()
		causes.Add(causes.SysMap)
	}()
	wg.Wait()
	d := causes.Now().Sub(before)
	assert.Equal(t, int64(1), d.Of(causes.SysMap))
	assert.Equal(t, int64(1), d.Of(causes.Wake))
	assert.Equal(t, int64(1), d.Syscalls())
}

func TestFaultsOfTheThread(t *testing.T) {
	track(t)
	page := unix.Getpagesize()
	const pages = 16
	b, err := unix.Mmap(-1, 0, pages*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(b)) }()
	before := causes.Now()
	for i := 0; i < len(b); i += page {
		b[i] = 1
	}
	assert.GreaterOrEqual(t, causes.Now().Sub(before).Faults, int64(pages), "a first write takes a fault per page")
}

func TestLockCountsAHeldLock(t *testing.T) {
	track(t)
	var mu sync.Mutex
	before := causes.Now()
	causes.Lock(&mu, causes.WaitAhead) // free: not counted
	mu.Unlock()
	assert.Zero(t, causes.Now().Sub(before).Of(causes.WaitAhead))

	mu.Lock()
	done := make(chan struct{})
	go func() {
		// NB: the held lock is released only once the tracked thread counted it, so
		// the count does not depend on timing.
		for causes.Now().Sub(before).Of(causes.WaitAhead) == 0 {
			runtime.Gosched()
		}
		mu.Unlock()
		close(done)
	}()
	causes.Lock(&mu, causes.WaitAhead)
	mu.Unlock()
	<-done
	assert.Equal(t, int64(1), causes.Now().Sub(before).Of(causes.WaitAhead))
}

func TestKindNames(t *testing.T) {
	seen := map[string]bool{}
	for _, k := range causes.Kinds() {
		assert.NotEqual(t, "unknown", k.String())
		assert.False(t, seen[k.String()], k.String())
		seen[k.String()] = true
	}
}
