package kv_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// writeIDs writes tokens [from, to) of s, each with its token ID's pattern: a token's
// K and V depend on its ID and position, as a model's do on the prefix.
func writeIDs(s *kv.Sequence, ids []int32, from, to int) error {
	for p := from; p < to; p++ {
		if err := tryWrite(s, uint64(ids[p]), p, p+1); err != nil {
			return err
		}
	}
	return nil
}

// checkIDs checks tokens [from, to) of s against writeIDs's patterns.
func checkIDs(s *kv.Sequence, ids []int32, from, to int) error {
	for p := from; p < to; p++ {
		if err := tryCheck(s, uint64(ids[p]), p, p+1); err != nil {
			return err
		}
	}
	return nil
}

// prefilled returns a sequence started by pc.Lookup(ids) on nothing cached, with all
// of ids appended and written (writeIDs), not inserted.
func prefilled(t *testing.T, pc *kv.PrefixCache, ids []int32) *kv.Sequence {
	t.Helper()
	s, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	require.Zero(t, m, "nothing of ids is cached yet")
	require.NoError(t, s.Append(len(ids)))
	require.NoError(t, writeIDs(s, ids, 0, len(ids)))
	return s
}

// serve is one request: look the prompt up, check what came from the cache, prefill
// the rest, insert. The sequence is left open.
func serve(pc *kv.PrefixCache, ids []int32) (*kv.Sequence, int, error) {
	s, m, err := pc.Lookup(ids)
	if err != nil {
		return nil, 0, err
	}
	err = checkIDs(s, ids, 0, m)
	if err == nil {
		err = s.Append(len(ids) - m)
	}
	if err == nil {
		err = writeIDs(s, ids, m, len(ids))
	}
	if err == nil {
		err = pc.Insert(s, ids)
	}
	if err != nil {
		s.Close()
		return nil, 0, err
	}
	return s, m, nil
}

// stream returns a token string that shares a random prefix of one already made,
// over a small vocabulary so that accidental matches happen too.
func stream(r *rand.Rand, made [][]int32, maxLen int) []int32 {
	var out []int32
	if len(made) > 0 && r.IntN(4) > 0 {
		base := made[r.IntN(len(made))]
		out = append(out, base[:r.IntN(len(base)+1)]...)
	}
	for range 1 + r.IntN(24) {
		out = append(out, int32(r.IntN(3)))
	}
	return out[:min(len(out), maxLen)]
}

// sharedStream is the prompts of workers that serve one prefix cache: each next
// prompt may share a prefix with any worker's earlier one.
type sharedStream struct {
	mu   sync.Mutex
	made [][]int32
}

// next returns stream's next prompt of up to maxLen IDs, and keeps it.
func (p *sharedStream) next(r *rand.Rand, maxLen int) []int32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	ids := stream(r, p.made, maxLen)
	p.made = append(p.made, ids)
	return ids
}

func commonLen(a, b []int32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// TestPrefixCacheLongestMatch checks every lookup against a naive model, the list of
// inserted prompts, with no memory pressure: the match is the longest common prefix
// with any of them, short of the prompt's last token, and its K/V are those written
// for those tokens (mapped whole granules and copied tails alike).
func TestPrefixCacheLongestMatch(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			const maxTokens = 96
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: maxTokens, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			c, pc := e.c, e.pc
			r := rand.New(rand.NewPCG(7, uint64(layout)))
			var made [][]int32
			var queries, hits int64
			for i := range 150 {
				ids := stream(r, made, maxTokens)
				want := 0
				for _, p := range made {
					want = max(want, min(commonLen(p, ids), len(ids)-1))
				}
				s, m, err := serve(pc, ids)
				require.NoError(t, err, "request %d", i)
				require.Equal(t, want, m, "request %d", i)
				queries += int64(len(ids))
				hits += int64(m)
				if r.IntN(3) == 0 {
					// Decoding goes on after the insert: the tail stays writable.
					require.NoError(t, s.Append(1))
					require.NoError(t, writeIDs(s, append(ids, 1), len(ids), len(ids)+1))
				}
				if r.IntN(4) == 0 {
					// A rollback into the cached tokens: the entry keeps its own
					// mapping of them when s closes, rather than taking s's ranges.
					require.NoError(t, s.Truncate(r.IntN(s.Len()+1)))
				}
				require.True(t, s.Close().OK())
				made = append(made, ids)
			}
			st := pc.Stats()
			assert.Equal(t, queries, st.Queries)
			assert.Equal(t, hits, st.Hits)
			assert.Zero(t, st.EvictedTokens)
			assert.Zero(t, st.PinnedBytes, "no pin, no live sequence")
			assert.Positive(t, st.CachedBytes)
			assert.Equal(t, st.CachedBytes, c.Stats().Owned, "with no live sequence, the ledger holds just the cache")
			assert.Equal(t, kv.Stats{Owned: st.CachedBytes, Mapped: c.Stats().Mapped}, c.Stats(), "entries are not sequences")
		})
	}
}

