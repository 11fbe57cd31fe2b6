package kv_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// promptIDs returns n token IDs from first on.
func promptIDs(first, n int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32(first + i)
	}
	return ids
}

// committedOf returns the bytes s commits, from the cache's SequenceStats.
func committedOf(t *testing.T, c *kv.Cache, s *kv.Sequence) int64 {
	t.Helper()
	for _, st := range c.SequenceStats() {
		if st.ID == s.ID() {
			return st.Committed
		}
	}
	require.FailNow(t, "sequence not listed")
	return 0
}

// TestPrefixCacheMissTakesOverLRUEntry: a miss whose prompt the budget can not hold
// evicts the least recently used entry whole and starts the new sequence on its
// ranges with their granules committed, so that its prefill commits nothing; the
// ledger stays exact. It does not when the budget holds the prompt, when that entry
// holds more than the prompt needs, or when its ranges have read-only bytes (a hit
// protected them while it was live): those go through the eviction a growth makes.
func TestPrefixCacheMissTakesOverLRUEntry(t *testing.T) {
	const p = 64 // tokens per prompt
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			// One prompt's granules, measured on a cache of its own.
			x := entryBytes(t, layout, p)
			require.Positive(t, x)

			e := openEnv(t, withLimit(2*x+x/2), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))

			c, pc := e.c, e.pc
			a, b, cc := promptIDs(0, p), promptIDs(1000, p), promptIDs(2000, p)
			for _, ids := range [][]int32{a, b} {
				s, _, err := pc.Lookup(ids)
				require.NoError(t, err)
				assert.Zero(t, committedOf(t, c, s), "the budget holds the prompt: nothing taken over")
				require.NoError(t, s.Append(p))
				require.NoError(t, writeIDs(s, ids, 0, p))
				require.NoError(t, pc.Insert(s, ids))
				require.True(t, s.Close().OK())
			}
			require.Equal(t, 2*x, e.auth.Stats().Owned)

			s, m, err := pc.Lookup(cc)
			require.NoError(t, err)
			assert.Zero(t, m)
			assert.Zero(t, s.Len())
			assert.Equal(t, x, committedOf(t, c, s), "the new sequence holds a's granules")
			st := pc.Stats()
			assert.Equal(t, 1, st.Entries)
			assert.Equal(t, int64(p), st.EvictedTokens)
			assert.Equal(t, x, st.EvictedBytes)
			assert.Equal(t, x, st.CachedBytes)
			assert.Equal(t, int64(p), st.CachedTokens, "b is left")
			require.NoError(t, s.Append(p))
			assert.Equal(t, 2*x, e.auth.Stats().Owned, "the prefill committed nothing new")
			require.NoError(t, writeIDs(s, cc, 0, p))
			require.NoError(t, checkIDs(s, cc, 0, p))
			require.NoError(t, pc.Insert(s, cc))
			require.True(t, s.Close().OK())

			q, m, err := pc.Lookup(append(b[:p:p], -1))
			require.NoError(t, err)
			assert.Equal(t, p, m, "b is still cached")
			require.NoError(t, checkIDs(q, b, 0, p))
			require.True(t, q.Close().OK())

			// An entry larger than the prompt is not taken over: the prompt's growth
			// evicts what it needs.
			short := promptIDs(3000, p/4)
			s, _, err = pc.Lookup(short)
			require.NoError(t, err)
			assert.Zero(t, committedOf(t, c, s))
			require.NoError(t, s.Append(len(short)))
			require.True(t, s.Close().OK())
			assert.Equal(t, 2, pc.Stats().Entries)
		})
	}
}

