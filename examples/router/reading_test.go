package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestReadingLine compares routing by prefix with round-robin and with one cache, from
// the run's own hit rates, and says nothing without all three.
func TestReadingLine(t *testing.T) {
	run := func(mode string, hits int64) runResult {
		return runResult{mode: mode, simResult: simResult{Queries: 1000, Hits: hits}}
	}
	rs := []runResult{run(modePrefix, 262), run(modeRoundRobin, 115), run(modeSingle, 260)}
	assert.Equal(t, "routing by the replicas' KV events found 26.2% of prompt tokens cached, round-robin 11.5%, one cache holding all the budgets 26.0% (what the replicas would find were they one): by prefix should come near the one cache and above round-robin", readingLine(rs))
	assert.Empty(t, readingLine(rs[:2]))
	little := []runResult{run(modePrefix, 38), run(modeRoundRobin, 38), run(modeSingle, 40)}
	assert.Contains(t, readingLine(little), "these requests share too little for routing to matter")
}