// TestPrefixCacheEvictionSparesLiveSequences fills the budget with cached prompts and
// live sequences started on them, then makes a new sequence need the whole rest of
// the budget: eviction gives back every cached granule no live sequence maps, and
// none that one does (their K/V stay intact, and the ledger still holds them).
func TestPrefixCacheEvictionSparesLiveSequences(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			const limit = 256 * fakeGranule
			e := openEnv(t, withLimit(limit), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{}))
			c, pc := e.c, e.pc
			var live []*kv.Sequence
			var prompts [][]int32
			for i := range 4 {
				ids := make([]int32, 40)
				for j := range ids {
					ids[j] = int32(100*i + j)
				}
				s, _, err := serve(pc, ids)
				require.NoError(t, err)
				require.True(t, s.Close().OK())
				prompts = append(prompts, ids)
			}
			// Two live sequences map parts of prompts 0 and 1.
			for i := range 2 {
				s, m, err := pc.Lookup(append(prompts[i][:30:30], -1))
				require.NoError(t, err)
				require.Equal(t, 30, m)
				live = append(live, s)
			}
			before := pc.Stats()
			require.Positive(t, before.PinnedBytes, "live sequences pin what they map")
			require.Less(t, before.PinnedBytes, before.CachedBytes)

			// Ask for everything that is not held by a live sequence.
			var liveBytes int64
			for _, ss := range c.SequenceStats() {
				liveBytes += ss.Committed
			}
			big, err := c.NewSequence()
			require.NoError(t, err)
			avail := limit - e.auth.Stats().Owned + before.CachedBytes - before.PinnedBytes
			row := int64(tiny8.BytesPerToken())
			n := int(avail / row)
			for n > 0 && big.Append(n) != nil {
				n--
			}
			require.Positive(t, n)
			after := pc.Stats()
			assert.Positive(t, after.EvictedBytes)
			assert.Equal(t, after.EvictedBytes, before.CachedBytes-after.CachedBytes-(before.PinnedBytes-after.PinnedBytes),
				"every evicted granule came back but those live sequences map")
			for i, s := range live {
				require.NoError(t, checkIDs(s, prompts[i], 0, 30), "a live sequence lost K/V to eviction")
			}
			assert.GreaterOrEqual(t, e.auth.Stats().Owned, liveBytes, "the live sequences' granules are still owned")
			require.True(t, big.Close().OK())
			for _, s := range live {
				require.True(t, s.Close().OK())
			}
		})
	}
}

