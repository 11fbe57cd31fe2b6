//go:build linux || windows

package kv_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/logrec"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// tierBackend is a backing the tier tests run on (an env of 64 KiB granules): host
// memory the CPU reads, or device memory reached by copies (the CUDA fake).
type tierBackend struct {
	name string
	kind backingKind
}

var tierBackends = []tierBackend{{"host.Shared", onShared}, {"cuda fake", onCUDA}}

// tierKinds makes the tiers the tests read back from.
var tierKinds = []struct {
	name string
	make func(t *testing.T) kv.Tier
}{
	{"map", func(*testing.T) kv.Tier { return tiertest.NewMap(4 << 20) }},
	{"host", func(t *testing.T) kv.Tier {
		ht, err := hosttier.New(hosttier.Options{Budget: 64 << 20})
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, ht.Close()) })
		return ht
	}},
}

// newTierCache returns a prefix cache over c with tiers, closed by the test's cleanup.
func newTierCache(t *testing.T, c *kv.Cache, tiers ...kv.Tier) *kv.PrefixCache {
	t.Helper()
	// A wait no loaded machine reaches: TestPrefixCacheTierWait tests the wait.
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: tiers, TierPrefix: t.Name(), TierWait: time.Minute})
	require.NoError(t, err)
	closeAtCleanup(t, pc)
	return pc
}

// evictAll serves ids, closes the sequence (its entry takes over its ranges) and
// evicts the whole cache, so that the entry's blocks go down into the tiers.
func evictAll(t *testing.T, pc *kv.PrefixCache, ids []int32) {
	t.Helper()
	s, _, err := serve(pc, ids)
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	_, err = pc.Evict(1 << 40)
	require.NoError(t, err)
	require.Zero(t, pc.Stats().CachedTokens, "the entry left the index")
}

