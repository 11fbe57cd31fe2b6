package kv_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// oneBlockConfig is a Blocked cache of maxTokens oneBlock tokens, 16 a granule of
// blockGranule, with MapAhead on or off.
func oneBlockConfig(maxTokens int, ahead bool) kv.Config {
	return kv.Config{Model: oneBlock, MaxTokens: maxTokens, Layout: kv.Blocked, BlockTokens: 16, MapAhead: ahead}
}

// aheadBacking is the envOption of a map-ahead test's backing (one of
// aheadBackings), a pool of up to 16 idle granules behind a backingtest.Faulty
// (env.faults). It reads the granule and Config.MapAhead set so far, so it MUST
// come after withGranule and withConfig.
func aheadBacking(t *testing.T, name string) envOption {
	return envFunc(func(sp *envSpec) {
		sp.kind, sp.faulty = onShared, true
		sp.shared = host.SharedOptions{High: 16, Populate: true, NoPrivateGranules: name == "host.Shared/NoPrivateGranules"}
		if name != "cuda" {
			return
		}
		sp.kind = onCUDA
		f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: sp.granule, Memory: 1 << 30})
		t.Cleanup(func() { assert.NoError(t, f.CheckLeaks()) }) // NB: after the env's cleanup, which closes the backing
		drv := f.Driver()
		if sp.cfg.MapAhead {
			// A slow cuMemCreate: the worker's granule is charged long before it
			// lands in the pool, the window in which a step could find the budget
			// short because of it.
			create := drv.MemCreate
			drv.MemCreate = func(handle *uint64, size uintptr, prop *cuda.MemAllocationProp, flags uint64) cuda.Code {
				time.Sleep(time.Millisecond)
				return create(handle, size, prop, flags)
			}
		}
		sp.cuda = cuda.Options{High: 16, Driver: drv}
	})
}

var aheadBackings = []string{"host.Shared", "host.Shared/NoPrivateGranules", "cuda"}

// TestMapAheadRefusesNothingMore: the same random appends, truncations, forks, closes
// and new sequences on a cache with map-ahead and on one without, under the same
// tight budget, succeed and are refused alike, whatever the worker is doing meanwhile
// (a fork, which does not hold the worker off, waits for it to rest first: see
// ahead.go), and after each the two hold the same memory in their sequences: the
// ledger is exact, map-ahead's runs aside. With the worker held off throughout
// ("held"), what windows leave behind stays with the cache until a growth that the
// budget would refuse has it back (drainBehind): the same ops are refused alike, and
// once the worker goes on the ledger is exact again.
func TestMapAheadRefusesNothingMore(t *testing.T) {
	caches := []struct {
		name  string
		cfg   kv.Config
		limit int64
	}{
		{"one-block", kv.Config{Model: oneBlock, MaxTokens: 256, Layout: kv.Blocked, BlockTokens: 16}, 6 * blockGranule},
		// NB: a window group's Truncate and ForkAt may be refused with ErrDropped.
		{"hybrid", kv.Config{Model: aheadHybrid, MaxTokens: 256, Layout: kv.Blocked}, 20 * blockGranule},
	}
	for _, name := range aheadBackings {
		for _, cc := range caches {
			t.Run(name+"/"+cc.name, func(t *testing.T) { refusesNothingMore(t, name, cc.cfg, cc.limit, false) })
		}
		t.Run(name+"/hybrid/held", func(t *testing.T) { refusesNothingMore(t, name, caches[1].cfg, caches[1].limit, true) })
	}
}