// TestPrefixCacheMissSkipsGuardedEntry: an entry whose ranges a hit made read-only in
// part (while the inserted sequence was live) is never handed to a new sequence,
// which would write there; the miss's growth evicts it instead.
func TestPrefixCacheMissSkipsGuardedEntry(t *testing.T) {
	const p = 64
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			x := entryBytes(t, layout, p)

			e := openEnv(t, withLimit(2*x+x/2), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))

			c, pc := e.c, e.pc
			a := promptIDs(0, p)
			s, _, err := serve(pc, a)
			require.NoError(t, err)
			q, m, err := pc.Lookup(append(a[:p:p], -1))
			require.NoError(t, err)
			require.Equal(t, p, m)
			require.True(t, q.Close().OK())
			require.True(t, s.Close().OK())
			s, _, err = serve(pc, promptIDs(1000, p))
			require.NoError(t, err)
			require.True(t, s.Close().OK())

			cc := promptIDs(2000, p)
			s, _, err = pc.Lookup(cc)
			require.NoError(t, err)
			assert.Zero(t, committedOf(t, c, s), "a's ranges are read-only in part: not taken over")
			require.NoError(t, s.Append(p), "the growth evicts instead")
			require.NoError(t, writeIDs(s, cc, 0, p))
			require.NoError(t, checkIDs(s, cc, 0, p))
			assert.LessOrEqual(t, e.auth.Stats().Owned, 2*x+x/2)
			require.True(t, s.Close().OK())
		})
	}
}

// TestPrefixCacheMissSparesForkedHit: a sequence started on a hit maps the entry's
// granules, and so do a fork and a frozen prefix of it, after the hit closes. Those
// mappings keep the entry's granules live: a miss must not hand the entry's ranges to a
// new sequence (whose writes would reach the fork's and the prefix's tokens), nor count
// on their eviction giving memory back: the miss takes b, the entry that does.
func TestPrefixCacheMissSparesForkedHit(t *testing.T) {
	const p = 64
	for _, layout := range layouts {
		for _, how := range []string{"fork", "freeze"} {
			t.Run(layout.String()+"/"+how, func(t *testing.T) {
				x := entryBytes(t, layout, p)

				e := openEnv(t, withLimit(2*x+x/2), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))

				c, pc := e.c, e.pc
				a, b, cc := promptIDs(0, p), promptIDs(1000, p), promptIDs(2000, p)
				for _, ids := range [][]int32{a, b} {
					s, _, err := serve(pc, ids)
					require.NoError(t, err)
					require.True(t, s.Close().OK())
				}
				q, m, err := pc.Lookup(append(a[:p:p], -1))
				require.NoError(t, err)
				require.Equal(t, p, m)
				var held *kv.Sequence // maps a's granules through q
				switch how {
				case "fork":
					held, err = q.Fork()
					require.NoError(t, err)
				case "freeze":
					pr, err := q.Freeze(p)
					require.NoError(t, err)
					held, err = c.NewSequenceFrom(pr)
					require.NoError(t, err)
					pr.Release()
				}
				require.True(t, q.Close().OK())
				// b was hit after a: a is the least recently used entry.
				q, m, err = pc.Lookup(append(b[:p:p], -1))
				require.NoError(t, err)
				require.Equal(t, p, m)
				require.True(t, q.Close().OK())

				s, m, err := pc.Lookup(cc)
				require.NoError(t, err)
				require.Zero(t, m)
				require.NoError(t, s.Append(p))
				require.NoError(t, writeIDs(s, cc, 0, p))
				assert.NoError(t, checkIDs(held, a, 0, p), "the new sequence wrote into a's granules")
				require.True(t, s.Close().OK())
				q, m, err = pc.Lookup(append(a[:p:p], -1))
				require.NoError(t, err)
				assert.Equal(t, p, m, "b, whose eviction gives memory back, went rather than a")
				assert.NoError(t, checkIDs(q, a, 0, m))
				require.True(t, q.Close().OK())
				require.True(t, held.Close().OK())
			})
		}
	}
}