// TestPrefixCacheTierReadBack: an entry's whole blocks go down into the tier when it
// is evicted, and a lookup of the same prompt starts on them again: every token read
// back is the one written, on host memory and through the CUDA fake's copies, from
// an in-memory tier and from the host tier.
func TestPrefixCacheTierReadBack(t *testing.T) {
	for _, be := range tierBackends {
		for _, tk := range tierKinds {
			t.Run(be.name+"/"+tk.name, func(t *testing.T) {
				c := openEnv(t, be.kind, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
				tier := tk.make(t)
				pc := newTierCache(t, c, tier)
				s, err := c.NewSequence()
				require.NoError(t, err)
				tpb, blk := s.BlockTokens(), s.BlockStride()
				require.True(t, s.Close().OK())
				ids := promptIDs(7, 3*tpb+5)
				evictAll(t, pc, ids)
				st := pc.Stats().Tiers
				require.Len(t, st, 1)
				assert.Equal(t, tier.Name(), st[0].Name)
				assert.EqualValues(t, 3*tierval.Size(tpb, blk), st[0].StoreBytes, "three whole blocks went down")
				assert.Zero(t, st[0].Drops)

				q, m, err := pc.Lookup(ids)
				require.NoError(t, err)
				assert.Equal(t, 3*tpb, m, "the whole blocks below the last token")
				assert.Equal(t, m, q.Len())
				assert.NoError(t, checkIDs(q, ids, 0, m))
				// The sequence goes on from there as after a local hit.
				require.NoError(t, q.Append(len(ids)-m))
				require.NoError(t, writeIDs(q, ids, m, len(ids)))
				assert.NoError(t, checkIDs(q, ids, 0, len(ids)))
				require.True(t, q.Close().OK())
				st = pc.Stats().Tiers
				assert.EqualValues(t, 3*tpb, st[0].Hits)
				assert.EqualValues(t, st[0].StoreBytes, st[0].LoadBytes)
				assert.Zero(t, st[0].Invalid)
				assert.EqualValues(t, 3*tpb, pc.Stats().Hits, "tier tokens count as hits")

				// A prompt that shares the first block only loads that one.
				other := append(append([]int32(nil), ids[:tpb]...), promptIDs(9000, 2*tpb)...)
				q, m, err = pc.Lookup(other)
				require.NoError(t, err)
				assert.Equal(t, tpb, m)
				assert.NoError(t, checkIDs(q, other, 0, m))
				require.True(t, q.Close().OK())
			})
		}
	}
}

// TestPrefixCacheTierPartialHit: a prompt whose first block the index still holds
// (a sibling entry shares it) finds it locally and loads the blocks after it from the
// tier; only the evicted entry's own blocks went down.
func TestPrefixCacheTierPartialHit(t *testing.T) {
	for _, extra := range []int{0, 3} {
		t.Run(fmt.Sprintf("shared+%d", extra), func(t *testing.T) {
			c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
			tier := tiertest.NewMap(4 << 20)
			pc := newTierCache(t, c, tier)
			s, err := c.NewSequence()
			require.NoError(t, err)
			tpb := s.BlockTokens()
			require.True(t, s.Close().OK())
			require.Greater(t, tpb, extra)
			// The sibling shares tpb+extra tokens: a whole block, then (extra > 0)
			// part of the next, which the lookup then loads whole over its copy.
			shared := tpb + extra
			ids := promptIDs(3, 4*tpb+1)
			sibling := append(append([]int32(nil), ids[:shared]...), promptIDs(7000, 2*tpb)...)
			for _, p := range [][]int32{ids, sibling} {
				q, _, err := serve(pc, p)
				require.NoError(t, err)
				require.True(t, q.Close().OK())
			}
			// The least recently used entry, ids, goes whole.
			_, err = pc.Evict(1)
			require.NoError(t, err)
			require.Equal(t, int64(len(sibling)), pc.Stats().CachedTokens, "the sibling is left")
			assert.Equal(t, 3, tier.Len(), "ids' blocks from the one holding the shared tokens' last")
			q, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			assert.Equal(t, 4*tpb, m)
			assert.NoError(t, checkIDs(q, ids, 0, m))
			require.True(t, q.Close().OK())
			st := pc.Stats()
			assert.EqualValues(t, 4*tpb-shared, st.Tiers[0].Hits)
			assert.EqualValues(t, 4*tpb, st.Hits-int64(shared), "the sibling's lookup hit the shared tokens")
		})
	}
}

// corrupt is a tier whose loads hand out a damaged copy of the value.
type corrupt struct {
	kv.Tier
	damage func(v []byte) []byte
}

func (c corrupt) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	return c.Tier.Load(ctx, key, func(src []byte) error {
		return use(c.damage(append([]byte(nil), src...)))
	})
}

// failing is a tier every call of which fails.
type failing struct{ kv.Tier }

var errTierDown = errors.New("tier down")

func (failing) Store(context.Context, tierval.Key, int, func([]byte) error) error { return errTierDown }
func (failing) Load(context.Context, tierval.Key, func([]byte) error) error       { return errTierDown }
func (failing) Contains(context.Context, []tierval.Key) (int, error)              { return 0, errTierDown }

