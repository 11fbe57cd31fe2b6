package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// forkInsertPool is what forkThenInsert needs of a pool: the bytes it holds for the
// cache (owned and not idle), and a budget set to exactly what it holds now.
type forkInsertPool struct {
	held  func() int64
	limit func(t *testing.T) // no headroom: a growth must evict
}

// forkThenInsert shares a sequence's granules with a fork (or a frozen prefix) first
// and inserts it (or the fork) only afterwards, closes the inserted one, caches a
// second prompt b and then grows a new sequence by a prompt's worth under a budget
// with no headroom. The inserted prompt a is the least recently used entry, but the
// holder still maps its shared granules: evicting them gives nothing back. The
// growth must not be refused (b's entry gives the memory back), eviction must credit
// only what the pool really got back, and the holder's tokens must be intact.
func forkThenInsert(t *testing.T, c *kv.Cache, pc *kv.PrefixCache, pool forkInsertPool, how string, p int) {
	a, b := promptIDs(0, p), promptIDs(1000, p)
	s, m, err := pc.Lookup(a)
	require.NoError(t, err)
	require.Zero(t, m)
	require.NoError(t, s.Append(p))
	require.NoError(t, writeIDs(s, a, 0, p))
	var h *kv.Sequence // shares s's granules from before the insert
	hn := p
	switch how {
	case "fork", "child":
		h, err = s.Fork()
	case "forkat":
		hn = p / 2
		h, err = s.ForkAt(hn)
	case "freeze":
		pr, ferr := s.Freeze(p)
		require.NoError(t, ferr)
		h, err = c.NewSequenceFrom(pr)
		pr.Release()
	}
	require.NoError(t, err)
	ins, keep := s, h
	if how == "child" {
		ins, keep = h, s // the fork is inserted; the original keeps mapping
	}
	require.NoError(t, pc.Insert(ins, a))
	require.True(t, ins.Close().OK())
	q, _, err := serve(pc, b)
	require.NoError(t, err)
	require.True(t, q.Close().OK())

	pool.limit(t)
	g, err := c.NewSequence()
	require.NoError(t, err)
	ev0, held0 := pc.Stats().EvictedBytes, pool.held()
	err = g.Append(p)
	assert.NoError(t, err, "refused although b's eviction gives back a prompt's granules")
	got := held0 - pool.held() + committedOf(t, c, g)
	assert.Equal(t, got, pc.Stats().EvictedBytes-ev0,
		"eviction credited granules that the holder still maps")
	assert.NoError(t, checkIDs(keep, a, 0, hn), "the holder lost tokens to eviction")
	require.True(t, g.Close().OK())
	require.True(t, keep.Close().OK())
	assert.Equal(t, pc.Stats().CachedBytes, pool.held(), "with no live sequence, the pool holds just the cache")
}

// TestPrefixCacheInsertAfterFork: forkThenInsert on the fake backing, for a fork, a
// fork at a checkpoint, a frozen prefix with a sequence on it, and a fork that is
// inserted while its original lives on.
func TestPrefixCacheInsertAfterFork(t *testing.T) {
	const p = 64
	for _, layout := range layouts {
		for _, how := range []string{"fork", "forkat", "freeze", "child"} {
			t.Run(layout.String()+"/"+how, func(t *testing.T) {
				fx, c, pc := newPrefixCache(t, 1<<30, layout, 256, kv.PrefixCacheOptions{})
				pool := forkInsertPool{
					held: func() int64 { return fx.pool.Stats().Owned },
					limit: func(t *testing.T) {
						require.NoError(t, fx.gov.SetLimit(fx.pool.Device(), fx.pool.Stats().Owned))
					},
				}
				forkThenInsert(t, c, pc, pool, how, p)
			})
		}
	}
}
