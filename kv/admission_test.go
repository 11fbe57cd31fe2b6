package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
)

// shareScene is a cache whose budget is spent but for a cached entry of 8 tokens that
// eviction can give back: s holds 5 tokens (a tail past its whole blocks) and p is a
// prefix of them. tiny8 takes blocks of 4 tokens in 3 granules of 4 KiB here
// (testBlockTokens), so the copied tail of a share is a block of 3 granules.
func shareScene(t *testing.T) (*env, *kv.Cache, *kv.PrefixCache, *kv.Sequence, *kv.Prefix) {
	t.Helper()
	const entry, seq, prefix = 6, 6, 3 // granules
	e := openEnv(t, withLimit((entry+seq+prefix)*fakeGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{}))
	c, pc := e.c, e.pc
	served, err := serveN(pc, promptIDs(1000, 8))
	require.NoError(t, err)
	require.True(t, served.Close().OK())
	s, err := c.NewSequence()
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	require.NoError(t, s.Append(5))
	p, err := s.Freeze(5)
	require.NoError(t, err)
	t.Cleanup(p.Release)
	require.Zero(t, e.gov.Available(accounting.HostKey), "the budget is spent")
	return e, c, pc, s, p
}

// TestEvictsBeforeRefusingShares: ForkAt, Freeze and NewSequenceFrom, whose copied
// tail needs a granule the budget does not have, evict a cached prefix no live
// sequence maps rather than refuse, as an append does; ForkNeed and Headroom say so
// beforehand.
func TestEvictsBeforeRefusingShares(t *testing.T) {
	ops := []struct {
		name string
		op   func(s *kv.Sequence, p *kv.Prefix) (func(), error)
	}{
		{"ForkAt", func(s *kv.Sequence, _ *kv.Prefix) (func(), error) {
			f, err := s.ForkAt(5)
			return func() { f.Close() }, err
		}},
		{"Freeze", func(s *kv.Sequence, _ *kv.Prefix) (func(), error) {
			q, err := s.Freeze(4 + 1)
			return func() { q.Release() }, err
		}},
		{"NewSequenceFrom", func(s *kv.Sequence, p *kv.Prefix) (func(), error) {
			q, err := s.Cache().NewSequenceFrom(p)
			return func() { q.Close() }, err
		}},
	}
	for _, tt := range ops {
		t.Run(tt.name, func(t *testing.T) {
			_, c, pc, s, p := shareScene(t)
			need, err := s.ForkNeed(5)
			require.NoError(t, err)
			assert.Equal(t, int64(3*fakeGranule), need, "one block for the copied tail")
			assert.Equal(t, int64(6*fakeGranule), c.Headroom(), "the entry is all the headroom")
			done, err := tt.op(s, p)
			require.NoError(t, err)
			defer done()
			assert.Positive(t, pc.Stats().EvictedBytes)
			assert.Zero(t, c.Stats().Refusals)
		})
	}
}

// TestTruncateIntoSharedEvicts: a truncation into a shared granule, whose replacement
// granule the budget does not have, evicts a cached prefix rather than leave the
// sequence shorter than asked.
func TestTruncateIntoSharedEvicts(t *testing.T) {
	const entry, seq = 6, 3 // granules
	e := openEnv(t, withLimit((entry+seq)*fakeGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{}))
	c, pc := e.c, e.pc
	served, err := serveN(pc, promptIDs(1000, 8))
	require.NoError(t, err)
	require.True(t, served.Close().OK())
	s, err := c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, s.Append(4)) // one block of 4 tokens: 3 whole granules
	p, err := s.Freeze(4)           // shares all 3
	require.NoError(t, err)
	defer p.Release()
	require.Zero(t, e.gov.Available(accounting.HostKey))
	require.NoError(t, s.Truncate(2)) // the kept tokens lie in the shared block: 3 granules to replace
	assert.Equal(t, 2, s.Len())
	assert.Positive(t, pc.Stats().EvictedBytes)
}

