package kv_test

import (
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/causes"
	"github.com/vmarena/vmarena/kv"
)

// causesModel: 4 layers whose token takes 16 KiB of K and of V each, so that a
// Blocked block of 16 tokens is one 2 MiB granule (512 pages of 4 KiB: a step that
// wrote into one not made resident would take faults by the dozen).
var causesModel = kv.Uniform("causes", 4, 64, 128, arena.Float16)

const causesGranule = 2 << 20

// openCausesCache returns a cache on host.Shared, with map-ahead or not (ahead), whose
// backing makes new granules resident or not (populate), warmed by a sequence that grew
// through warm blocks, step by step, and closed, so that its granules wait idle in
// the pool; the worker is at rest. Counting (internal/causes) is on before the
// backing is built, so that it counts its system calls.
func openCausesCache(t *testing.T, ahead bool, warm int, populate bool) *env {
	t.Helper()
	causes.Enable()
	e := openEnv(t, onShared, withGranule(causesGranule),
		withConfig(kv.Config{Model: causesModel, MaxTokens: 64 * 16, Layout: kv.Blocked, BlockTokens: 16, MapAhead: ahead}),
		withShared(host.SharedOptions{High: 16, Populate: populate}))
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	for range warm * 16 {
		causesStep(t, s)
	}
	require.True(t, s.Close().OK())
	e.c.WaitAhead()
	return e
}

// causesToken is the bytes a step writes, made once: an allocation of the step's
// own would take the faults of the Go heap's fresh pages.
var causesToken = make([]byte, causesModel.Groups[0].TokenBytes())

// causesPages is the pages a step writes (K and V of every layer), each a fault when
// the step is the first to touch it.
var causesPages = int64(2 * causesModel.Layers * causesModel.Groups[0].TokenBytes() / os.Getpagesize())

// causesStep is a decode step: one token appended and its K and V written in every
// layer.
func causesStep(t *testing.T, s *kv.Sequence) {
	require.NoError(t, s.Append(1))
	n := s.Len()
	tok := causesToken
	for l := range causesModel.Layers {
		require.NoError(t, s.WriteTokens(l, kv.K, n-1, n, tok))
		require.NoError(t, s.WriteTokens(l, kv.V, n-1, n, tok))
	}
}

// TestMapAheadCrossingStepPaysNothing: on a warm cache with map-ahead, a decode step
// that crosses into the block the worker prepared takes no page fault, makes no
// system call of the backing (it adopts the run, whose pages are resident and
// mapped) and allocates nothing, and no step makes a backing call. The worker is let
// finish before each crossing (WaitAhead) and held during it, so nothing depends on
// timing. The row without map-ahead, on a cold backing that does not make new
// granules resident, shows that the counts see what a crossing step pays when it
// commits its block itself: the backing's calls, and a fault per page it is the
// first to touch.
func TestMapAheadCrossingStepPaysNothing(t *testing.T) {
	for _, tt := range []struct {
		name     string
		ahead    bool
		warm     int
		populate bool
		pays     bool // the crossing steps make backing calls and take faults
	}{
		{name: "map-ahead/warm", ahead: true, warm: 6, populate: true},
		{name: "no-map-ahead/cold", pays: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// NB: no collection from the warm-up on: one may shrink the goroutine's
			// stack, which the next deep step grows again into fresh pages, a fault
			// that is the runtime's and comes at a time no test can choose.
			defer debug.SetGCPercent(debug.SetGCPercent(-1))
			e := openCausesCache(t, tt.ahead, tt.warm, tt.populate)
			defer e.finish(t)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			require.NoError(t, causes.Track())
			defer causes.Untrack()

			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			for range 16 { // the prompt's block, not counted
				causesStep(t, s)
			}
			crossings, faults := 0, int64(0)
			allocs := uint64(math.MaxUint64) // the fewest of a crossing step
			for range 5 * 16 {
				crossing := s.Len()%16 == 0
				release := func() {}
				if crossing && tt.ahead {
					e.c.WaitAhead()
					require.Positive(t, e.c.Stats().Ahead, "the worker prepared the next block")
					// NB: and it starts nothing during the step (the run the step asks
					// waits), so that the process's allocations are the step's; the
					// second wait is for what it started before the hold (a filling).
					release = e.c.HoldAhead()
					e.c.WaitAhead()
				}
				var m0, m1 runtime.MemStats
				runtime.ReadMemStats(&m0)
				before := causes.Now()
				causesStep(t, s)
				d := causes.Now().Sub(before)
				runtime.ReadMemStats(&m1)
				release()
				if !crossing {
					assert.Zero(t, d.Syscalls(), "a step at %d tokens made backing calls: %+v", s.Len(), d)
					continue
				}
				crossings++
				at := s.Len() - 1
				if tt.pays {
					assert.Positive(t, d.Syscalls(), "the step that crossed into the block at %d tokens committed it", at)
					assert.Positive(t, d.Faults, "the step that crossed into the block at %d tokens touched its pages first", at)
				} else {
					assert.Zero(t, d.Syscalls(), "the step that crossed into the block at %d tokens made backing calls: %+v", at, d)
					allocs = min(allocs, m1.Mallocs-m0.Mallocs)
					faults += d.Faults
					// Not one page of those the step wrote was faulted in by it.
					assert.Less(t, d.Faults, causesPages, "the step that crossed into the block at %d tokens faulted its pages", at)
				}
			}
			assert.Equal(t, 5, crossings)
			if !tt.pays && !causesRace {
				// NB: none, but for one stray fault in a few thousand runs on a loaded
				// machine whose kernel migrates pages (compaction): a page moved between
				// the worker's commit and the step is faulted back in. A block not made
				// resident costs every crossing step a fault at least (one huge page),
				// and a page each with small pages.
				assert.LessOrEqual(t, faults, int64(1), "the steps that crossed into the blocks the worker prepared took page faults")
			}
			if !tt.pays {
				// NB: the process's allocations: the worker is held and nothing
				// collects, but another goroutine (the runtime's, the backing's) may
				// allocate now and then. A step that allocates does so each time.
				assert.Zero(t, allocs, "every step that crossed allocated")
			}
		})
	}
}
