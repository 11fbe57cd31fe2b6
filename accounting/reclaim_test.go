package accounting_test

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
)

// ReclaimOthers calls the reclaimer of every other ledger of the device with the
// need, and returns when they have all returned; not the asker's own, not another
// device's, not a closed ledger's; and it takes and queues nothing.
func TestReclaimOthers(t *testing.T) {
	g := accounting.NewGovernor()
	require.NoError(t, g.SetLimit(accounting.HostKey, 100))
	asker := g.Authority("asker", accounting.HostKey)
	var calls, own, other, sum atomic.Int64
	pool := g.Authority("pool", accounting.HostKey)
	require.NoError(t, pool.TryAcquire(30))
	pool.SetReclaimer(func(need int64) {
		calls.Add(1)
		sum.Add(need)
		pool.Release(10) // gives back memory before it returns
	})
	cache := g.Authority("cache", accounting.HostKey)
	cache.SetReclaimer(func(need int64) { calls.Add(1); sum.Add(need) })
	asker.SetReclaimer(func(int64) { own.Add(1) })
	gpu := g.Authority("gpu", accounting.GPU(0))
	gpu.SetReclaimer(func(int64) { other.Add(1) })
	closed := g.Authority("closed", accounting.HostKey)
	closed.SetReclaimer(func(int64) { other.Add(1) })
	require.NoError(t, closed.Close())

	for _, tc := range []struct {
		need  int64
		calls int
	}{{need: 0, calls: 0}, {need: 7, calls: 2}, {need: 9, calls: 2}} {
		before := calls.Load()
		got := asker.ReclaimOthers(tc.need)
		if tc.need == 0 {
			assert.Zero(t, got, "a need of 0 calls nobody")
			continue
		}
		assert.Equal(t, tc.calls, got, "reclaimers called for %d bytes", tc.need)
		assert.Equal(t, int64(tc.calls), calls.Load()-before, "every one has returned")
	}
	assert.Equal(t, int64(2*7+2*9), sum.Load(), "each got the need")
	assert.Zero(t, own.Load(), "not the asker's own reclaimer")
	assert.Zero(t, other.Load(), "not another device's or a closed ledger's")
	s := g.Stats(accounting.HostKey)
	assert.Equal(t, int64(10), s.Used, "the pool gave 20 bytes back; nothing was taken")
	assert.Zero(t, s.Waiters, "nothing was queued")
	assert.Panics(t, func() { asker.ReclaimOthers(-1) })
	assert.PanicsWithValue(t, accounting.PanicAuthorityClosed, func() { closed.ReclaimOthers(1) })
}