// TestPrefixCachePinAndCap: MaxBytes caps what the cache holds, evicting the least
// recently used first, and a pinned prefix is never evicted, by the cap or by the
// budget, until its pin is released.
func TestPrefixCachePinAndCap(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: kv.PerLayer}), withPrefixCache(kv.PrefixCacheOptions{MaxBytes: 3 * 2 * int64(tiny8.Layers) * 5 * fakeGranule}))
	c, pc := e.c, e.pc
	system := make([]int32, 16) // two granules per range
	for j := range system {
		system[j] = int32(9000 + j)
	}
	s, _, err := serve(pc, append(system, 1))
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	pin, err := pc.Pin(system)
	require.NoError(t, err)
	assert.Equal(t, 16, pin.Len())
	for i := range 12 {
		ids := append(append([]int32{}, system...), make([]int32, 24)...)
		for j := 16; j < len(ids); j++ {
			ids[j] = int32(i*100 + j)
		}
		s, m, err := serve(pc, ids)
		require.NoError(t, err)
		assert.GreaterOrEqual(t, m, 16, "the pinned system prompt is always found")
		require.True(t, s.Close().OK())
		assert.LessOrEqual(t, pc.Stats().CachedBytes, int64(15*2*tiny8.Layers*fakeGranule), "request %d", i)
	}
	st := pc.Stats()
	assert.Positive(t, st.EvictedTokens)
	assert.Equal(t, int64(2*2*tiny8.Layers*fakeGranule), st.PinnedBytes)
	pin.Release()
	assert.PanicsWithValue(t, kv.PanicPinReleased, pin.Release)
	assert.Zero(t, pc.Stats().PinnedBytes)
	_ = c
}

// TestPrefixCacheReclaimer: a request anywhere on the device that waits for memory
// takes back cached prefixes through the governor's reclaimer.
func TestPrefixCacheReclaimer(t *testing.T) {
	const limit = 32 * fakeGranule
	e := openEnv(t, withLimit(limit), withConfig(kv.Config{MaxTokens: 256, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{}))
	pc := e.pc
	ids := make([]int32, 36)
	for j := range ids {
		ids[j] = int32(j)
	}
	s, _, err := serve(pc, ids)
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	cached := pc.Stats().CachedBytes
	require.Positive(t, cached)
	other := e.gov.Authority("other", accounting.HostKey)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	need := limit - e.auth.Stats().Owned + cached
	require.NoError(t, other.Acquire(ctx, need), "the waiter is served by evicting the cache")
	assert.Zero(t, pc.Stats().CachedBytes)
	other.Release(need)
}

func TestPrefixCacheBadInputs(t *testing.T) {
	_, err := kv.NewPrefixCache(nil, kv.PrefixCacheOptions{})
	assert.ErrorIs(t, err, kv.ErrConfig)

	gov := accounting.NewGovernor()
	auth := gov.Authority("buffers", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: fakeGranule})
	private, err := kv.New(f, kv.Config{Model: tiny8, MaxTokens: 64, Authority: auth})
	require.NoError(t, err)
	_, err = kv.NewPrefixCache(private, kv.PrefixCacheOptions{})
	assert.ErrorIs(t, err, kv.ErrNoSharing, "a backing that can not share is refused at construction")
	require.NoError(t, private.Close())

	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}))
	c := e.c
	_, err = kv.NewPrefixCache(c, kv.PrefixCacheOptions{MaxBytes: -1})
	assert.ErrorIs(t, err, kv.ErrConfig)
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	_, err = kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	assert.ErrorIs(t, err, kv.ErrConfig, "one prefix cache per cache")

	assert.PanicsWithValue(t, kv.PanicNilSequence, func() { _ = pc.Insert(nil, nil) })
	other := e.cache(t, kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens})
	foreign, err := other.NewSequence()
	require.NoError(t, err)
	assert.ErrorIs(t, pc.Insert(foreign, []int32{1}), kv.ErrConfig)
	require.True(t, foreign.Close().OK())

	s, m, err := pc.Lookup(nil)
	require.NoError(t, err, "an empty prompt matches nothing")
	assert.Zero(t, m)
	require.NoError(t, s.Append(3))
	require.NoError(t, pc.Insert(s, []int32{1, 2}), "tokens shorter than the sequence: the first ones")
	assert.ErrorIs(t, pc.Insert(s, []int32{1, 2, 3, 4, 5}), kv.ErrRange, "more tokens than the sequence holds")
	assert.Equal(t, int64(2), pc.Stats().InsertedTokens, "the refused insert changed nothing")
	require.NoError(t, pc.Insert(s, []int32{1, 2, 3}))
	s2, m, err := pc.Lookup([]int32{1, 2, 3, 9})
	require.NoError(t, err)
	assert.Equal(t, 3, m)
	require.True(t, s2.Close().OK())

	assert.ErrorContains(t, c.Close(), "PrefixCache", "the cache refuses to close under a live prefix cache")
	ledgers := func() (names []string) {
		for _, a := range e.gov.Stats(accounting.HostKey).Authorities {
			names = append(names, a.Name)
		}
		return names
	}
	assert.Contains(t, ledgers(), "kv prefix cache", "an open prefix cache has its ledger")
	require.NoError(t, pc.Close())
	assert.NotContains(t, ledgers(), "kv prefix cache", "a closed prefix cache leaves the governor's list")
	require.ErrorIs(t, pc.Close(), kv.ErrClosed, "a second Close changes nothing")
	_, _, err = pc.Lookup([]int32{1})
	assert.ErrorIs(t, err, kv.ErrClosed)
	assert.ErrorIs(t, pc.Insert(s, []int32{1}), kv.ErrClosed)
	_, err = pc.Pin([]int32{1})
	assert.ErrorIs(t, err, kv.ErrClosed)
	require.True(t, s.Close().OK())
}

