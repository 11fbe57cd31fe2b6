//go:build race

package kv_test

// causesRace: the race detector's runtime maps and touches memory of its own (its
// shadow and its clocks of the locks a step takes) on demand, on the thread that
// calls it, so a step under it may take faults that are not the step's.
const causesRace = true
