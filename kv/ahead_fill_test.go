package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMapAheadFillsThePool: once a growing sequence's run is mapped and the budget has
// room, the worker makes the granule of the run after it resident and idle in the pool,
// so that committing that run (on the worker, or on the step where the worker fell
// behind) makes no granule; the step that crosses still makes no backing call.
func TestMapAheadFillsThePool(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(256, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			require.NoError(t, s.Append(16))
			e.mappedAhead(t, blockGranule)
			ps := e.pool.PoolStats()
			assert.Equal(t, blockGranule, ps.Resident, "the next run's granule, resident and idle")
			assert.Equal(t, blockGranule, ps.Idle)
			assert.Equal(t, 3*blockGranule, ps.Owned, "the block, its run ahead and the granule for the next")
			assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned, "charged")
			assert.Equal(t, blockGranule, e.c.Stats().Ahead, "Ahead counts the mapped run only: the pool shows the rest")

			calls := e.faults.Calls()
			require.NoError(t, s.Append(1)) // crosses: adopts, asks the third block
			assert.Equal(t, calls, e.faults.Calls(), "the crossing step made no backing call")
			created := ps.Created
			e.mappedAhead(t, blockGranule)
			ps = e.pool.PoolStats()
			assert.Equal(t, created+1, ps.Created, "the third block took the idle granule; one more was made for the fourth")
			assert.Equal(t, blockGranule, ps.Resident)
			assert.Equal(t, 4*blockGranule, ps.Owned)
		})
	}
}

// TestMapAheadFillsWithinRoom: the pool is filled ahead only while the budget has
// room (a limit of 16 granules leaves none for it), and not for a sequence whose run
// ahead reaches MaxTokens (no run follows it).
func TestMapAheadFillsWithinRoom(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			for _, tt := range []struct {
				name             string
				limit            int64
				maxTokens, start int
			}{
				{"tight budget", 16 * blockGranule, 256, 16},
				{"last run", 0, 32, 16},
			} {
				e := openEnv(t, withGranule(int(blockGranule)), withLimit(tt.limit), withConfig(oneBlockConfig(tt.maxTokens, true)), aheadBacking(t, name))
				s, err := e.c.NewSequence()
				require.NoError(t, err)
				require.NoError(t, s.Append(tt.start))
				e.mappedAhead(t, blockGranule)
				assert.Zero(t, e.pool.PoolStats().Idle, "%s: nothing filled", tt.name)
				assert.Equal(t, 2*blockGranule, e.pool.PoolStats().Owned, tt.name)
				assert.True(t, s.Close().OK())
			}
		})
	}
}
