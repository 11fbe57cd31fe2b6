package lowprio

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestLower: the thread that calls Lower runs at nice 19 from then on, and the
// process's other threads (the test's) keep theirs.
func TestLower(t *testing.T) {
	before, err := unix.Getpriority(unix.PRIO_PROCESS, unix.Gettid())
	require.NoError(t, err)
	type result struct {
		ok   bool
		nice int
		err  error
	}
	done := make(chan result)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		ok := Lower()
		// NB: getpriority's raw value is 20 - nice.
		p, err := unix.Getpriority(unix.PRIO_PROCESS, unix.Gettid())
		done <- result{ok, 20 - p, err}
	}()
	r := <-done
	require.NoError(t, r.err)
	assert.True(t, r.ok)
	assert.Equal(t, 19, r.nice)
	after, err := unix.Getpriority(unix.PRIO_PROCESS, unix.Gettid())
	require.NoError(t, err)
	assert.Equal(t, before, after, "the test's thread keeps its priority")
}