// TestShareRefusalCounted: with nothing to evict, the share is refused with the
// ForkNeed figure and counted by the cache and the governor alike.
func TestShareRefusalCounted(t *testing.T) {
	e, c, pc, s, _ := shareScene(t)
	pin, err := pc.Pin(promptIDs(1000, 8))
	require.NoError(t, err)
	defer pin.Release()
	assert.Zero(t, c.Headroom(), "nothing to evict")
	need, err := s.ForkNeed(5)
	require.NoError(t, err)
	_, err = s.ForkAt(5)
	var be *accounting.BudgetError
	require.ErrorAs(t, err, &be)
	assert.Equal(t, need, be.Requested)
	assert.Equal(t, int64(1), c.Stats().Refusals)
	assert.Equal(t, int64(1), e.gov.Stats(accounting.HostKey).Counters.Refusals)
}

func TestForkNeedBadInput(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}))
	c := e.c
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(6))
	for _, n := range []int{-1, 7} {
		_, err := s.ForkNeed(n)
		assert.ErrorIs(t, err, kv.ErrRange, "n=%d", n)
	}
	need, err := s.ForkNeed(6) // a block of 4 tokens mapped, 2 copied into a block
	require.NoError(t, err)
	before := e.auth.Stats().Owned
	f, err := s.ForkAt(6)
	require.NoError(t, err)
	assert.Equal(t, need, e.auth.Stats().Owned-before, "ForkNeed is what ForkAt took")
	require.True(t, f.Close().OK())
	require.True(t, s.Close().OK())
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _, _ = s.ForkNeed(0) })

	priv := openEnv(t, onPrivate, withConfig(kv.Config{MaxTokens: 64})).c
	q, err := priv.NewSequence()
	require.NoError(t, err)
	defer q.Close()
	_, err = q.ForkNeed(0)
	assert.ErrorIs(t, err, kv.ErrNoSharing)
}

// TestHeadroomLeavesOutWhatEvictionCanNotTake: cached granules that a live sequence
// maps or a pin holds are not headroom; the rest is, with the governor's free bytes.
func TestHeadroomLeavesOutWhatEvictionCanNotTake(t *testing.T) {
	const limit = 64 * fakeGranule
	e := openEnv(t, withLimit(limit), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{}))
	c, pc := e.c, e.pc
	assert.Equal(t, int64(limit), c.Headroom())
	a, b := promptIDs(0, 8), promptIDs(100, 8)
	for _, ids := range [][]int32{a, b} {
		s, err := serveN(pc, ids)
		require.NoError(t, err)
		require.True(t, s.Close().OK())
	}
	entry := pc.Stats().CachedBytes / 2
	avail := e.gov.Available(accounting.HostKey)
	assert.Equal(t, avail+2*entry, c.Headroom())
	pin, err := pc.Pin(a)
	require.NoError(t, err)
	assert.Equal(t, avail+entry, c.Headroom(), "a pinned entry is not headroom")
	q, m, err := pc.Lookup(append(b[:8:8], -1))
	require.NoError(t, err)
	require.Equal(t, 8, m)
	assert.Equal(t, e.gov.Available(accounting.HostKey), c.Headroom(), "a is pinned, b mapped by a live sequence")
	require.True(t, q.Close().OK())
	pin.Release()
	assert.Equal(t, e.gov.Available(accounting.HostKey)+2*entry, c.Headroom())
}

