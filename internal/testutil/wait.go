package testutil

import (
	"testing"
	"time"

	"github.com/vmarena/vmarena/internal/poll"
)

// Timeout is how long Await and WaitFor wait for their condition: long enough for a
// loaded machine under -race, short enough that a hang fails the test rather than
// the test binary's timeout.
const Timeout = 10 * time.Second

// Await calls cond until it returns true or Timeout has passed, and returns its last
// answer. It polls on the caller's goroutine (first at once, then with a backoff from
// 100 µs to 5 ms), so cond may use the caller's test state; the caller asserts on what
// it waited for, with its own message, when Await returns false.
func Await(cond func() bool) bool { return await(cond, Timeout) }

// await is Await with a time limit of within.
func await(cond func() bool, within time.Duration) bool {
	deadline := time.Now().Add(within)
	b := poll.Backoff{Interval: 100 * time.Microsecond, MaxPolls: 50}
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(b.Next(false))
	}
	return true
}

// WaitFor waits, as Await does, until cond holds, and fails tb at once with "timed
// out waiting for what" when it does not within Timeout.
func WaitFor(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	waitFor(tb, what, cond, Timeout)
}

// waitFor is WaitFor with a time limit of within.
func waitFor(tb testing.TB, what string, cond func() bool, within time.Duration) {
	tb.Helper()
	if !await(cond, within) {
		tb.Fatalf("timed out waiting for %s", what)
	}
}
