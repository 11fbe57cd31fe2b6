//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// TestPrefixCacheTierLoadFits: a lookup whose run in a tier is longer than the
// device's budget can take loads the longest start of it that fits, evicting a cached
// entry first where there is one (as any growth does), and counts the blocks left in
// the tier as unfit; the tier below is not asked for them. Every loaded token reads
// back as written, and the ledgers of the device and of the host tier are exact
// before and after.
func TestPrefixCacheTierLoadFits(t *testing.T) {
	const gran = 64 << 10
	for _, kind := range []backingKind{onShared, onCUDA} {
		for _, cached := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/cached=%v", backingNames[kind], cached), func(t *testing.T) {
				// Five granules: the prompt (four blocks and a tail) fits alone.
				e := openEnv(t, kind, withGranule(gran), withLimit(5*gran), withConfig(kv.Config{MaxTokens: 512, Layout: kv.Blocked, BlockTokens: 1}))
				c := e.c
				tpb, blk := blockTokens(t, c)
				require.Equal(t, gran, blk, "a block is one granule")
				hostAuth := accounting.NewGovernor().Authority("host tier", accounting.DeviceKey{Tier: accounting.HostTier})
				ht, err := hosttier.New(hosttier.Options{Budget: 16 << 20, Authority: hostAuth})
				require.NoError(t, err)
				below := tiertest.NewMap(4 << 20)
				pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{ht, below}, TierPrefix: t.Name(), TierWait: time.Minute})
				require.NoError(t, err)
				e.onFail(func() { pc.Close(); ht.Close() })

				ids := promptIDs(31, 4*tpb+1)
				evictAll(t, pc, ids)
				require.Equal(t, 4, ht.Stats().Values)
				// A live sequence holds two granules; with cached, an entry of two
				// granules (one block and a tail) holds two more, which the lookup's
				// growth may take back.
				hog, err := c.NewSequence()
				require.NoError(t, err)
				require.NoError(t, hog.Append(2*tpb))
				free := int64(3 * gran)
				if cached {
					s, _, err := serve(pc, promptIDs(9000, tpb+1))
					require.NoError(t, err)
					require.True(t, s.Close().OK())
					require.EqualValues(t, 2*gran, pc.Stats().CachedBytes)
					free = gran
				}
				require.EqualValues(t, free, e.gov.Available(c.Device())+idleOf(e), "the set-up's budget: free or idle in the pool")
				before := pc.Stats()

				q, m, err := pc.Lookup(ids)
				require.NoError(t, err)
				assert.Equal(t, 3*tpb, m, "the three blocks the budget holds, not none")
				assert.Equal(t, m, q.Len())
				require.NoError(t, checkIDs(q, ids, 0, m))
				st := pc.Stats()
				assert.EqualValues(t, 3*tpb, st.Tiers[0].Hits-before.Tiers[0].Hits)
				assert.EqualValues(t, 1, st.Tiers[0].Unfit-before.Tiers[0].Unfit, "the fourth block stayed in the tier")
				assert.Equal(t, before.Tiers[0].Drops, st.Tiers[0].Drops, "nothing failed")
				assert.Equal(t, before.Tiers[1].Misses, st.Tiers[1].Misses, "the tier below was not asked")
				assert.EqualValues(t, 3*tpb, st.Hits-before.Hits)
				assert.Zero(t, st.CachedBytes, "the cached entry made room")
				assert.Zero(t, c.Stats().Refusals, "sized to the budget, never refused")
				// The device's books: what the sequences commit and the pool keeps idle
				// is what the ledger and the governor hold, all of the budget.
				e.books(t, "after the partial load")
				assert.Equal(t, committedOf(t, c, hog)+committedOf(t, c, q)+idleOf(e), e.auth.Stats().Owned)
				assert.Zero(t, e.gov.Available(c.Device())+idleOf(e), "the load took the budget's last granule")
				// The host tier's: it lent its values and holds what it held.
				assert.Equal(t, ht.Stats().Held, hostAuth.Stats().Owned)

				// With the live sequence gone the sequence goes on as after a hit.
				require.True(t, hog.Close().OK())
				require.NoError(t, q.Append(len(ids)-m))
				require.NoError(t, writeIDs(q, ids, m, len(ids)))
				require.NoError(t, checkIDs(q, ids, 0, len(ids)))
				require.True(t, q.Close().OK())
				require.NoError(t, pc.Close())
				require.NoError(t, ht.Close())
				assert.Zero(t, hostAuth.Stats().Owned, "the host tier's ledger: owned bytes left")
				assert.Zero(t, hostAuth.Stats().Mapped, "the host tier's ledger: mappings left")
				e.finish(t)
			})
		}
	}
}

