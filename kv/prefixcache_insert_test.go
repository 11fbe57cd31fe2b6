package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheCloseAfterRewriteKeepsEntry: an entry got ranges of its own (the
// inserted sequence truncated below it), then the sequence rewrote those tokens and
// shared its ranges again (a fork) before it closed. Its ranges no longer hold what
// the entry's token IDs say, so the entry must not take them over: a later hit reads
// the tokens that were inserted.
func TestPrefixCacheCloseAfterRewriteKeepsEntry(t *testing.T) {
	const n = 22 // whole sharing units and a partly filled one, in every layout
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			pc := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{})).pc
			ids := promptIDs(0, n+1)
			s := prefilled(t, pc, ids[:n])
			require.NoError(t, pc.Insert(s, ids[:n]))

			require.NoError(t, s.Truncate(1)) // the entry copies what it holds first
			other := promptIDs(500, n)
			require.NoError(t, s.Append(n-1))
			require.NoError(t, writeIDs(s, other, 0, n), "all of s is its own again")
			f, err := s.ForkAt(n)
			require.NoError(t, err)
			require.True(t, f.Close().OK())
			require.True(t, s.Close().OK())

			q, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			assert.Equal(t, n, m)
			assert.NoError(t, checkIDs(q, ids, 0, m), "the entry holds the tokens it was inserted with")
			require.True(t, q.Close().OK())
		})
	}
}

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
				e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
				c, pc := e.c, e.pc
				pool := forkInsertPool{
					held: func() int64 { return e.auth.Stats().Owned },
					limit: func(t *testing.T) {
						require.NoError(t, e.gov.SetLimit(e.auth.Device(), e.auth.Stats().Owned))
					},
				}
				forkThenInsert(t, c, pc, pool, how, p)
			})
		}
	}
}

// TestPrefixCacheReopened: a server may close its prefix cache and make another on
// the same cache while sequences live. A sequence that maps the first one's granules
// (a hit, or one inserted there), or a fork of it, is refused by the second one's
// Insert with ErrConfig, and nothing changes: it stays usable, the second cache's
// books hold none of the first's, and everything is given back at the end.
func TestPrefixCacheReopened(t *testing.T) {
	const p = 40
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}))
			c := e.c
			pc1, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			a := promptIDs(0, p)
			s, _, err := serve(pc1, a)
			require.NoError(t, err)
			hit, m, err := pc1.Lookup(append(a[:p:p], -1))
			require.NoError(t, err)
			require.Equal(t, p, m)
			fork, err := hit.Fork()
			require.NoError(t, err)
			require.NoError(t, pc1.Close())

			pc2, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			for _, q := range []*kv.Sequence{s, hit, fork} {
				err := pc2.Insert(q, a)
				require.ErrorIs(t, err, kv.ErrConfig)
				assert.Contains(t, err.Error(), "earlier prefix cache")
				require.NoError(t, checkIDs(q, a, 0, p), "refused, it keeps its tokens")
				require.NoError(t, q.Append(1), "and stays usable")
			}
			assert.Zero(t, pc2.Stats().Entries)
			assert.Zero(t, pc2.Stats().CachedBytes)

			// A sequence new to the second one is cached as usual.
			b := promptIDs(1000, p)
			q, _, err := serve(pc2, b)
			require.NoError(t, err)
			require.True(t, q.Close().OK())
			r, m, err := pc2.Lookup(append(b[:p:p], -1))
			require.NoError(t, err)
			assert.Equal(t, p, m)
			require.NoError(t, checkIDs(r, b, 0, p))
			for _, q := range []*kv.Sequence{s, hit, fork, r} {
				require.True(t, q.Close().OK())
			}
			require.NoError(t, pc2.Close())
		})
	}
}

// TestInsertDisplacingIsNoEviction: an insert that extends a cached entry (43 tokens:
// a partly filled last unit in every layout) replaces
// it (the new entry holds its tokens) and evicts nothing: EvictedBytes stays 0, as do
// Evictions and EvictedTokens, though the old entry's copied tail goes back.
func TestInsertDisplacingIsNoEviction(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			pc := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{})).pc
			ids := promptIDs(0, 60)
			s, err := serveN(pc, ids[:43])
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			s, m, err := serve(pc, ids)
			require.NoError(t, err)
			require.Equal(t, 43, m)
			require.True(t, s.Close().OK())
			st := pc.Stats()
			assert.Equal(t, 1, st.Entries)
			assert.Zero(t, st.Evictions)
			assert.Zero(t, st.EvictedTokens)
			assert.Zero(t, st.EvictedBytes, "a displaced entry is not evicted")
		})
	}
}
