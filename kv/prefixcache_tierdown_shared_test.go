//go:build linux || windows

package kv_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// The cases in which cached blocks leave the device other than by a whole owned leaf's
// eviction (prefixcache_tier_shared_test.go has that one): a leaf shortened, a lazy
// entry evicted while its origin lives, an entry a miss takes over, and Close; then
// write-through and the reuse threshold.

// tierValues returns how many values tier holds.
func tierValues(t *testing.T, tier kv.Tier) int {
	t.Helper()
	switch x := tier.(type) {
	case *tiertest.Map:
		return x.Len()
	case *hosttier.Tier:
		return x.Stats().Values
	}
	require.FailNow(t, "a tier the tests can not count", "%T", tier)
	return 0
}

// blockTokens returns c's block size in tokens.
func blockTokens(t *testing.T, c *kv.Cache) (tpb, stride int) {
	t.Helper()
	s, err := c.NewSequence()
	require.NoError(t, err)
	tpb, stride = s.BlockTokens(), s.BlockStride()
	require.True(t, s.Close().OK())
	return tpb, stride
}

// readBack looks ids up and checks that the sequence starts on want tokens, each the
// one written, and goes on from there as after a local hit.
func readBack(t *testing.T, pc *kv.PrefixCache, ids []int32, want int) {
	t.Helper()
	q, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	assert.Equal(t, want, m)
	require.NoError(t, checkIDs(q, ids, 0, m))
	require.NoError(t, q.Append(len(ids)-m))
	require.NoError(t, writeIDs(q, ids, m, len(ids)))
	require.NoError(t, checkIDs(q, ids, 0, len(ids)))
	require.True(t, q.Close().OK())
}

// eachBackendAndTier runs f on host.Shared and the CUDA fake, with each tier kind.
func eachBackendAndTier(t *testing.T, f func(t *testing.T, c *kv.Cache, tier kv.Tier)) {
	for _, be := range tierBackends {
		for _, tk := range tierKinds {
			t.Run(be.name+"/"+tk.name, func(t *testing.T) {
				f(t, openEnv(t, be.kind, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c, tk.make(t))
			})
		}
	}
}

// TestPrefixCacheTierShortenedLeaf: a leaf whose first blocks a live sequence maps is
// only shortened by eviction; the blocks cut off go down all the same, and a lookup
// finds the kept ones locally and loads the rest.
func TestPrefixCacheTierShortenedLeaf(t *testing.T) {
	eachBackendAndTier(t, func(t *testing.T, c *kv.Cache, tier kv.Tier) {
		pc := newTierCache(t, c, tier)
		tpb, blk := blockTokens(t, c)
		ids := promptIDs(21, 4*tpb+1)
		live, m := liveHit(t, pc, ids, 2*tpb)
		_, err := pc.Evict(1 << 40)
		require.NoError(t, err)
		assert.EqualValues(t, 2*tpb, pc.Stats().CachedTokens, "shortened to what the live hit maps")
		assert.Equal(t, 2, tierValues(t, tier), "the two whole blocks cut off")
		st := pc.Stats().Tiers[0]
		assert.EqualValues(t, 2*tierval.Size(tpb, blk), st.StoreBytes)
		assert.Zero(t, st.Drops)
		require.NoError(t, checkIDs(live, ids, 0, m), "the live hit's tokens are as written")
		require.True(t, live.Close().OK())
		readBack(t, pc, ids, 4*tpb)
		assert.EqualValues(t, 2*tpb, pc.Stats().Tiers[0].Hits)
	})
}

// liveHit serves ids (the entry takes the closed sequence's ranges over) and returns
// a live hit on their first n tokens, which holds those granules on the device.
func liveHit(t *testing.T, pc *kv.PrefixCache, ids []int32, n int) (*kv.Sequence, int) {
	t.Helper()
	s, _, err := serve(pc, ids)
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	live, m, err := pc.Lookup(ids[:n+1])
	require.NoError(t, err)
	require.Equal(t, n, m)
	return live, m
}

// lazyEvicted serves ids under a cap of two blocks, so that the lazy entry is cut to
// its first two blocks while s, its origin, lives; it returns s.
func lazyEvicted(t *testing.T, c *kv.Cache, tier kv.Tier, ids []int32) (*kv.PrefixCache, *kv.Sequence) {
	t.Helper()
	_, blk := blockTokens(t, c)
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
		Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: time.Minute, MaxBytes: 2 * int64(blk),
	})
	require.NoError(t, err)
	s, _, err := serve(pc, ids)
	require.NoError(t, err)
	st := pc.Stats()
	require.EqualValues(t, 2*blk, st.CachedBytes, "the cap cut the lazy entry")
	assert.Zero(t, tierValues(t, tier), "its origin still maps the blocks cut off: none went down yet")
	return pc, s
}

