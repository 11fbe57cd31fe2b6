package testutil

import "testing"

// NoError fails b at once with err when err is not nil. It is require.NoError for a
// benchmark's timed loop: it pays for b.Helper (a lock and a stack walk) only on the
// way to failing, so a call per operation costs a comparison.
func NoError(b *testing.B, err error) {
	if err != nil {
		b.Helper()
		b.Fatal(err)
	}
}