// TestPrefixCacheConcurrent serves, evicts (under a tight budget and a cap), pins and
// closes from many goroutines at once; at the end the ledger is exact.
func TestPrefixCacheConcurrent(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			const limit = 160 * fakeGranule
			e := openEnv(t, withLimit(limit), withConfig(kv.Config{MaxTokens: 128, Layout: layout, BlockTokens: blockTokensFor(layout)}), withPrefixCache(kv.PrefixCacheOptions{MaxBytes: 100 * fakeGranule}))
			c, pc := e.c, e.pc
			var ps sharedStream
			goWorkers(8, func(w int) error {
				r := rand.New(rand.NewPCG(uint64(w), 11))
				for range 60 {
					ids := ps.next(r, 100)
					switch r.IntN(8) {
					case 0:
						pin, err := pc.Pin(ids)
						if err != nil {
							return err
						}
						pin.Release()
						continue
					}
					s, _, err := serve(pc, ids)
					if errors.Is(err, accounting.ErrBudgetExceeded) {
						continue // live sequences hold the budget: a refusal is honest
					}
					if err != nil {
						return err
					}
					if r.IntN(2) == 0 {
						time.Sleep(time.Duration(r.IntN(200)) * time.Microsecond)
					}
					if out := s.Close(); !out.OK() {
						return out.Err
					}
				}
				return nil
			})(t)
			st := pc.Stats()
			assert.LessOrEqual(t, st.CachedBytes, int64(100*fakeGranule))
			assert.Zero(t, st.PinnedBytes)
			assert.Equal(t, st.CachedBytes, e.auth.Stats().Owned, "the ledger holds exactly the cache")
			require.NoError(t, pc.Close())
			assert.Zero(t, e.auth.Stats().Owned)
			assert.Equal(t, kv.Stats{}, holdings(c))
		})
	}
}

// prefixScenario serves three prompts sharing a prefix, under a budget that makes the
// third evict, and closes everything; it returns the first error.
func prefixScenario(pc *kv.PrefixCache) (err error) {
	var open []*kv.Sequence
	defer func() {
		for _, s := range open {
			if out := s.Close(); out.Err != nil && err == nil {
				err = out.Err
			}
		}
	}()
	base := make([]int32, 20)
	for j := range base {
		base[j] = int32(j)
	}
	for i := range 3 {
		ids := append(append([]int32{}, base...), int32(100+i), int32(200+i), int32(300+i))
		for j := range 10 * i {
			ids = append(ids, int32(1000*i+j))
		}
		s, _, err := serve(pc, ids)
		if err != nil {
			return err
		}
		if i == 0 {
			open = append(open, s) // stays live: its granules are pinned
		} else if out := s.Close(); out.Err != nil {
			return out.Err
		}
	}
	return nil
}

