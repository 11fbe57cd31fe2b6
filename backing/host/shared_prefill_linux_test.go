package host_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/host"
)

// TestSharedPrefillPopulatesInPieces: Prefill, which runs beside the token path
// (kv's map-ahead worker, the Low refill), populates a granule in pieces of at most
// SharedPopulatePiece, so that a commit's move, which needs the process's mmap lock
// for writing, waits for one piece of the populate rather than all of it; every
// byte is still populated, and a commit's own populate (the step's, on the token
// path) stays one call per run.
func TestSharedPrefillPopulatesInPieces(t *testing.T) {
	forModes(t, testSharedPrefillPopulatesInPieces)
}

func testSharedPrefillPopulatesInPieces(t *testing.T, m sharedMode) {
	const g = 2 << 20
	require.Less(t, host.SharedPopulatePiece, g, "a 2 MiB granule takes several pieces")
	e := m.env(t, host.SharedOptions{Granularity: g, High: 4, Populate: true}, true)
	e.f.Reset()
	require.NoError(t, e.s.Prefill(2))
	pops := e.f.Populates()
	total := 0
	for _, n := range pops {
		assert.LessOrEqual(t, n, host.SharedPopulatePiece, "one populate of Prefill")
		total += n
	}
	assert.Equal(t, 2*g, total, "Prefill populated both granules whole: %v", pops)
	assert.Equal(t, int64(2*g), e.pool().Resident)

	// A commit that creates a granule populates it in one call.
	x := e.reserve(3)
	e.f.Reset()
	e.commit(x, 0, 3) // two from the pool, one new
	assert.Equal(t, []int{g}, e.f.Populates(), "the commit populates only its new granule, at once")
	e.decommit(x, 0, 3)
}
