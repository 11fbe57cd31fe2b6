package host_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/host"
)

// TestSharedDecay checks retention by decay on a model clock: a busy pool keeps its
// idle granules while they are reused; once the load stops, idle granules leave
// gradually (a few at first, about half by Decay/2) and the pool is down to its
// floor (Low) within 10 s.
func TestSharedDecay(t *testing.T) { forModes(t, testSharedDecay) }

func testSharedDecay(t *testing.T, m sharedMode) {
	for _, tt := range []struct {
		name string
		opts host.SharedOptions
	}{
		{"default", host.SharedOptions{Granularity: kib64, High: 64, Low: 2}},
		{"decay=2s", host.SharedOptions{Granularity: kib64, High: 64, Decay: 2 * time.Second}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			const n = 32
			e := m.env(t, tt.opts, false)
			decay := tt.opts.Decay
			if decay == 0 {
				decay = 5 * time.Second
			}
			g := int64(e.g)
			rs := make([]*host.SharedReservation, n)
			for i := range rs {
				rs[i] = e.reserve(1)
			}
			// Busy: every granule is reused every 100 ms for 10 s of model time.
			for range 100 {
				for _, r := range rs {
					e.commit(r, 0, 1)
				}
				for _, r := range rs {
					e.decommit(r, 0, 1)
				}
				host.SharedWaitRefill(e.s) // Low's refill, if it started
				e.advance(100 * time.Millisecond)
				host.SharedDecay(e.s)
				require.GreaterOrEqual(t, e.pool().Idle, n*g, "a busy pool keeps its working set")
			}
			// The load stops.
			idle := []int64{e.pool().Idle}
			for step := 1; step <= 20; step++ {
				e.advance(500 * time.Millisecond)
				host.SharedDecay(e.s)
				idle = append(idle, e.pool().Idle)
				require.NoError(t, host.CheckShared(e.s))
			}
			t.Logf("idle MiB every 500 ms after the load stops: %v", mib(idle))
			floor := int64(tt.opts.Low) * g
			for i := 1; i < len(idle); i++ {
				assert.LessOrEqual(t, idle[i], idle[i-1], "idle never grows without load")
				assert.GreaterOrEqual(t, idle[i], floor, "never below the floor")
			}
			assert.Greater(t, idle[1], n*g/2, "gradual: most granules stay through a short pause")
			half := int(decay / 2 / (500 * time.Millisecond))
			assert.Less(t, idle[half], n*g, "some granules left by Decay/2")
			assert.Greater(t, idle[half], floor, "but not all of them")
			assert.Equal(t, floor, idle[int(decay/(500*time.Millisecond))], "at the floor by Decay")
			assert.Equal(t, floor, idle[20], "at the floor within 10 s")
			assert.Equal(t, floor, e.pool().Owned, "the rest went back to the OS")
			assert.Equal(t, floor, e.auth.Stats().Owned)
		})
	}
}

// TestSharedNoDecay: with decay off idle granules stay up to High however long they
// wait.
func TestSharedNoDecay(t *testing.T) { forModes(t, testSharedNoDecay) }

func testSharedNoDecay(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64, High: 8, Decay: host.SharedNoDecay}, false)
	r := e.reserve(4)
	e.commit(r, 0, 4)
	e.decommit(r, 0, 4)
	e.advance(time.Hour)
	assert.False(t, host.SharedDecay(e.s))
	assert.Equal(t, int64(4*e.g), e.pool().Idle)
}

func mib(v []int64) []int64 {
	out := make([]int64, len(v))
	for i, x := range v {
		out[i] = x >> 20
	}
	return out
}

// TestSharedDecayWallStep: idle time is measured on the monotonic clock, so a step
// of the wall clock (an hour forward, a day back) changes no granule's age: idle
// granules neither leave at once nor stay for good. The clock's readings carry a
// monotonic reading, as time.Now's do; host.WallStep moves only their wall reading.
func TestSharedDecayWallStep(t *testing.T) { forModes(t, testSharedDecayWallStep) }

func testSharedDecayWallStep(t *testing.T, m sharedMode) {
	for _, step := range []time.Duration{time.Hour, -24 * time.Hour} {
		t.Run(step.String(), func(t *testing.T) {
			e := m.env(t, host.SharedOptions{Granularity: kib64, High: 8}, false)
			e.mu.Lock()
			e.clock = time.Now() // with a monotonic reading
			e.mu.Unlock()
			host.SetSharedClock(e.s, e.now)
			g := int64(e.g)
			r := e.reserve(4)
			e.commit(r, 0, 4)
			e.decommit(r, 0, 4)
			require.Equal(t, 4*g, e.pool().Idle)

			// The wall clock steps; 100 ms pass on the monotonic clock.
			e.mu.Lock()
			stepped, err := host.WallStep(e.clock.Add(100*time.Millisecond), step)
			e.clock = stepped
			e.mu.Unlock()
			require.NoError(t, err)
			host.SharedDecay(e.s)
			assert.Equal(t, 4*g, e.pool().Idle, "100 ms idle: nothing leaves, whatever the wall clock says")

			// Decay (5 s) passes on the monotonic clock: everything leaves.
			e.advance(5 * time.Second)
			host.SharedDecay(e.s)
			assert.Zero(t, e.pool().Idle, "idle for Decay: all given back, whatever the wall clock says")
			assert.Zero(t, e.auth.Stats().Owned)
		})
	}
}