// TestPrefixCacheTakenOverSurvivesFailedBatch: a batch step that fails midway rolls
// back only the sequences it grew. A sequence that took over an entry's ranges holds
// granules past its tokens and needs none for its growth: the failed step must leave
// them as they were (AppendBatch changes nothing when it fails).
func TestPrefixCacheTakenOverSurvivesFailedBatch(t *testing.T) {
	const p = 64
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			x := entryBytes(t, layout, p)

			e := openEnv(t, onFake, withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withLimit(3*x), withFaults)
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			for _, ids := range [][]int32{promptIDs(0, p), promptIDs(1000, p)} {
				s, _, err := serve(pc, ids)
				require.NoError(t, err)
				require.True(t, s.Close().OK())
			}
			other, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, other.Append(1))
			s, m, err := pc.Lookup(promptIDs(2000, p))
			require.NoError(t, err)
			require.Zero(t, m)
			require.Equal(t, x, committedOf(t, e.c, s), "a miss took over an entry's ranges")

			boom := errors.New("injected")
			e.faults.FailOp(backingtest.OpCommit, 1, boom)
			err = e.c.AppendBatch([]kv.Growth{{Seq: s, Tokens: p}, {Seq: other, Tokens: p}})
			require.ErrorIs(t, err, boom)
			e.faults.Reset()
			assert.Zero(t, s.Len())
			assert.Equal(t, x, committedOf(t, e.c, s), "the failed step gave back granules of a sequence it did not grow")
			require.NoError(t, s.Append(p))
			require.NoError(t, writeIDs(s, promptIDs(2000, p), 0, p))
			require.True(t, s.Close().OK())
			require.True(t, other.Close().OK())
			require.NoError(t, pc.Close())
			e.finish(t)
		})
	}
}

// TestPrefixCacheConcurrentForks serves from many goroutines under a tight budget
// (misses take entries over, growths evict) while some requests fork their sequence
// and keep the fork past the original's Close: a fork's tokens, which map the cache's
// granules, must read back intact until it closes, and the ledger is exact at the end.
func TestPrefixCacheConcurrentForks(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			const limit = 160 * fakeGranule
			e := openEnv(t, withLimit(limit), withConfig(kv.Config{MaxTokens: 128, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			c, pc := e.c, e.pc
			var ps sharedStream
			goWorkers(6, func(w int) (err error) {
				type kept struct {
					f   *kv.Sequence
					ids []int32
				}
				var forks []kept
				release := func(k kept) error {
					err := checkIDs(k.f, k.ids, 0, k.f.Len())
					if out := k.f.Close(); !out.OK() && err == nil {
						err = out.Err
					}
					return err
				}
				defer func() {
					for _, k := range forks {
						err = errors.Join(err, release(k))
					}
				}()
				r := rand.New(rand.NewPCG(uint64(w), 29))
				for range 50 {
					ids := ps.next(r, 100)
					if len(forks) > 1 || len(forks) > 0 && r.IntN(3) == 0 {
						k := forks[0]
						forks = forks[1:]
						if err := release(k); err != nil {
							return err
						}
					}
					s, _, err := serve(pc, ids)
					if errors.Is(err, accounting.ErrBudgetExceeded) {
						continue
					}
					if err != nil {
						return err
					}
					if r.IntN(2) == 0 {
						f, err := s.ForkAt(r.IntN(s.Len() + 1))
						if err == nil {
							forks = append(forks, kept{f, ids})
						} else if !errors.Is(err, accounting.ErrBudgetExceeded) {
							return err
						}
					}
					if out := s.Close(); !out.OK() {
						return out.Err
					}
				}
				return nil
			})(t)
			st := pc.Stats()
			assert.Zero(t, st.PinnedBytes, "no live sequence maps the cache")
			assert.Equal(t, st.CachedBytes, e.auth.Stats().Owned, "the ledger holds exactly the cache")
			require.NoError(t, pc.Close())
			assert.Equal(t, kv.Stats{}, holdings(c))
		})
	}
}

// entryBytes returns the bytes a prefix cache holds for one prompt of p tokens under
// layout, measured on a cache of its own with no budget to speak of.
func entryBytes(t *testing.T, layout kv.Layout, p int) int64 {
	t.Helper()
	probe := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{})).pc
	s, _, err := serve(probe, promptIDs(0, p))
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	return probe.Stats().CachedBytes
}