// idleOf returns the bytes e's pool holds idle (0 without a pool).
func idleOf(e *env) int64 {
	if e.pool == nil {
		return 0
	}
	e.quiet()
	return e.pool.PoolStats().Idle
}

// wtGate is the gate of writeThroughCache's tier: its stores wait until open is
// called (once or more), which a growth of the cache does as it starts to wait for a
// write-through (PrefixCache.OnStoringWait).
type wtGate struct {
	ch    chan struct{}
	once  sync.Once
	waits atomic.Int32
}

func (w *wtGate) open() { w.once.Do(func() { close(w.ch) }) }

// waited reports whether a growth waited for a write-through: a gate on a timer would
// let a growth that asks only after the store ended pass where it would have been
// refused.
func (w *wtGate) waited() bool { return w.waits.Load() > 0 }

// writeThroughCache opens a Blocked cache of four granules on kind with a
// write-through PrefixCache over one gated tier, whose stores wait at the gate w (a
// failure opens it before closing the cache).
func writeThroughCache(t *testing.T, kind backingKind, gran int) (e *env, g gated, pc *kv.PrefixCache, w *wtGate) {
	t.Helper()
	e = openEnv(t, kind, withGranule(gran), withLimit(4*int64(gran)), withConfig(kv.Config{MaxTokens: 512, Layout: kv.Blocked, BlockTokens: 1}))
	w = &wtGate{ch: make(chan struct{})}
	g = gated{tiertest.NewMap(4 << 20), w.ch}
	var err error
	pc, err = kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{g}, TierWait: time.Minute, TierWriteThrough: true})
	require.NoError(t, err)
	pc.OnStoringWait(func() { w.waits.Add(1); w.open() })
	e.onFail(func() { w.open(); pc.Close() })
	return e, g, pc, w
}

// TestPrefixCacheTierWriteThroughWaiter: a request that may wait for memory which
// only an entry held busy by its write-through could give gets it once the entry's
// stores end, well before its deadline. Its tokens read back, and the ledger balances
// (the env's cleanup).
func TestPrefixCacheTierWriteThroughWaiter(t *testing.T) {
	const gran = 64 << 10
	for _, kind := range []backingKind{onShared, onCUDA} {
		t.Run(backingNames[kind], func(t *testing.T) {
			e, g, pc, w := writeThroughCache(t, kind, gran)
			c := e.c
			tpb, _ := blockTokens(t, c)
			s, _, err := serve(pc, promptIDs(1, 2*tpb+1))
			require.NoError(t, err)
			require.True(t, s.Close().OK()) // its entry's write-through waits at the gate
			q, err := c.NewSequence()
			require.NoError(t, err)
			e.onFail(func() { q.Close() })
			// A deadline only so that a failure ends: the gate opens as the growth
			// starts to wait for the write-through, before it would wait in the
			// governor (TestPrefixCacheTierWriteThroughGrowth).
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(t, q.AppendCtx(ctx, 3*tpb), "served once the write-through ended")
			assert.True(t, w.waited(), "the growth waited for the write-through")
			require.NoError(t, writeIDs(q, promptIDs(500, 3*tpb), 0, 3*tpb))
			require.NoError(t, checkIDs(q, promptIDs(500, 3*tpb), 0, 3*tpb))
			assert.Positive(t, pc.Stats().EvictedBytes, "the entry made room")
			assert.Equal(t, 2, g.Len(), "its two whole blocks went down first")
			require.True(t, q.Close().OK())
			require.NoError(t, pc.Close())
		})
	}
}