// TestMatchChangesNothing: Match says what Lookup would match and changes nothing: no
// query counted, no sequence, no entry marked used (the LRU order stays).
func TestMatchChangesNothing(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			c, pc := e.c, e.pc
			a, b := promptIDs(0, 12), promptIDs(100, 12)
			for _, ids := range [][]int32{a, b} {
				s, err := serveN(pc, ids)
				require.NoError(t, err)
				require.True(t, s.Close().OK())
			}
			before, cs := pc.Stats(), c.Stats()
			assert.Equal(t, 11, pc.Match(a), "the last token is never matched")
			assert.Equal(t, 7, pc.Match(append(a[:7:7], -1, -2)))
			assert.Zero(t, pc.Match(promptIDs(500, 12)))
			assert.Zero(t, pc.Match(nil))
			assert.Equal(t, before, pc.Stats(), "no query, no hit, nothing evicted")
			assert.Equal(t, cs, c.Stats(), "no sequence")

			// a is the least recently used still: Match did not touch it.
			got, err := pc.Evict(1)
			require.NoError(t, err)
			assert.Positive(t, got)
			assert.Equal(t, 11, pc.Match(b))
			assert.Less(t, pc.Match(a), 11, "a was evicted first")

			s, m, err := pc.Lookup(b)
			require.NoError(t, err)
			assert.Equal(t, pc.Match(b), m, "Match is what Lookup matches")
			require.True(t, s.Close().OK())
			require.NoError(t, pc.Close())
			assert.Zero(t, pc.Match(b), "a closed prefix cache matches nothing")
		})
	}
}

// TestPrefixCacheNeedIsWhatServingTakes: Need(tokens) is the bytes Lookup and the
// prefill of the rest commit, hit or miss.
func TestPrefixCacheNeedIsWhatServingTakes(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			pc := e.pc
			a := promptIDs(0, 21)
			hit := append(a[:13:13], promptIDs(200, 10)...)
			var keep []*kv.Sequence
			for _, ids := range [][]int32{a, hit, promptIDs(500, 30)} {
				need, err := pc.Need(ids)
				require.NoError(t, err)
				before := e.auth.Stats().Owned
				s, err := serveN(pc, ids)
				require.NoError(t, err)
				assert.Equal(t, need, e.auth.Stats().Owned-before, "prompt of %d", len(ids))
				keep = append(keep, s)
			}
			_, err := pc.Need(promptIDs(0, 65))
			assert.ErrorIs(t, err, kv.ErrTooLong)
			for _, s := range keep {
				require.True(t, s.Close().OK())
			}
			require.NoError(t, pc.Close())
			_, err = pc.Need(a)
			assert.ErrorIs(t, err, kv.ErrClosed)
		})
	}
}

func TestPrefixCacheEvict(t *testing.T) {
	pc := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{})).pc
	s, err := serveN(pc, promptIDs(0, 8))
	require.NoError(t, err)
	got, err := pc.Evict(1 << 20)
	require.NoError(t, err)
	assert.Zero(t, got, "a live sequence maps every cached granule")
	require.True(t, s.Close().OK())
	cached := pc.Stats().CachedBytes
	got, err = pc.Evict(0)
	require.NoError(t, err)
	assert.Zero(t, got)
	got, err = pc.Evict(1 << 20)
	require.NoError(t, err)
	assert.Equal(t, cached, got, "everything that came back")
	assert.Equal(t, cached, pc.Stats().EvictedBytes)
	_, err = pc.Evict(-1)
	assert.ErrorIs(t, err, kv.ErrRange)
	require.NoError(t, pc.Close())
	_, err = pc.Evict(1)
	assert.ErrorIs(t, err, kv.ErrClosed)
}

// TestDeviceAndPool: the cache says where its memory is and which pool holds it.
func TestDeviceAndPool(t *testing.T) {
	e := openEnv(t, onCUDA, pooled, withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked}))
	defer e.finish(t)
	assert.Equal(t, accounting.GPU(0), e.c.Device())
	assert.Equal(t, e.pool, e.c.Pool())
	priv := openEnv(t, onPrivate, withConfig(kv.Config{MaxTokens: 64})).c
	assert.Equal(t, accounting.HostKey, priv.Device())
	assert.Nil(t, priv.Pool(), "a backing without a pool")
	assert.Equal(t, priv.Headroom(), int64(accounting.Unlimited))
}