// TestPrefixCacheTierCorrupt: a value flipped in one byte, cut short, or written under
// another namespace (another user prefix, another geometry) is a miss, counted as
// invalid, and no token of it is mapped.
func TestPrefixCacheTierCorrupt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(v []byte) []byte
	}{
		{"flip", func(v []byte) []byte { v[len(v)/2] ^= 0x10; return v }},
		{"truncate", func(v []byte) []byte { return v[:len(v)-1] }},
		{"header", func(v []byte) []byte { v[tierval.HeaderSize] ^= 1; return v }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rec logrec.Recorder
			e := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512, Logger: rec.Logger()}))
			c := e.c
			m := tiertest.NewMap(4 << 20)
			pc := newTierCache(t, c, corrupt{m, tc.damage})
			s, err := c.NewSequence()
			require.NoError(t, err)
			tpb := s.BlockTokens()
			require.True(t, s.Close().OK())
			ids := promptIDs(11, 2*tpb+1)
			evictAll(t, pc, ids)
			require.Equal(t, 2, m.Len())
			before := pc.Stats()
			q, got, err := pc.Lookup(ids)
			require.NoError(t, err)
			assert.Zero(t, got)
			assert.Zero(t, q.Len())
			require.True(t, q.Close().OK())
			st := pc.Stats()
			assert.EqualValues(t, 1, st.Tiers[0].Invalid, "the first block fails: the run ends there")
			assert.EqualValues(t, 1, st.Tiers[0].Misses-before.Tiers[0].Misses)
			assert.Zero(t, st.Tiers[0].Hits)
			assert.Zero(t, st.Tiers[0].LoadBytes)
			assert.Zero(t, st.Hits)
			logged := rec.Find("kv: prefix cache tier value failed its check")
			require.Len(t, logged, 1, "the invalid value is logged with its reason")
			assert.Equal(t, "WARN", logged[0]["level"])
			assert.Equal(t, float64(0), logged[0]["tier"])
			assert.Equal(t, float64(0), logged[0]["block"])
			assert.Contains(t, logged[0]["err"], tierval.ErrValue.Error())
		})
	}
	t.Run("namespace", func(t *testing.T) {
		// Another user prefix is another namespace: a value made under it and handed
		// out under this cache's key fails its check.
		c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
		m := tiertest.NewMap(4 << 20)
		pcA, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{m}, TierPrefix: "a"})
		require.NoError(t, err)
		s, err := c.NewSequence()
		require.NoError(t, err)
		tpb := s.BlockTokens()
		require.True(t, s.Close().OK())
		ids := promptIDs(5, tpb+1)
		evictAll(t, pcA, ids)
		require.NoError(t, pcA.Close())
		ns, err := kv.TierNamespace(c.Config(), 64<<10, "a")
		require.NoError(t, err)
		pcB := newTierCache(t, c, foreign{m, ns})
		q, got, err := pcB.Lookup(ids)
		require.NoError(t, err)
		assert.Zero(t, got)
		require.True(t, q.Close().OK())
		assert.EqualValues(t, 1, pcB.Stats().Tiers[0].Invalid)
	})
	t.Run("geometry", func(t *testing.T) {
		// Another geometry whose blocks have the same tokens and bytes (half the KV
		// heads, twice the head dim): its value would fit this cache's block, and is
		// refused by its namespace.
		other := kv.Uniform(tiny8.Name, tiny8.Layers, tiny8.Groups[0].KVHeads/2, 2*tiny8.Groups[0].HeadDim, tiny8.Groups[0].DType)
		eA := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{Model: other, MaxTokens: 512}))
		c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
		m := tiertest.NewMap(4 << 20)
		pcA, err := kv.NewPrefixCache(eA.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{m}})
		require.NoError(t, err)
		tpbA, blkA := blockTokens(t, eA.c)
		tpb, blk := blockTokens(t, c)
		require.Equal(t, []int{tpb, blk}, []int{tpbA, blkA}, "blocks of one shape")
		ids := promptIDs(5, tpb+1)
		evictAll(t, pcA, ids)
		require.NoError(t, pcA.Close())
		ns, err := kv.TierNamespace(eA.c.Config(), 64<<10, "")
		require.NoError(t, err)
		pcB := newTierCache(t, c, foreign{m, ns})
		q, got, err := pcB.Lookup(ids)
		require.NoError(t, err)
		assert.Zero(t, got)
		require.True(t, q.Close().OK())
		assert.EqualValues(t, 1, pcB.Stats().Tiers[0].Invalid)
	})
}

// foreign loads every key from another namespace: a value of another model or
// tenant under this cache's key.
type foreign struct {
	*tiertest.Map
	ns uint64
}

