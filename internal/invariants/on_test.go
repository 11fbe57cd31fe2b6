//go:build invariants

package invariants_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/invariants"
)

// owner stands for a type that must be closed.
type owner struct {
	leak invariants.Tracker
	_    [64]byte // not a tiny allocation, which the collector may batch
}

//go:noinline
func newOwner(what string) *owner {
	o := &owner{}
	invariants.Track(&o.leak, o, what)
	return o
}

// reportsOf returns the leaks of owners tracked as what, retrying the collection a
// bounded number of times: one collection clears the weak pointer of an owner that
// is unreachable, but a value still in a register may keep it one more.
func reportsOf(what string, want int) []invariants.Leak {
	var got []invariants.Leak
	for range 20 {
		got = append(got, invariants.Leaks(func(l invariants.Leak) bool { return l.What == what })...)
		if len(got) >= want {
			break
		}
	}
	return got
}

// TestLeakReported checks that an owner collected unclosed is reported once, with
// the stack of the code that made it, and that a closed one is not.
func TestLeakReported(t *testing.T) {
	func() {
		_ = newOwner("test.Leaked")
		o := newOwner("test.Closed")
		o.leak.Close()
		o.leak.Close() // a second Close is harmless
	}()
	leaks := reportsOf("test.Leaked", 1)
	require.Len(t, leaks, 1)
	assert.Contains(t, leaks[0].Stack, "invariants_test.newOwner")
	assert.Contains(t, leaks[0].Stack, "invariants_test.TestLeakReported")
	assert.True(t, strings.HasPrefix(leaks[0].String(), "invariants: a test.Leaked was garbage-collected without being closed"), leaks[0].String())
	assert.Empty(t, reportsOf("test.Closed", 1), "a closed owner is not a leak")
	assert.Empty(t, reportsOf("test.Leaked", 1), "a leak is reported once")
}

// TestLiveNotReported checks that an owner still reachable is not reported.
func TestLiveNotReported(t *testing.T) {
	o := newOwner("test.Live")
	assert.Empty(t, reportsOf("test.Live", 1))
	o.leak.Close()
}

func TestEnabled(t *testing.T) { assert.True(t, invariants.Enabled) }
