package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/kv/baseline"
)

// checkOwnedOnce checks, at a moment of the replay, that the shared prefix is owned
// once: every live sequence maps its whole granules, and the pool's live granules are
// exactly the sequences' own plus the prefix's.
func checkOwnedOnce(t *testing.T, st baseline.Strategy) {
	cs, ok := st.(*cacheStrategy)
	require.True(t, ok, "%T", st)
	ks := cs.kvStats()
	ps := cs.pool.PoolStats()
	row := testModel.BytesPerToken()
	sharedPerSeq := int64(testSystem * row / testGranule * testGranule)
	prefixOwn := int64(backing.Granules(testSystem*row, testGranule) * testGranule)
	require.Positive(t, sharedPerSeq, "the test prefix spans whole granules")
	assert.Equal(t, int64(ks.Sequences)*sharedPerSeq, ks.Shared, "each sequence maps the prefix's whole granules")
	assert.Equal(t, ks.Committed-ks.Shared+prefixOwn, ps.Owned-ps.Idle, "live granules: the sequences' own and the prefix's, once")
	assert.Equal(t, ks.Committed+prefixOwn, ps.Mapped, "mapped: every sequence's range and the prefix's")
}

// TestReplayInvariants replays a slice of the bundled trace against every strategy
// with no budget and checks what must hold whatever the timing.
func TestReplayInvariants(t *testing.T) {
	w := testWorkload(t, 40)
	s := testSetup(0)
	results := map[string]Result{}
	for _, name := range allStrategies {
		var watch func(baseline.Strategy, Sample)
		if name == nameCache {
			watch = func(st baseline.Strategy, _ Sample) { checkOwnedOnce(t, st) }
		}
		r, err := replayOne(context.Background(), name, s, w, nopProgress{}, watch)
		require.NoError(t, err, name)
		checkEnd(t, r)
		assert.Positive(t, r.Steps, name)
		assert.NotEmpty(t, r.Samples, name)
		results[name] = r
	}
	cache, eager := results[nameCache], results[nameEager]
	assert.LessOrEqual(t, cache.PeakPhysical, eager.PeakPhysical, "the cache's peak is at most eager preallocation's")
	// Sharing: the cache maps the prefix's whole granules; eager and append copy it.
	assert.Positive(t, cache.MaxSaved)
	assert.Positive(t, results[namePaged].MaxSaved)
	assert.Zero(t, eager.MaxSaved)
	assert.Zero(t, results[nameAppend].MaxSaved)
	// With no budget memory refuses nobody, and every strategy serves the same
	// schedule (requests wait only for a place in the batch).
	for name, r := range results {
		assert.Zero(t, r.MemoryRefused, name)
		assert.Zero(t, r.Preempted, name)
		assert.Equal(t, cache.Waited, r.Waited, name)
		assert.Equal(t, cache.WaitMax, r.WaitMax, name)
		assert.Equal(t, cache.Makespan, r.Makespan, name)
		assert.Equal(t, cache.PeakNeeded, r.PeakNeeded, name)
	}
	// The cache holds little beyond the need: whole granules, one partly filled per
	// sequence and the pool's idle ones.
	for _, smp := range cache.Samples {
		require.GreaterOrEqual(t, smp.Physical, smp.Needed)
	}
}
