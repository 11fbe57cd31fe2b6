package kv_test

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// aheadEnv is a Blocked cache of oneBlock tokens (16 a granule of blockGranule) on a pooling
// backing, MapAhead on or off, under limit bytes.
type aheadEnv struct {
	c    *kv.Cache
	pool backing.Pool
	gov  *accounting.Governor
	dev  accounting.DeviceKey
}

func openAhead(t *testing.T, name string, ahead bool, limit int64, maxTokens int) aheadEnv {
	t.Helper()
	sp := envSpec{kind: onShared, cfg: kv.Config{Geometry: oneBlock, MaxTokens: maxTokens, Layout: kv.Blocked, BlockTokens: 16, MapAhead: ahead},
		granule: int(blockGranule), limit: limit, cuda: cuda.Options{High: 16},
		shared: host.SharedOptions{High: 16, Populate: true, NoPrivateGranules: name == "host.Shared/NoPrivateGranules"}}
	if name == "cuda" {
		sp.kind = onCUDA
		f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: sp.granule, Memory: 1 << 30})
		t.Cleanup(func() { assert.NoError(t, f.CheckLeaks()) }) // NB: after the env's cleanup, which closes the backing
		drv := f.Driver()
		if ahead {
			// A slow cuMemCreate: the worker's granule is charged long before it
			// lands in the pool, the window in which a step could find the budget
			// short because of it.
			create := drv.MemCreate
			drv.MemCreate = func(handle *uint64, size uintptr, prop *cuda.MemAllocationProp, flags uint64) cuda.Code {
				time.Sleep(time.Millisecond)
				return create(handle, size, prop, flags)
			}
		}
		sp.cuda.Driver = drv
	}
	e, err := openEnv(t, sp)
	if err != nil {
		t.Skipf("%s: %v", name, err)
	}
	return aheadEnv{c: e.c, pool: e.pool, gov: e.gov, dev: e.auth.Device()}
}

var aheadBackings = []string{"host.Shared", "host.Shared/NoPrivateGranules", "cuda"}

// TestMapAheadMakesTheNextGranuleReady: once a sequence is within a few tokens of its
// next block, the granule that block needs waits in the pool, resident, charged and
// shown, and the append that crosses into the block takes it rather than make one.
func TestMapAheadMakesTheNextGranuleReady(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			// Two blocks at most: once the second is committed nothing is asked.
			e := openAhead(t, name, true, 0, 32)
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			require.NoError(t, s.Append(16)) // one block, the next one ahead
			require.Eventually(t, func() bool { return e.pool.PoolStats().Resident >= blockGranule }, 10*time.Second, time.Millisecond,
				"the next block's granule is made ahead")
			st := e.pool.PoolStats()
			assert.Equal(t, e.gov.Stats(e.dev).Used, st.Owned, "the governor shows it")
			assert.Equal(t, 2*blockGranule, st.Owned, "the block's granule and the one ahead")
			require.NoError(t, s.Append(1))
			after := e.pool.PoolStats()
			assert.Equal(t, st.Created, after.Created, "the append made no granule")
			assert.Equal(t, 2*blockGranule, e.c.Stats().Committed)
		})
	}
}

// TestMapAheadRefusesNothingMore: the same random appends, closes and new sequences
// on a cache with map-ahead and on one without, under the same tight budget, succeed
// and are refused alike, whatever the worker is doing meanwhile.
func TestMapAheadRefusesNothingMore(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			limit := 6 * blockGranule
			on, off := openAhead(t, name, true, limit, 256), openAhead(t, name, false, limit, 256)
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
				case len(son) > 0:
					i := r.IntN(len(son))
					n := 1 + r.IntN(12)
					if k == 2 {
						n = 16 + r.IntN(20)
					}
					n = min(n, 256-son[i].Len())
					errOff := soff[i].Append(n)
					errOn := son[i].Append(n)
					require.Equal(t, errOff == nil, errOn == nil, "op %d: append %d: off %v, on %v", op, n, errOff, errOn)
					if errOn != nil {
						require.ErrorIs(t, errOn, accounting.ErrBudgetExceeded)
						refused++
					}
				}
				st := on.pool.PoolStats()
				require.LessOrEqual(t, st.Owned, int64(limit))
			}
			assert.Positive(t, refused, "the budget was tight")
			assert.Equal(t, on.gov.Stats(on.dev).Used, on.pool.PoolStats().Owned, "what map-ahead holds is charged")
		})
	}
}