// TestPrefixCacheFaultInjection fails every backing call of a scenario that inserts
// and evicts, one at a time: every failure surfaces or is absorbed, no K/V is
// corrupted, and once the cache is closed the ledger is exact.
func TestPrefixCacheFaultInjection(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, noCache, withLimit(1<<30), withFaults)
			row := int64(tiny8.BytesPerToken())
			run := func() error {
				c, err := e.tryCache(kv.Config{Model: tiny8, MaxTokens: 64, Layout: layout})
				if err != nil {
					return err
				}
				pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{MaxBytes: 80 * row})
				if err != nil {
					return err
				}
				err = prefixScenario(pc)
				return errors.Join(err, pc.Close(), c.Close())
			}
			require.NoError(t, run())
			calls := e.faults.Calls()
			require.Greater(t, calls, 20)
			failed := e.atEveryCall(t, calls, run, nil)
			assert.Greater(t, failed, calls/2, "most injected faults surface as errors")
		})
	}
}

// TestPrefixCacheStreamOnEachBacking serves prompts that share prefixes on each
// backing that shares, at 64 KiB granules, under a cap that makes it evict: on the
// CUDA backing over the fake driver K/V reach the device through the driver's copies,
// cached prefixes are driver handles mapped into many reservations, and eviction
// unmaps them; host.Shared maps memfd granules, backingtest.Fake its own.
func TestPrefixCacheStreamOnEachBacking(t *testing.T) {
	onEachSharing(t, []envOption{withGranule(64 << 10), withConfig(kv.Config{MaxTokens: 512})}, func(t *testing.T, e *env) {
		prefixCacheStream(t, e.c, e.c.Config().Layout)
	})
}

// prefixCacheStream serves 30 prompts on c that share prefixes, some of them rolled
// back into their cached tokens, under a 4 MiB cap.
func prefixCacheStream(t *testing.T, c *kv.Cache, layout kv.Layout) {
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{MaxBytes: 4 << 20})
	require.NoError(t, err)
	defer func() { assert.NoError(t, pc.Close()) }()
	r := rand.New(rand.NewPCG(5, uint64(layout)))
	var made [][]int32
	hits := 0
	for range 30 {
		ids := stream(r, made, 400)
		for len(ids) < 200 {
			ids = append(ids, int32(r.IntN(1000)))
		}
		s, m, err := serve(pc, ids)
		require.NoError(t, err)
		hits += m
		if r.IntN(4) == 0 {
			// A rollback into the cached tokens: the entry keeps its own
			// mapping of them when s closes, rather than taking s's ranges.
			require.NoError(t, s.Truncate(r.IntN(s.Len()+1)))
		}
		require.True(t, s.Close().OK())
		made = append(made, ids)
	}
	st := pc.Stats()
	assert.Equal(t, int64(hits), st.Hits)
	assert.Positive(t, st.Hits)
	assert.Positive(t, st.EvictedTokens, "the cap made it evict")
	assert.LessOrEqual(t, st.CachedBytes, int64(4<<20))
}

// TestPrefixCacheInsertFreezes: once inserted, a sequence's whole granules are shared
// with the cache, so WriteToken refuses them; the tail stays writable.
func TestPrefixCacheInsertFreezes(t *testing.T) {
	pc := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 128, Layout: kv.PerLayer}), withPrefixCache(kv.PrefixCacheOptions{})).pc
	ids := promptIDs(0, 20) // two whole granules per range, four tokens past them
	s, _, err := serve(pc, ids)
	require.NoError(t, err)
	assert.Equal(t, 16, s.Writable())
	assert.ErrorIs(t, tryWrite(s, 9, 0, 1), kv.ErrReadOnly)
	assert.NoError(t, tryWrite(s, 9, 16, 20), "the tail is the sequence's own")
	q, m, err := pc.Lookup(append(ids[:20:20], 99))
	require.NoError(t, err)
	defer q.Close()
	require.Equal(t, 20, m)
	require.NoError(t, checkIDs(q, ids, 0, 16), "the cached granules are as written before the insert")

	// A rollback past the shared granules and new tokens there: the entry, which takes
	// s's ranges over when s closes, still holds what was inserted.
	require.NoError(t, s.Truncate(17))
	require.NoError(t, s.Append(5))
	require.NoError(t, tryWrite(s, 7, 17, 22))
	require.True(t, s.Close().OK())
	r, m, err := pc.Lookup(append(ids[:20:20], 98))
	require.NoError(t, err)
	defer r.Close()
	require.Equal(t, 20, m)
	require.NoError(t, checkIDs(r, ids, 0, 20))
}