func (f foreign) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	moved := make([]tierval.Key, len(keys))
	for i, k := range keys {
		moved[i] = tierval.Key{Namespace: f.ns, Hash: k.Hash}
	}
	return f.Map.Contains(ctx, moved)
}

func (f foreign) Load(ctx context.Context, key tierval.Key, use func([]byte) error) error {
	return f.Map.Load(ctx, tierval.Key{Namespace: f.ns, Hash: key.Hash}, use)
}

// TestPrefixCacheTierFailing: a tier that fails every call never fails a lookup or an
// eviction; its failures are counted drops.
func TestPrefixCacheTierFailing(t *testing.T) {
	c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
	pc := newTierCache(t, c, failing{tiertest.NewMap(0)})
	s, err := c.NewSequence()
	require.NoError(t, err)
	tpb := s.BlockTokens()
	require.True(t, s.Close().OK())
	ids := promptIDs(1, 2*tpb+3)
	evictAll(t, pc, ids)
	st := pc.Stats().Tiers[0]
	assert.EqualValues(t, 3, st.Drops, "the first lookup's Contains and two stores")
	q, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	assert.Zero(t, m)
	require.True(t, q.Close().OK())
	st = pc.Stats().Tiers[0]
	assert.EqualValues(t, 4, st.Drops, "and this lookup's Contains")
	assert.EqualValues(t, 2, st.Misses)
	assert.Zero(t, st.StoreBytes)
}

// stalled is a tier whose loads wait until their context ends.
type stalled struct{ *tiertest.Map }

func (stalled) Load(ctx context.Context, _ tierval.Key, _ func([]byte) error) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestPrefixCacheTierWait: a tier that does not answer holds a lookup up to TierWait,
// then the lookup goes on with what it has, the stall counted as a drop.
func TestPrefixCacheTierWait(t *testing.T) {
	c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
	m := tiertest.NewMap(4 << 20)
	s, err := c.NewSequence()
	require.NoError(t, err)
	tpb := s.BlockTokens()
	require.True(t, s.Close().OK())
	ids := promptIDs(2, 2*tpb+1)
	// The blocks go down through a prefix cache with a wait no loaded machine reaches,
	// so that only the lookup below meets the short one.
	fill, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{m}, TierWait: time.Minute})
	require.NoError(t, err)
	evictAll(t, fill, ids)
	require.NoError(t, fill.Close())
	require.Equal(t, 2, m.Len())
	const wait = 20 * time.Millisecond
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{stalled{m}}, TierWait: wait})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pc.Close()) })
	drops := pc.Stats().Tiers[0].Drops
	start := time.Now()
	q, got, err := pc.Lookup(ids)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, time.Since(start), wait)
	assert.Zero(t, got)
	assert.Zero(t, q.Len())
	require.True(t, q.Close().OK())
	assert.EqualValues(t, drops+1, pc.Stats().Tiers[0].Drops)
}

// TestPrefixCacheTierOptions: bad tier options are refused with ErrConfig.
func TestPrefixCacheTierOptions(t *testing.T) {
	c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
	for _, o := range []kv.PrefixCacheOptions{
		{Tiers: []kv.Tier{nil}},
		{Tiers: []kv.Tier{tiertest.NewMap(0)}, TierStores: -1},
		{Tiers: []kv.Tier{tiertest.NewMap(0)}, TierLoads: -1},
		{Tiers: []kv.Tier{tiertest.NewMap(0)}, TierWait: -1},
		{Tiers: []kv.Tier{tiertest.NewMap(0), tiertest.NewMap(0)}}, // two of one name
	} {
		_, err := kv.NewPrefixCache(c, o)
		assert.ErrorIs(t, err, kv.ErrConfig, "%+v", o)
	}
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.HostKey)
	pl := openEnv(t, onShared, withGranule(64<<10), withAuthority(auth), withName("kv-pc-tier-pl"), withConfig(kv.Config{Model: tiny8, MaxTokens: 64, Layout: kv.PerLayer})).c
	_, err := kv.NewPrefixCache(pl, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(0)}})
	assert.ErrorIs(t, err, kv.ErrConfig, "PerLayer has no contiguous block")
}