// TestMapAheadOff: without MapAhead nothing is made ahead.
func TestMapAheadOff(t *testing.T) {
	e := openAhead(t, "cuda", false, 0, 256)
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
	e, err := openEnv(t, envSpec{kind: onPrivate, granule: int(blockGranule), limit: 2 * blockGranule,
		cfg: kv.Config{Geometry: oneBlock, MaxTokens: 64, Layout: kv.Blocked, BlockTokens: 16, MapAhead: true}})
	if err != nil {
		t.Skip(err)
	}
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(32))
	assert.ErrorIs(t, s.Append(1), accounting.ErrBudgetExceeded, "nothing made ahead holds the budget")
	assert.Equal(t, 2*blockGranule, e.gov.Stats(accounting.HostKey).Used)
	assert.True(t, s.Close().OK())
	e.finish(t)
}

// TestMapAheadStepTakesIdleWithoutWaiting: a step whose granules wait idle and
// resident in the pool takes them at once, even while the worker's prefill of the
// last granule under the budget is in flight (the budget tight): that prefill can
// neither take those granules nor make the step short, so the step must not wait
// for it (a populate of 2 MiB on host, a cuMemCreate on CUDA).
func TestMapAheadStepTakesIdleWithoutWaiting(t *testing.T) {
	granule := int(blockGranule)
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: granule, Memory: 1 << 30})
	t.Cleanup(func() { assert.NoError(t, f.CheckLeaks()) }) // NB: after the env's cleanup, which closes the backing
	drv := f.Driver()
	var gate chan struct{} // when set, cuMemCreate waits for it to close
	var gateMu sync.Mutex
	entered := make(chan struct{}, 16)
	create := drv.MemCreate
	drv.MemCreate = func(handle *uint64, size uintptr, prop *cuda.MemAllocationProp, flags uint64) cuda.Code {
		gateMu.Lock()
		g := gate
		gateMu.Unlock()
		if g != nil {
			entered <- struct{}{}
			<-g
		}
		return create(handle, size, prop, flags)
	}
	e, err := openEnv(t, envSpec{kind: onCUDA, granule: granule, limit: 3 * blockGranule, cuda: cuda.Options{Driver: drv, High: 16},
		cfg: kv.Config{Geometry: oneBlock, MaxTokens: 64, Layout: kv.Blocked, BlockTokens: 16, MapAhead: true}})
	require.NoError(t, err)
	c, gov, dev, b := e.c, e.gov, e.auth.Device(), e.pool
	open := true
	release := func() {
		gateMu.Lock()
		if open && gate != nil {
			close(gate)
			open = false
		}
		gateMu.Unlock()
	}
	t.Cleanup(release) // NB: before the env's cleanup closes the cache

	s1, err := c.NewSequence()
	require.NoError(t, err)
	s1Open := true
	t.Cleanup(func() {
		if s1Open {
			release()
			s1.Close()
		}
	})
	require.NoError(t, s1.Append(16)) // one block; its next one is made ahead
	require.Eventually(t, func() bool { return b.PoolStats().Resident >= blockGranule }, 10*time.Second, time.Millisecond)

	gateMu.Lock()
	gate = make(chan struct{})
	gateMu.Unlock()
	s2, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s2.Append(16)) // takes the granule made ahead; both now ask
	select {
	case <-entered: // the worker's prefill of the third granule is in flight, charged
	case <-time.After(10 * time.Second):
		t.Fatal("the worker did not start a prefill")
	}
	require.Equal(t, int64(0), gov.Available(dev), "the budget is tight: the granule in flight holds the rest")
	require.True(t, s2.Close().OK()) // its granule goes idle, resident
	require.GreaterOrEqual(t, b.PoolStats().Resident, blockGranule)

	done := make(chan error, 1)
	go func() { done <- s1.Append(1) }() // crosses into its second block
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		release()
		<-done
		t.Fatal("the step waited for a prefill it did not need")
	}
	assert.Equal(t, 2*blockGranule, c.Stats().Committed, "its two blocks")
	release()
	s1Open = false
	require.True(t, s1.Close().OK())
}