// TestPrefixCacheTierLazyEvicted: the blocks of a lazy entry that eviction cut while
// its origin lived go down when that memory does come back: the origin closes (off
// its Close, in the background), truncates below them (before the truncate), or the
// prefix cache closes first (Close writes them from the origin's ranges).
func TestPrefixCacheTierLazyEvicted(t *testing.T) {
	t.Run("origin closes", func(t *testing.T) {
		eachBackendAndTier(t, func(t *testing.T, c *kv.Cache, tier kv.Tier) {
			tpb, _ := blockTokens(t, c)
			ids := promptIDs(31, 4*tpb+1)
			pc, s := lazyEvicted(t, c, tier, ids)
			defer func() { assert.NoError(t, pc.Close()) }()
			require.True(t, s.Close().OK())
			require.Eventually(t, func() bool { return tierValues(t, tier) == 2 }, time.Minute, time.Millisecond,
				"blocks 2 and 3 go down once the origin closed")
			readBack(t, pc, ids, 4*tpb)
			assert.EqualValues(t, 2*tpb, pc.Stats().Tiers[0].Hits)
		})
	})
	t.Run("origin truncates", func(t *testing.T) {
		eachBackendAndTier(t, func(t *testing.T, c *kv.Cache, tier kv.Tier) {
			tpb, _ := blockTokens(t, c)
			ids := promptIDs(41, 4*tpb+1)
			pc, s := lazyEvicted(t, c, tier, ids)
			defer func() { assert.NoError(t, pc.Close()) }()
			require.NoError(t, s.Truncate(tpb+1))
			assert.Equal(t, 2, tierValues(t, tier), "written before the truncate gave them up")
			// s writes other tokens where the cut blocks were: the tier keeps the old.
			other := append(append([]int32(nil), ids[:tpb+1]...), promptIDs(9000, 3*tpb)...)
			require.NoError(t, s.Append(len(other)-s.Len()))
			require.NoError(t, writeIDs(s, other, s.Writable(), len(other)))
			require.True(t, s.Close().OK())
			readBack(t, pc, ids, 4*tpb)
		})
	})
	t.Run("Close", func(t *testing.T) {
		eachBackendAndTier(t, func(t *testing.T, c *kv.Cache, tier kv.Tier) {
			tpb, _ := blockTokens(t, c)
			ids := promptIDs(51, 4*tpb+1)
			pc, s := lazyEvicted(t, c, tier, ids)
			require.NoError(t, pc.Close())
			assert.Equal(t, 4, tierValues(t, tier), "the cut blocks, and the entry's two Close evicted")
			require.True(t, s.Close().OK())
			readBack(t, newTierCache(t, c, tier), ids, 4*tpb)
		})
	})
}

// TestPrefixCacheTierTakenOver: a miss that takes over the least recently used
// entry's ranges writes that entry's blocks down before the new sequence writes over
// them.
func TestPrefixCacheTierTakenOver(t *testing.T) {
	for _, be := range []struct {
		name string
		make func(t *testing.T, limit int64) *kv.Cache
	}{
		{"host.Shared", func(t *testing.T, limit int64) *kv.Cache {
			return openEnv(t, onShared, withGranule(64<<10), withLimit(limit), withConfig(kv.Config{Model: tiny8, MaxTokens: 512})).c
		}},
		{"cuda fake", func(t *testing.T, limit int64) *kv.Cache {
			e := openEnv(t, onCUDA, withGranule(64<<10), withLimit(limit), withConfig(kv.Config{Model: tiny8, MaxTokens: 512, Layout: kv.Blocked}))
			return e.c
		}},
	} {
		for _, tk := range tierKinds {
			t.Run(be.name+"/"+tk.name, func(t *testing.T) {
				probe := be.make(t, 1<<30)
				tpb, blk := blockTokens(t, probe)
				// Two prompts of two blocks each fit; a third does not.
				c := be.make(t, 5*int64(blk))
				tier := tk.make(t)
				pc := newTierCache(t, c, tier)
				a, b, cc := promptIDs(0, 2*tpb), promptIDs(1000, 2*tpb), promptIDs(2000, 2*tpb)
				for _, ids := range [][]int32{a, b} {
					s, _, err := serve(pc, ids)
					require.NoError(t, err)
					require.True(t, s.Close().OK())
				}
				s, m, err := pc.Lookup(cc)
				require.NoError(t, err)
				require.Zero(t, m)
				st := pc.Stats()
				require.Equal(t, 1, st.Entries, "cc took a's ranges over")
				assert.Equal(t, 2, tierValues(t, tier), "a's two whole blocks went down first")
				require.NoError(t, s.Append(len(cc)))
				require.NoError(t, writeIDs(s, cc, 0, len(cc)))
				require.True(t, s.Close().OK())
				_, err = pc.Evict(1 << 40)
				require.NoError(t, err)
				// a's blocks come back from the tier, as written before cc's prefill
				// wrote over their granules.
				readBack(t, pc, append(a[:len(a):len(a)], -1), 2*tpb)
			})
		}
	}
}