// TestPrefixCacheTierConcurrent: lookups, inserts and evictions at once, under a cap
// that keeps evicting into the tier; every token a lookup hands out is the one
// written, and the ledgers balance at the end (the backends' cleanups check them).
func TestPrefixCacheTierConcurrent(t *testing.T) {
	for _, be := range tierBackends {
		t.Run(be.name, func(t *testing.T) {
			c := openEnv(t, be.kind, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
			tier := tiertest.NewMap(4 << 20)
			s, err := c.NewSequence()
			require.NoError(t, err)
			tpb, blk := s.BlockTokens(), s.BlockStride()
			require.True(t, s.Close().OK())
			pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
				Tiers: []kv.Tier{tier}, MaxBytes: 4 * int64(blk), TierWait: time.Minute,
			})
			require.NoError(t, err)
			prompts := make([][]int32, 6)
			for i := range prompts {
				prompts[i] = append(promptIDs(0, tpb), promptIDs(1000*(i+1), 2*tpb+i)...)
			}
			tierWorkers(t, pc, prompts, 12, 1, nil)
			st := pc.Stats()
			assert.Positive(t, st.Tiers[0].StoreBytes)
			assert.Positive(t, st.Tiers[0].Hits)
			require.NoError(t, pc.Close())
		})
	}
}

// gated is a tier whose stores wait until open is closed.
type gated struct {
	*tiertest.Map
	open chan struct{}
}

func (g gated) Store(ctx context.Context, key tierval.Key, size int, fill func([]byte) error) error {
	<-g.open
	return g.Map.Store(ctx, key, size, fill)
}

// TestPrefixCacheTierCapInBackground: an eviction to MaxBytes after an Insert writes
// the victim's blocks down off the request's path: the request returns while the
// tier's store still waits, and Close waits for the store before the entry's ranges
// close (the ledger balances at the end).
func TestPrefixCacheTierCapInBackground(t *testing.T) {
	c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
	s, err := c.NewSequence()
	require.NoError(t, err)
	tpb, blk := s.BlockTokens(), s.BlockStride()
	require.True(t, s.Close().OK())
	g := gated{tiertest.NewMap(4 << 20), make(chan struct{})}
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
		Tiers: []kv.Tier{g}, MaxBytes: 4 * int64(blk), TierWait: time.Minute,
	})
	require.NoError(t, err)
	a, b := promptIDs(0, 3*tpb+1), promptIDs(5000, 3*tpb+1)
	q, _, err := serve(pc, a)
	require.NoError(t, err)
	require.True(t, q.Close().OK()) // the entry takes over a's ranges
	done := make(chan error, 1)
	go func() {
		q, _, err := serve(pc, b) // over MaxBytes: a's entry goes
		if err == nil {
			q.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		close(g.open)
		t.Fatal("the request waited for the tier's store")
	}
	assert.Zero(t, g.Len(), "the store still waits")
	closed := make(chan error, 1)
	go func() { closed <- pc.Close() }()
	select {
	case <-closed:
		t.Fatal("Close did not wait for the write-back")
	case <-time.After(20 * time.Millisecond):
	}
	close(g.open)
	require.NoError(t, <-closed)
	assert.Equal(t, 6, g.Len(), "a's three whole blocks, then b's, which Close evicts")
}

// closeAtCleanup closes pc at the test's cleanup, unless the test closed it (a second
// Close returns ErrClosed).
func closeAtCleanup(t *testing.T, pc *kv.PrefixCache) {
	t.Cleanup(func() {
		if err := pc.Close(); !errors.Is(err, kv.ErrClosed) {
			assert.NoError(t, err)
		}
	})
}
