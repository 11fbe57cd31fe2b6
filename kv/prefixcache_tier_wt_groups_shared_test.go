//go:build linux || windows

package kv_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// Write-through on models of groups, which starts at the insert: what a growth and the
// cap do while an entry's stores run.

// growthPast returns the fewest tokens whose growth of a new sequence of c needs more
// than avail bytes and at most head, or fails the test.
func growthPast(t *testing.T, c *kv.Cache, avail, head int64) int {
	t.Helper()
	q, err := c.NewSequence()
	require.NoError(t, err)
	defer q.Close()
	for n := 1; n <= c.Config().MaxTokens; n++ {
		need, err := q.Need(n)
		require.NoError(t, err)
		if need > avail && need <= head {
			return n
		}
	}
	require.FailNow(t, "no growth needs more than the free budget and fits the headroom")
	return 0
}

// TestPrefixCacheGroupWriteThroughGrowth: on a model of groups an entry's
// write-through runs from its insert on; a growth that needs memory only that entry
// holds waits for the store to end and then evicts it, rather than being refused
// (Headroom said it fits).
func TestPrefixCacheGroupWriteThroughGrowth(t *testing.T) {
	const gran = 64 << 10
	for _, tc := range []struct {
		model kv.Model
		limit int64
	}{{tinyNext, 16 * gran}, {tinyOSS, 256 * gran}} {
		t.Run(tc.model.Name, func(t *testing.T) {
			e := openEnv(t, onShared, withGranule(gran), withLimit(tc.limit), withConfig(kv.Config{Model: tc.model, MaxTokens: 8192}))
			w := &wtGate{ch: make(chan struct{})}
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{gated{tiertest.NewMap(4 << 20), w.ch}}, TierWait: time.Minute, TierWriteThrough: true})
			require.NoError(t, err)
			pc.OnStoringWait(func() { w.waits.Add(1); w.open() })
			e.onFail(func() { w.open(); pc.Close() })
			bt := tierBlock(t, e.c)
			ids := promptIDs(1, 3*bt+1)
			var s *kv.Sequence
			if tc.model.Name == tinyNext.Name {
				s, _ = serveStates(t, pc, ids, bt)
			} else {
				s, _, _, err = serveHybrid(pc, ids)
				require.NoError(t, err)
			}
			require.True(t, s.Close().OK()) // the entry's write-through waits at the gate
			// NB: Headroom counts the cached bytes eviction may give back: not those
			// a live holder pins (the write-through holds the entry's checkpoints so).
			st, head := pc.Stats(), e.c.Headroom()
			k := growthPast(t, e.c, head-(st.CachedBytes-st.PinnedBytes), head)
			q, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, q.Append(k), "served once the write-through ended")
			assert.True(t, w.waited(), "the growth waited for the write-through")
			w.open()
			require.True(t, q.Close().OK())
			require.NoError(t, pc.Close())
			e.books(t, "after the close")
		})
	}
}

// TestPrefixCacheGroupWriteThroughCap: the cap (MaxBytes) can not take an entry while
// its write-through runs, which on a model of groups starts at the insert; once the
// store ended the cache is evicted down to the cap.
func TestPrefixCacheGroupWriteThroughCap(t *testing.T) {
	const gran = 64 << 10
	e := openEnv(t, onShared, withGranule(gran), withLimit(256*gran), withConfig(kv.Config{Model: tinyOSS, MaxTokens: 8192}))
	w := &wtGate{ch: make(chan struct{})}
	pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{gated{tiertest.NewMap(64 << 20), w.ch}}, TierWait: time.Minute, TierWriteThrough: true, MaxBytes: 2 * gran})
	require.NoError(t, err)
	e.onFail(func() { w.open(); pc.Close() })
	bt := tierBlock(t, e.c)
	s, _, _, err := serveHybrid(pc, promptIDs(1, 3*bt+1))
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	assert.Greater(t, pc.Stats().CachedBytes, int64(2*gran), "over the cap while its store runs")
	w.open()
	require.Eventually(t, func() bool { return pc.Stats().CachedBytes <= 2*gran }, time.Minute, time.Millisecond,
		"the cap holds once the store ended")
	require.NoError(t, pc.Close())
	e.books(t, "after the close")
}

// keyGate holds back the stores of one key until open closes.
type keyGate struct {
	*tiertest.Map
	key  tierval.Key
	open chan struct{}
}

func (g keyGate) Store(ctx context.Context, key tierval.Key, size int, fill func([]byte) error) error {
	if key == g.key {
		<-g.open
	}
	return g.Map.Store(ctx, key, size, fill)
}

// TestPrefixCacheTierStatesWriteThroughHeld: a checkpoint that a running
// write-through still copies, which eviction then takes from the entry that displaced
// the one being stored, counts as given back only once that store ended: a growth's
// eviction goes on to what does give memory back, and the growth is served.
func TestPrefixCacheTierStatesWriteThroughHeld(t *testing.T) {
	const gran = 64 << 10
	e := openEnv(t, onShared, withGranule(gran), withLimit(16*gran), withConfig(kv.Config{Model: tinyNext, MaxTokens: 8192}))
	m := tiertest.NewMap(4 << 20)
	bt := tierBlock(t, e.c)
	ids := promptIDs(1, 3*bt+1)
	keys := groupTierKeys(t, e.c, "", ids)
	g := keyGate{m, keys[0], make(chan struct{})}
	pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{g}, TierWait: time.Minute, TierWriteThrough: true})
	require.NoError(t, err)
	var once sync.Once
	open := func() { once.Do(func() { close(g.open) }) }
	e.onFail(func() { open(); pc.Close() })
	s, hit, err := pc.Lookup(ids)
	require.NoError(t, err)
	require.Zero(t, hit)
	require.NoError(t, prefillTo(s, ids, bt, 0))
	require.NoError(t, s.Checkpoint(bt))
	require.NoError(t, pc.Insert(s, ids[:bt])) // E1: its write-through of block 0 waits at the gate
	require.NoError(t, prefillTo(s, ids, 2*bt, 0))
	require.NoError(t, s.Checkpoint(2*bt))
	require.NoError(t, pc.Insert(s, ids[:2*bt])) // E2 displaces E1; its write-through stores block 1
	require.Eventually(t, func() bool { return m.Len() == 1 && pc.Storing() == 1 }, time.Minute, time.Millisecond,
		"E2's write-through ended, E1's waits")
	require.True(t, s.Close().OK())
	st, head := pc.Stats(), e.c.Headroom()
	k := growthPast(t, e.c, head-(st.CachedBytes-st.PinnedBytes), head)
	q, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, q.Append(k), "the cache had more to evict than the shortfall")
	open()
	require.True(t, q.Close().OK())
	require.NoError(t, pc.Close())
	e.books(t, "after the close")
}