// TestPrefixCacheTierClose: Close writes every entry it evicts down, each block of
// the index once however many entries share it, and a prefix cache made later reads
// them all back.
func TestPrefixCacheTierClose(t *testing.T) {
	eachBackendAndTier(t, func(t *testing.T, c *kv.Cache, tier kv.Tier) {
		tpb, _ := blockTokens(t, c)
		pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: time.Minute})
		require.NoError(t, err)
		// Three prompts sharing their first block (one of them half of the next):
		// 1 + 2 + 2 + 2 distinct whole blocks below their last tokens.
		base := promptIDs(0, tpb)
		prompts := [][]int32{
			append(append([]int32(nil), base...), promptIDs(1000, 2*tpb+1)...),
			append(append([]int32(nil), base...), promptIDs(2000, 2*tpb+1)...),
			append(append(append([]int32(nil), base...), promptIDs(1000, tpb/2)...), promptIDs(3000, 2*tpb)...),
		}
		for _, ids := range prompts {
			s, _, err := serve(pc, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
		}
		require.NoError(t, pc.Close())
		assert.Equal(t, 7, tierValues(t, tier))
		st := pc.Stats().Tiers[0]
		assert.Zero(t, st.Drops)
		pc2 := newTierCache(t, c, tier)
		for _, ids := range prompts {
			readBack(t, pc2, ids, 3*tpb)
		}
	})
}

// TestPrefixCacheTierCloseBounded: Close's stores, all of them together, end within
// TierWait when a tier does not answer: Close finishes, the stores are counted drops,
// and every granule comes back (the backends' cleanups check the ledgers).
func TestPrefixCacheTierCloseBounded(t *testing.T) {
	for _, be := range tierBackends {
		t.Run(be.name, func(t *testing.T) {
			c := openEnv(t, be.kind, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
			tpb, _ := blockTokens(t, c)
			pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
				Tiers: []kv.Tier{stalledStores{tiertest.NewMap(4 << 20)}}, TierWait: 10 * time.Millisecond,
			})
			require.NoError(t, err)
			for i := range 4 {
				s, _, err := serve(pc, promptIDs(1000*i, 3*tpb+1))
				require.NoError(t, err)
				require.True(t, s.Close().OK())
			}
			require.NoError(t, pc.Close())
			assert.EqualValues(t, 12, pc.Stats().Tiers[0].Drops, "four entries' three blocks, each dropped")
		})
	}
}

// stalledStores is a tier whose stores wait until their context ends.
type stalledStores struct{ *tiertest.Map }

func (stalledStores) Store(ctx context.Context, _ tierval.Key, _ int, _ func([]byte) error) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestPrefixCacheTierWriteThrough: with TierWriteThrough an entry's blocks go down
// once the cache holds them in ranges of its own, with nothing evicted, and eviction
// then stores nothing again; a lookup after the eviction reads them back.
func TestPrefixCacheTierWriteThrough(t *testing.T) {
	eachBackendAndTier(t, func(t *testing.T, c *kv.Cache, tier kv.Tier) {
		tpb, blk := blockTokens(t, c)
		pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
			Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: time.Minute, TierWriteThrough: true,
		})
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, pc.Close()) })
		ids := promptIDs(61, 3*tpb+2)
		s, _, err := serve(pc, ids)
		require.NoError(t, err)
		assert.Zero(t, tierValues(t, tier), "lazy: the inserted sequence still maps them")
		require.True(t, s.Close().OK())
		// A store is counted once it returned, a moment after the tier holds its
		// value: wait for both, or the count read may miss the last store.
		size := int64(tierval.Size(tpb, blk))
		require.Eventually(t, func() bool {
			return tierValues(t, tier) == 3 && pc.Stats().Tiers[0].StoreBytes >= 3*size
		}, time.Minute, time.Millisecond)
		assert.EqualValues(t, int64(3*tpb+2), pc.Stats().CachedTokens, "nothing was evicted")
		stored := pc.Stats().Tiers[0].StoreBytes
		assert.Equal(t, 3*size, stored, "three blocks, once each")
		// The entry is busy until its write-through ended (just after its stores).
		require.Eventually(t, func() bool {
			_, err := pc.Evict(1 << 40)
			return err == nil && pc.Stats().CachedTokens == 0
		}, time.Minute, time.Millisecond)
		assert.Equal(t, stored, pc.Stats().Tiers[0].StoreBytes, "stored through already: not again")
		readBack(t, pc, ids, 3*tpb)
	})
}