// TestPrefixCacheTierWriteThroughGrowth: a growth that does not wait (Append) and
// needs memory which only an entry held busy by its write-through could give waits
// for the entry's stores to end and evicts it, as a write-back copies on the same
// path: before the fix eviction passed the entry over and the growth was refused (the
// replay with -tier-write-through refused most of its requests). The blocks go down
// once, the tokens read back, and the ledger balances (the env's cleanup).
func TestPrefixCacheTierWriteThroughGrowth(t *testing.T) {
	const gran = 64 << 10
	for _, kind := range []backingKind{onShared, onCUDA} {
		t.Run(backingNames[kind], func(t *testing.T) {
			e, g, pc, w := writeThroughCache(t, kind, gran)
			c := e.c
			tpb, blk := blockTokens(t, c)
			ids := promptIDs(1, 3*tpb+1)
			s, _, err := serve(pc, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK()) // its entry's write-through waits at the gate
			require.EqualValues(t, 4*gran, pc.Stats().CachedBytes, "the entry holds the whole budget")
			q, err := c.NewSequence()
			require.NoError(t, err)
			e.onFail(func() { q.Close() })
			// The gate opens only once the growth waits for the write-through, so
			// the store cannot end before the growth asks: a growth that passes the
			// entry over is refused whatever the machine's load.
			want := promptIDs(500, 3*tpb)
			require.NoError(t, q.Append(3*tpb), "served once the write-through ended")
			assert.True(t, w.waited(), "the growth waited for the write-through")
			require.NoError(t, writeIDs(q, want, 0, 3*tpb))
			require.NoError(t, checkIDs(q, want, 0, 3*tpb))
			st := pc.Stats()
			assert.Positive(t, st.EvictedBytes, "the entry made room")
			assert.Zero(t, c.Stats().Refusals)
			assert.Equal(t, 3, g.Len(), "its three whole blocks went down")
			assert.EqualValues(t, 3*tierval.Size(tpb, blk), st.Tiers[0].StoreBytes, "once: the eviction stored none again")
			require.True(t, q.Close().OK())
			readBack(t, pc, ids, 3*tpb)
			require.NoError(t, pc.Close())
			e.finish(t)
		})
	}
}

// TestPrefixCacheTierWriteThroughRepay: a request of another ledger on the device
// that waits for memory which only an entry held busy by its write-through could
// give gets it once the stores end: the reclaimer, asked as the request started to
// wait, could evict nothing and owed it the bytes, and the write-through's end repays
// them (pcTiers.repay). Without the repayment the request waits to its deadline.
func TestPrefixCacheTierWriteThroughRepay(t *testing.T) {
	const gran = 64 << 10
	e, g, pc, w := writeThroughCache(t, onFake, gran)
	c := e.c
	tpb, _ := blockTokens(t, c)
	s, _, err := serve(pc, promptIDs(1, 3*tpb+1))
	require.NoError(t, err)
	require.True(t, s.Close().OK()) // its entry's write-through waits at the gate
	require.EqualValues(t, 4*gran, pc.Stats().CachedBytes, "the entry holds the whole budget")
	other := e.gov.Authority("other", c.Device())
	done := make(chan error, 1)
	go func() {
		// A deadline only so that a failure ends.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		done <- other.Acquire(ctx, gran)
	}()
	for pc.TierOwed() == 0 {
		select {
		case err := <-done:
			require.FailNow(t, "the request ended before the reclaimer owed it", "%v", err)
		default:
			runtime.Gosched()
		}
	}
	w.open()
	require.NoError(t, <-done, "served once the write-through ended")
	assert.False(t, w.waited(), "no growth of the cache's own")
	assert.Zero(t, pc.TierOwed(), "repaid")
	assert.Positive(t, pc.Stats().EvictedBytes, "the entry made room")
	assert.Equal(t, 3, g.Len(), "its three whole blocks went down")
	other.Release(gran)
	require.NoError(t, other.Close())
	require.NoError(t, pc.Close())
	e.finish(t)
}

// loadGate is a tier whose Contains, the first call of a lookup's load from it,
// waits until open is closed (whatever its context) once shut is set, counting the
// calls that run at once and the most that ever did.
type loadGate struct {
	*tiertest.Map
	open          chan struct{}
	shut          atomic.Bool
	running, most atomic.Int32
}

func (g *loadGate) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	if !g.shut.Load() {
		return g.Map.Contains(ctx, keys)
	}
	n := g.running.Add(1)
	defer g.running.Add(-1)
	for m := g.most.Load(); n > m && !g.most.CompareAndSwap(m, n); m = g.most.Load() {
	}
	<-g.open
	return g.Map.Contains(context.Background(), keys)
}

// loadGateCache returns a prefix cache of TierLoads slots over one loadGate on
// host.Shared, the gate's open func and the count of the lookups seen waiting for a
// slot (PrefixCache.OnLoadWait); the test shuts the gate, and its cleanup opens the
// gate and closes the cache.
func loadGateCache(t *testing.T, slots int, wait time.Duration) (*kv.Cache, *loadGate, *kv.PrefixCache, func(), *atomic.Int32) {
	t.Helper()
	c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
	g := &loadGate{Map: tiertest.NewMap(4 << 20), open: make(chan struct{})}
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{g}, TierPrefix: t.Name(), TierWait: wait, TierLoads: slots})
	require.NoError(t, err)
	var once sync.Once
	open := func() { once.Do(func() { close(g.open) }) }
	t.Cleanup(func() { open(); assert.NoError(t, pc.Close()) })
	var waiting atomic.Int32
	pc.OnLoadWait(func() { waiting.Add(1) })
	return c, g, pc, open, &waiting
}