// TestPrefixCachePinSurvivesBudget: a pinned prefix stays cached when an append needs
// every other byte of the budget; the rest of the cache goes.
func TestPrefixCachePinSurvivesBudget(t *testing.T) {
	const limit = 96 * fakeGranule
	e := openEnv(t, withLimit(limit), withConfig(kv.Config{MaxTokens: 256, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{}))
	c, pc := e.c, e.pc
	system := promptIDs(5000, 24)
	s, _, err := serve(pc, append(system, 1))
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	pin, err := pc.Pin(system)
	require.NoError(t, err)
	defer pin.Release()
	for i := range 3 {
		ids := make([]int32, 30)
		for j := range ids {
			ids[j] = int32(100*i + j)
		}
		s, _, err := serve(pc, ids)
		require.NoError(t, err)
		require.True(t, s.Close().OK())
	}
	pinned := pc.Stats().PinnedBytes
	require.Positive(t, pinned)
	big, err := c.NewSequence()
	require.NoError(t, err)
	row := int64(tiny8.BytesPerToken())
	n := int((limit - pinned) / row)
	for n > 0 && big.Append(n) != nil {
		n--
	}
	require.Positive(t, n)
	st := pc.Stats()
	assert.Equal(t, pinned, st.CachedBytes, "everything but the pinned prefix was evicted")
	assert.LessOrEqual(t, e.auth.Stats().Owned, int64(limit))
	require.True(t, big.Close().OK())
	q, m, err := pc.Lookup(append(system, 2))
	require.NoError(t, err)
	defer q.Close()
	assert.Equal(t, 24, m, "the pinned prompt is still found")
	require.NoError(t, checkIDs(q, system, 0, 24))
}

// In the Blocked layout the prefix cache's unit is a block, however many granules it
// spans (here 3: tiny8 with 4 tokens a block on 4 KiB granules): an entry holds whole
// blocks, a hit maps the whole blocks below the match and copies the rest, and
// eviction gives back whole blocks.
func TestPrefixCacheCountsBlocks(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{}))
	c, pc := e.c, e.pc
	const block = 3 * fakeGranule
	ids := promptIDs(100, 10)
	s, m, err := serve(pc, ids) // 10 tokens: 3 blocks, the last holding 2 tokens
	require.NoError(t, err)
	require.Zero(t, m)
	require.Equal(t, 4, s.BlockTokens())
	assert.Equal(t, int64(3*block), pc.Stats().CachedBytes)
	assert.Equal(t, 8, s.Writable(), "the two whole blocks are shared")
	q, m, err := pc.Lookup(append(ids[:10:10], 7))
	require.NoError(t, err)
	require.Equal(t, 10, m)
	assert.Equal(t, 8, q.Writable())
	require.NoError(t, checkIDs(q, ids, 0, 10))
	st := c.SequenceStats()
	assert.Equal(t, int64(3*block), st[1].Committed)
	assert.Equal(t, int64(2*block), st[1].Shared, "whole blocks mapped, the tokens of the third copied")
	require.True(t, s.Close().OK())
	require.True(t, q.Close().OK())
	assert.Equal(t, int64(3*block), pc.Stats().CachedBytes)

	// A cap of two blocks evicts the third whole: 8 tokens stay cached.
	capped := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.Blocked, BlockTokens: testBlockTokens}), withPrefixCache(kv.PrefixCacheOptions{MaxBytes: 2 * block})).pc
	s, _, err = serve(capped, ids)
	require.NoError(t, err)
	cs := capped.Stats()
	assert.Equal(t, int64(2*block), cs.CachedBytes)
	assert.Equal(t, int64(8), cs.CachedTokens)
	assert.Equal(t, int64(1), cs.Evictions, "one block")
	require.True(t, s.Close().OK())
	q, m, err = capped.Lookup(append(ids[:10:10], 7))
	require.NoError(t, err)
	require.Equal(t, 8, m)
	require.NoError(t, checkIDs(q, ids, 0, 8))
	require.True(t, q.Close().OK())
}