// TestPrefixCacheTierMinHits: under a reuse threshold only the entries hit that many
// times go down, by write-back, and with write-through once the count is reached.
func TestPrefixCacheTierMinHits(t *testing.T) {
	for _, through := range []bool{false, true} {
		t.Run(fmt.Sprintf("through=%v", through), func(t *testing.T) {
			c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
			tier := tiertest.NewMap(4 << 20)
			tpb, _ := blockTokens(t, c)
			pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
				Tiers: []kv.Tier{tier}, TierWait: time.Minute, TierWriteThrough: through, TierMinHits: 2,
			})
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, pc.Close()) })
			cold, warm := promptIDs(0, 2*tpb+1), promptIDs(5000, 2*tpb+1)
			for _, ids := range [][]int32{cold, warm} {
				s, _, err := serve(pc, ids)
				require.NoError(t, err)
				require.True(t, s.Close().OK())
			}
			for hit := range 2 {
				q, m, err := pc.Lookup(warm)
				require.NoError(t, err)
				require.Equal(t, 2*tpb, m)
				require.True(t, q.Close().OK())
				if through {
					if hit == 0 {
						assert.Zero(t, tierValues(t, tier), "one hit is below the threshold")
					} else {
						require.Eventually(t, func() bool { return tier.Len() == 2 }, time.Minute, time.Millisecond,
							"the second hit reaches it: written through")
					}
				}
			}
			q, _, err := pc.Lookup(cold)
			require.NoError(t, err)
			require.True(t, q.Close().OK())     // one hit: still below
			require.Eventually(t, func() bool { // warm is busy until its write-through ended
				_, err := pc.Evict(1 << 40)
				return err == nil && pc.Stats().CachedTokens == 0
			}, time.Minute, time.Millisecond)
			assert.Equal(t, 2, tier.Len(), "only warm's blocks")
			readBack(t, pc, warm, 2*tpb)
			readBack(t, pc, cold, 0)
		})
	}
}

// TestPrefixCacheTierPolicyOptions: bad write-through and threshold options are
// refused with ErrConfig, and the defaults are write-back only, every block.
func TestPrefixCacheTierPolicyOptions(t *testing.T) {
	c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
	for _, o := range []kv.PrefixCacheOptions{
		{Tiers: []kv.Tier{tiertest.NewMap(0)}, TierMinHits: -1},
		{TierMinHits: 2},         // no tier to store into
		{TierWriteThrough: true}, // nor here
	} {
		_, err := kv.NewPrefixCache(c, o)
		assert.ErrorIs(t, err, kv.ErrConfig, "%+v", o)
	}
	for _, o := range []kv.PrefixCacheOptions{
		{Tiers: []kv.Tier{tiertest.NewMap(0)}, TierMinHits: 1, TierWriteThrough: true},
		{Tiers: []kv.Tier{tiertest.NewMap(0)}},
	} {
		pc, err := kv.NewPrefixCache(c, o)
		require.NoError(t, err)
		require.NoError(t, pc.Close())
	}
}