// refusesNothingMore is TestMapAheadRefusesNothingMore on caches of cfg on backing
// name under limit bytes, with the worker held off throughout where held is set.
func refusesNothingMore(t *testing.T, name string, cfg kv.Config, limit int64, held bool) {
	cfg.MapAhead = true
	on := openEnv(t, withGranule(int(blockGranule)), withLimit(limit), withConfig(cfg), aheadBacking(t, name))
	cfg.MapAhead = false
	off := openEnv(t, withGranule(int(blockGranule)), withLimit(limit), withConfig(cfg), aheadBacking(t, name))
	release := func() {}
	if held {
		var once sync.Once
		hold := on.c.HoldAhead()
		release = func() { once.Do(hold) }
		defer release() // NB: a run that fails midway lets the worker go too
	}
	rest := func() { // NB: the worker at rest, where it is not held off
		if !held {
			on.c.WaitAhead()
		}
	}
	left := false // held: the cache held what a window left behind once
	var son, soff []*kv.Sequence
	defer func() {
		for i := range son {
			assert.True(t, son[i].Close().OK())
			assert.True(t, soff[i].Close().OK())
		}
	}()
	r := rand.New(rand.NewPCG(23, uint64(len(name))))
	refused := 0
	for op := range 400 {
		switch k := r.IntN(10); {
		case k == 0 && len(son) < 4:
			a, err := on.c.NewSequence()
			require.NoError(t, err)
			b, err := off.c.NewSequence()
			require.NoError(t, err)
			son, soff = append(son, a), append(soff, b)
		case k == 1 && len(son) > 0:
			i := r.IntN(len(son))
			require.True(t, son[i].Close().OK())
			require.True(t, soff[i].Close().OK())
			son, soff = append(son[:i], son[i+1:]...), append(soff[:i], soff[i+1:]...)
		case k == 3 && len(son) > 0:
			i := r.IntN(len(son))
			n := r.IntN(son[i].Len() + 1)
			// NB: a truncation into a granule shared with a fork needs one of
			// its own, which the budget may refuse.
			errOff, errOn := soff[i].Truncate(n), son[i].Truncate(n)
			sameRefusal(t, errOff, errOn, "op %d: truncate to %d", op, n)
			require.Equal(t, soff[i].Len(), son[i].Len())
		case k == 4 && len(son) > 0 && len(son) < 4:
			i := r.IntN(len(son))
			n := r.IntN(son[i].Len() + 1)
			rest()
			fOff, errOff := soff[i].ForkAt(n)
			fOn, errOn := son[i].ForkAt(n)
			sameRefusal(t, errOff, errOn, "op %d: fork at %d", op, n)
			if errOn != nil {
				if errors.Is(errOn, accounting.ErrBudgetExceeded) {
					refused++
				}
				break
			}
			son, soff = append(son, fOn), append(soff, fOff)
		case len(son) > 0:
			i := r.IntN(len(son))
			n := 1 + r.IntN(12)
			if k == 2 {
				n = 16 + r.IntN(20)
			}
			n = min(n, 256-son[i].Len())
			errOff := soff[i].Append(n)
			errOn := son[i].Append(n)
			sameRefusal(t, errOff, errOn, "op %d: append %d", op, n)
			if errOn != nil {
				refused++
			}
		}
		st := on.pool.PoolStats()
		require.LessOrEqual(t, st.Owned, int64(limit))
		rest()
		stOn, stOff := on.c.Stats(), off.c.Stats()
		pOn, pOff := on.pool.PoolStats(), off.pool.PoolStats()
		require.Equal(t, stOff.Committed, stOn.Committed, "op %d", op)
		require.Equal(t, on.gov.Stats(on.auth.Device()).Used, pOn.Owned, "op %d: what map-ahead holds is charged", op)
		if held {
			// NB: a granule left behind that mapped a closed parent's is the
			// cache's until given back, and no figure of Stats shows it.
			left = left || stOn.Ahead > 0
			continue
		}
		require.Equal(t, pOff.Owned-pOff.Idle, pOn.Owned-pOn.Idle-stOn.Ahead, "op %d: the sequences hold the same memory", op)
	}
	release()
	on.c.WaitAhead()
	stOn := on.c.Stats()
	pOn, pOff := on.pool.PoolStats(), off.pool.PoolStats()
	require.Equal(t, pOff.Owned-pOff.Idle, pOn.Owned-pOn.Idle-stOn.Ahead, "at rest: the sequences hold the same memory")
	if held {
		assert.True(t, left, "windows left granules behind")
	}
	assert.Positive(t, refused, "the budget was tight")
	assert.Equal(t, on.gov.Stats(on.auth.Device()).Used, on.pool.PoolStats().Owned, "what map-ahead holds is charged")
}

// sameRefusal checks that an operation with map-ahead (errOn) and the same without
// (errOff) both succeeded, or were both refused alike: for budget, or for a token a
// window group gave back (ErrDropped).
func sameRefusal(t *testing.T, errOff, errOn error, format string, args ...any) {
	t.Helper()
	what := fmt.Sprintf(format, args...)
	require.Equal(t, errOff == nil, errOn == nil, "%s: off %v, on %v", what, errOff, errOn)
	if errOn == nil {
		return
	}
	dropped := errors.Is(errOff, kv.ErrDropped)
	require.Equal(t, dropped, errors.Is(errOn, kv.ErrDropped), "%s: off %v, on %v", what, errOff, errOn)
	if !dropped {
		require.ErrorIs(t, errOff, accounting.ErrBudgetExceeded, what)
		require.ErrorIs(t, errOn, accounting.ErrBudgetExceeded, what)
	}
}

// TestMapAheadOff: without MapAhead nothing is made ahead.
func TestMapAheadOff(t *testing.T) {
	e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(256, false)), aheadBacking(t, "cuda"))
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(16))
	time.Sleep(20 * time.Millisecond)
	assert.Zero(t, e.pool.PoolStats().Idle)
	assert.True(t, s.Close().OK())
}

// TestMapAheadWithoutPool: on a backing without a pool MapAhead is ignored: the
// cache grows as without it and starts no goroutine (TestMain's leak check).
func TestMapAheadWithoutPool(t *testing.T) {
	e := openEnv(t, onPrivate, withGranule(int(blockGranule)), withLimit(2*blockGranule), withConfig(oneBlockConfig(64, true)))
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(32))
	assert.ErrorIs(t, s.Append(1), accounting.ErrBudgetExceeded, "nothing made ahead holds the budget")
	assert.Equal(t, 2*blockGranule, e.gov.Stats(accounting.HostKey).Used)
	assert.True(t, s.Close().OK())
	e.finish(t)
}
