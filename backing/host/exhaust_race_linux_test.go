//go:build race

package host_test

// raceEnabled: the race detector's runtime maps memory of its own on demand, and
// aborts the process when it can not.
const raceEnabled = true