// TestPrefixCacheTierConcurrentDown: lookups, inserts, truncations of inserted
// sequences, evictions and a cap at once, write-through on, into the host tier and a
// second tier below it: every token a lookup hands out is the one written, and at the
// end both ledgers balance, the device's (the backends' cleanups) and the host
// tier's.
func TestPrefixCacheTierConcurrentDown(t *testing.T) {
	for _, be := range tierBackends {
		for _, through := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/through=%v", be.name, through), func(t *testing.T) {
				c := openEnv(t, be.kind, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
				tpb, blk := blockTokens(t, c)
				gov := accounting.NewGovernor()
				hostAuth := gov.Authority("host tier", accounting.DeviceKey{Tier: accounting.HostTier})
				ht, err := hosttier.New(hosttier.Options{Budget: 64 << 20, Authority: hostAuth})
				require.NoError(t, err)
				m := tiertest.NewMap(4 << 20)
				pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
					Tiers: []kv.Tier{ht, m}, MaxBytes: 6 * int64(blk), TierWait: time.Minute, TierWriteThrough: through,
				})
				require.NoError(t, err)
				prompts := make([][]int32, 8)
				for i := range prompts {
					prompts[i] = append(promptIDs(0, tpb+i%3), promptIDs(1000*(i+1), 2*tpb+i)...)
				}
				tierWorkers(t, pc, prompts, 10, 7, func(r *rand.Rand, s *kv.Sequence, ids []int32) error {
					if r.IntN(3) == 0 {
						// Into the inserted tokens: the origin gives blocks up.
						n := r.IntN(len(ids))
						if err := s.Truncate(n); err != nil {
							return err
						}
						if err := s.Append(len(ids) - n); err != nil {
							return err
						}
						if err := writeIDs(s, ids, s.Writable(), len(ids)); err != nil {
							return err
						}
						if err := checkIDs(s, ids, 0, len(ids)); err != nil {
							return err
						}
					}
					if r.IntN(4) == 0 {
						_, err := pc.Evict(int64(blk))
						return err
					}
					return nil
				})
				require.NoError(t, pc.Close())
				st := pc.Stats()
				assert.Positive(t, st.Tiers[0].StoreBytes)
				assert.Positive(t, st.Tiers[0].Hits+st.Tiers[1].Hits)
				assert.Zero(t, st.Tiers[0].Invalid+st.Tiers[1].Invalid)
				// What the closed prefix cache left in the tiers reads back right.
				pc2 := newTierCache(t, c, ht, m)
				for _, ids := range prompts {
					q, got, err := pc2.Lookup(ids)
					require.NoError(t, err)
					assert.NoError(t, checkIDs(q, ids, 0, got))
					require.True(t, q.Close().OK())
				}
				require.NoError(t, pc2.Close())
				require.NoError(t, ht.Close())
				assert.Zero(t, hostAuth.Stats().Owned, "the host tier's ledger: owned bytes left")
				assert.Zero(t, hostAuth.Stats().Mapped, "the host tier's ledger: mappings left")
			})
		}
	}
}

// tierWorkers runs four workers on pc at once, each serving rounds prompts drawn at
// random (seed tells the runs apart) and checking every token of each; more, when
// set, runs on each served sequence before it closes. It fails t with what they
// report.
func tierWorkers(t *testing.T, pc *kv.PrefixCache, prompts [][]int32, rounds int, seed uint64, more func(r *rand.Rand, s *kv.Sequence, ids []int32) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), seed))
			for range rounds {
				ids := prompts[r.IntN(len(prompts))]
				s, m, err := serve(pc, ids)
				if err != nil {
					errs <- fmt.Errorf("serve: %w", err)
					return
				}
				err = checkIDs(s, ids, 0, len(ids))
				if err == nil && more != nil {
					err = more(r, s, ids)
				}
				s.Close()
				if err != nil {
					errs <- fmt.Errorf("hit of %d: %w", m, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
}

// TestPrefixCacheTierHolderFails: when the granules of blocks a shortened leaf cuts
// off can not be mapped for their copy (a backing fault), those blocks are counted
// drops, the shrink goes on, the kept blocks still serve lookups, and the ledger
// balances (the env's cleanup).
func TestPrefixCacheTierHolderFails(t *testing.T) {
	for _, op := range []backingtest.Op{backingtest.OpReserve, backingtest.OpShare} {
		t.Run(op.String(), func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withFaults, withConfig(kv.Config{MaxTokens: 512, Layout: kv.Blocked}))
			c, faulty := e.c, e.faults
			tier := tiertest.NewMap(4 << 20)
			pc := newTierCache(t, c, tier)
			tpb, _ := blockTokens(t, c)
			ids := promptIDs(71, 4*tpb+1)
			live, _ := liveHit(t, pc, ids, 2*tpb)
			drops := pc.Stats().Tiers[0].Drops
			faulty.FailOp(op, 1, errInjectedTier)
			_, err := pc.Evict(1 << 40)
			require.NoError(t, err)
			faulty.Reset()
			assert.EqualValues(t, 2*tpb, pc.Stats().CachedTokens, "shortened all the same")
			assert.Zero(t, tier.Len())
			assert.EqualValues(t, drops+int64(len(ids)/tpb-2), pc.Stats().Tiers[0].Drops, "the whole blocks cut off")
			require.True(t, live.Close().OK())
			readBack(t, pc, ids, 2*tpb)
		})
	}
}

var errInjectedTier = errors.New("injected fault")