// TestPrefixCacheTierLoadSlots: at most TierLoads lookups load from the tiers at
// once; the others wait for a slot, then load too, and every token they read back is
// the one written. The gate opens only once the lookups beyond the bound are seen
// waiting for a slot (PrefixCache.OnLoadWait), so that without the bound every lookup
// reaches the tier's Load before it opens, whatever the machine's load.
func TestPrefixCacheTierLoadSlots(t *testing.T) {
	const slots, lookups = 2, 5
	c, g, pc, open, waiting := loadGateCache(t, slots, time.Minute)
	tpb, _ := blockTokens(t, c)
	prompts := make([][]int32, lookups)
	for i := range prompts {
		prompts[i] = promptIDs(1000*(i+1), 2*tpb+1)
		evictAll(t, pc, prompts[i])
	}
	g.shut.Store(true)
	require.Equal(t, 2*lookups, g.Len())

	done := make(chan error, lookups)
	for _, ids := range prompts {
		go func() {
			q, m, err := pc.Lookup(ids)
			if err == nil && m != 2*tpb {
				err = fmt.Errorf("loaded %d tokens, want %d", m, 2*tpb)
			}
			if err == nil {
				err = checkIDs(q, ids, 0, m)
			}
			if q != nil {
				q.Close()
			}
			done <- err
		}()
	}
	for g.running.Load() < slots || waiting.Load() < lookups-slots {
		require.LessOrEqual(t, g.running.Load(), int32(slots), "lookups loading at once")
		select {
		case err := <-done:
			require.FailNow(t, "a lookup ended before the gate opened", "%v", err)
		default:
			runtime.Gosched()
		}
	}
	require.EqualValues(t, slots, g.running.Load(), "lookups loading at once while the rest wait")
	open()
	for range lookups {
		require.NoError(t, <-done)
	}
	assert.EqualValues(t, slots, g.most.Load())
	st := pc.Stats().Tiers[0]
	assert.EqualValues(t, 2*tpb*lookups, st.Hits, "every lookup loaded its blocks")
	assert.Zero(t, st.Drops)
}

// TestPrefixCacheTierLoadSlotWait: a lookup that finds every load slot taken waits
// for one only within its TierWait: it then starts on what the device holds (here
// nothing), and its tier counts a drop; the lookup holding the slot goes on.
func TestPrefixCacheTierLoadSlotWait(t *testing.T) {
	c, g, pc, open, waiting := loadGateCache(t, 1, time.Second)
	tpb, _ := blockTokens(t, c)
	a, b := promptIDs(100, tpb+1), promptIDs(200, tpb+1)
	evictAll(t, pc, a)
	evictAll(t, pc, b)
	g.shut.Store(true)
	lookup := func(ids []int32, got chan<- int) chan error {
		done := make(chan error, 1)
		go func() {
			q, m, err := pc.Lookup(ids)
			if err == nil {
				got <- m
				err = checkIDs(q, ids, 0, m)
				q.Close()
			}
			done <- err
		}()
		return done
	}
	aDone := lookup(a, make(chan int, 1))
	for g.running.Load() == 0 {
		select {
		case err := <-aDone:
			require.FailNow(t, "the first lookup ended before it asked the tier", "%v", err)
		default:
			runtime.Gosched()
		}
	}
	before := pc.Stats().Tiers[0]
	bGot := make(chan int, 1)
	bDone := lookup(b, bGot) // the slot is a's until the gate opens
	select {
	case err := <-bDone:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		require.FailNow(t, "the second lookup waited past its TierWait")
	}
	assert.Zero(t, <-bGot, "no slot within the wait: nothing loaded")
	assert.EqualValues(t, 1, waiting.Load(), "it waited for the slot")
	st := pc.Stats().Tiers[0]
	assert.EqualValues(t, 1, st.Drops-before.Drops, "counted as a drop of the tier")
	assert.Equal(t, before.Hits, st.Hits)
	assert.EqualValues(t, 1, g.running.Load(), "the first lookup still holds the slot")
	open()
	require.NoError(t, <-aDone)
}
