package kv_test

import (
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestWaitAheadWaitsForTheWorkersOwnLook: a window group leaves its granules behind
// with no kick (ahead_behind.go), and a parked worker's own next look gives them
// back, then commits or fills for the pool: WaitAhead, asked meanwhile, waits until
// that look ends, never between two of its pieces of work, where the next would
// charge the governor while the test reads the pool (a granule the fill charged
// before the pool shows it). Each step that leaves a unit behind here waits for the
// worker's own look (kicked as its poll would wake it) to give it back before it
// asks WaitAhead, and at every piece of work of every look WaitAhead would still
// wait; the governor and the pool agree after each.
func TestWaitAheadWaitsForTheWorkersOwnLook(t *testing.T) {
	m := kv.GPTOSS20B()
	const granule = 64 << 10
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(granule), withConfig(kv.Config{Model: m, MaxTokens: 512, Layout: kv.PerLayer, MapAhead: true}), aheadBacking(t, name))
			var looks, early atomic.Int64
			e.c.OnAheadLook(func(rest bool) {
				looks.Add(1)
				if rest {
					early.Add(1)
				}
			})
			full, err := e.c.LayerStrides(1)
			require.NoError(t, err)
			unit := granule / full.TokenStride
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			own := 0
			for n := 0; n < 5*unit; n++ {
				e.c.WaitAhead()
				held := s.FirstHeld(0)
				require.NoError(t, s.Append(1))
				if s.FirstHeld(0) > held {
					// NB: no WaitAhead yet: it would hand the record to a look it
					// starts itself. The worker's own look takes it.
					e.c.KickAhead()
					for e.c.LeftBehind() > 0 {
						runtime.Gosched()
						e.c.KickAhead()
					}
					own++
				}
				e.c.WaitAhead()
				st := e.c.Stats()
				ps := e.pool.PoolStats()
				require.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned, "token %d: the governor", n)
				require.Equal(t, ps.Owned, st.Committed+st.Ahead+ps.Idle, "token %d: every granule is the sequence's, ahead or idle", n)
			}
			require.Positive(t, own, "the window gave back units")
			require.Positive(t, looks.Load())
			require.Zero(t, early.Load(), "of %d pieces of work, WaitAhead would have returned between two", looks.Load())
			require.True(t, s.Close().OK())
			e.finish(t)
		})
	}
}
