package kv_test

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
)

// The hybrid prefix cache's eviction, concurrency and Close; the plain model and the
// helpers are in prefixcache_hybrid_test.go.

// TestPrefixCacheHybridEvicts: under MaxBytes, and under a budget that the requests'
// growth must take back from the cache, a cache of window groups evicts whole entries,
// keeps the cap, never matches more than the unbounded plain model would, reads back
// every token it finds, and keeps CachedBytes equal to the memory in use; a pinned
// prefix's entries stay.
func TestPrefixCacheHybridEvicts(t *testing.T) {
	for _, tt := range []struct {
		name  string
		cap   bool
		limit int64
	}{
		{"cap", true, 0},
		{"budget", false, 96 * envGranule},
	} {
		t.Run(tt.name, func(t *testing.T) {
			onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 512}), withLimit(tt.limit)}, func(t *testing.T, e *env) {
				var opts kv.PrefixCacheOptions
				if tt.cap {
					opts.MaxBytes = 64 * int64(e.c.Granularity())
				}
				pc, err := kv.NewPrefixCache(e.c, opts)
				require.NoError(t, err)
				defer func() { assert.NoError(t, pc.Close()) }()
				ref := hybridRef{m: tinyOSS, max: 512, whole: wholeOf(e.c)}
				r := rand.New(rand.NewPCG(27, uint64(e.c.Config().Layout)))
				var made [][]int32
				var hits int64
				var pin *kv.PrefixPin
				var pinned []int32
				for i := range 50 {
					ids := hybridStream(r, made)
					ids = ids[:min(len(ids), 200)]
					s, m, held, err := serveHybrid(pc, ids)
					require.NoError(t, err)
					assert.LessOrEqual(t, m, ref.match(ids), "never more than an unbounded cache")
					hits += int64(m)
					ref.insert(ids, held)
					made = append(made, ids)
					require.NoError(t, checkHeldIDs(s, ids, 0, len(ids)))
					require.True(t, s.Close().OK())
					if tt.cap {
						assert.LessOrEqual(t, pc.Stats().CachedBytes, opts.MaxBytes)
					}
					if i == 5 {
						pinned = ids
						pin, err = pc.Pin(ids)
						require.NoError(t, err)
						require.Equal(t, len(ids), pin.Len())
					}
					if pin != nil {
						assert.Equal(t, len(pinned)-1, pc.Match(pinned), "request %d: the pinned prompt stays whole", i)
					}
					idleBooksPinned(t, e, pc, pin != nil, "after a request")
				}
				pin.Release()
				st := pc.Stats()
				assert.Equal(t, hits, st.Hits)
				assert.Positive(t, st.Evictions, "it evicted")
				assert.Positive(t, st.EvictedBytes)
				assert.Positive(t, st.Hits)
				idleBooks(t, e, pc, "after the pin's release")
			})
		})
	}
}

// TestPrefixCacheHybridTrimsWindows: eviction on a model of window groups gives back
// an entry's older window units first: the entry stays, still hit whole by the next
// turn, while a branch inside it is cut to what its windows still hold; then its last
// units, the entry staying, shorter, for the hits it still holds. The bytes that came
// back are exactly CachedBytes' fall each time, and the memory in use follows.
func TestPrefixCacheHybridTrimsWindows(t *testing.T) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 512, BlockTokens: 1})}, func(t *testing.T, e *env) {
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
		require.NoError(t, err)
		defer func() { assert.NoError(t, pc.Close()) }()
		turn := make([]int32, 400)
		for i := range turn {
			turn[i] = int32(i % 11)
		}
		s, _, _, err := serveHybrid(pc, turn)
		require.NoError(t, err)
		require.True(t, s.Close().OK())
		next := append(slices.Clone(turn), 1, 2)
		branch := append(slices.Clone(turn[:200]), 5)
		require.Equal(t, 400, pc.Match(next))
		require.Equal(t, 200, pc.Match(branch), "the windows hold every unit before eviction")

		before := pc.Stats()
		freed, err := pc.Evict(1)
		require.NoError(t, err)
		st := pc.Stats()
		assert.Positive(t, freed)
		assert.Equal(t, before.CachedBytes-freed, st.CachedBytes, "what came back is what the cache no longer holds")
		assert.Equal(t, 1, st.Entries, "the entry stays")
		assert.Equal(t, before.CachedTokens, st.CachedTokens, "every token is still in the index")
		assert.Equal(t, 400, pc.Match(next), "the next turn still hits the whole entry")
		assert.Zero(t, pc.Match(branch), "a branch inside it needs window units given back")
		idleBooks(t, e, pc, "after the window's units went")

		s, m, _, err := serveHybrid(pc, next)
		require.NoError(t, err)
		assert.Equal(t, 400, m)
		require.NoError(t, checkHeldIDs(s, next, 0, len(next)))
		require.True(t, s.Close().OK())

		// The older units gone, eviction takes the entry's last units, as on one
		// group: it stays, shorter, for the hits it still holds the window of.
		before = pc.Stats()
		freed, err = pc.Evict(1)
		require.NoError(t, err)
		st = pc.Stats()
		assert.Positive(t, freed)
		assert.Equal(t, before.CachedBytes-freed, st.CachedBytes)
		assert.Equal(t, 1, st.Entries, "the entry stays")
		assert.Less(t, st.CachedTokens, before.CachedTokens, "shorter")
		assert.Equal(t, before.CachedTokens-st.CachedTokens, st.EvictedTokens-before.EvictedTokens)
		held := int(st.CachedTokens)
		assert.Equal(t, held, pc.Match(next), "a hit of what it still holds")
		s, m, _, err = serveHybrid(pc, next[:held+1])
		require.NoError(t, err)
		assert.Equal(t, held, m)
		require.True(t, s.Close().OK())
		idleBooks(t, e, pc, "after the last units went")

		freed, err = pc.Evict(pc.Stats().CachedBytes)
		require.NoError(t, err)
		assert.Zero(t, pc.Stats().CachedBytes)
		assert.Positive(t, freed)
		idleBooks(t, e, pc, "after evicting everything")
	})
}

// TestPrefixCacheHybridConcurrent: on a model of window groups, many goroutines serve
// (hits read back whole), decode past their windows, fork, insert again, pin and
// evict at once under a budget and a cap; afterwards CachedBytes is the memory in use
// and an eviction of everything gives all of it back.
func TestPrefixCacheHybridConcurrent(t *testing.T) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 512}), withLimit(400 * envGranule)}, func(t *testing.T, e *env) {
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{MaxBytes: 200 * int64(e.c.Granularity())})
		require.NoError(t, err)
		defer func() { assert.NoError(t, pc.Close()) }()
		var ps sharedStream
		goWorkers(6, func(w int) error {
			r := rand.New(rand.NewPCG(uint64(w), 25))
			for range 25 {
				ps.mu.Lock()
				ids := hybridStream(r, ps.made)
				ids = ids[:min(len(ids), 200)]
				ps.made = append(ps.made, ids)
				ps.mu.Unlock()
				switch r.IntN(10) {
				case 0:
					pin, err := pc.Pin(ids)
					if err != nil {
						return err
					}
					pin.Release()
					continue
				case 1:
					if _, err := pc.Evict(int64(r.IntN(20) * envGranule)); err != nil {
						return err
					}
				}
				s, _, _, err := serveHybrid(pc, ids)
				if errors.Is(err, accounting.ErrBudgetExceeded) {
					continue // live sequences hold the budget: a refusal is honest
				}
				if err != nil {
					return err
				}
				out := slices.Clone(ids)
				for range r.IntN(40) {
					out = append(out, int32(r.IntN(3)))
					if err := s.Append(1); err != nil {
						break
					}
					if err := writeHeldIDs(s, out, len(out)-1, len(out)); err != nil {
						return err
					}
				}
				out = out[:s.Len()]
				if err := checkHeldIDs(s, out, 0, len(out)); err != nil {
					return err
				}
				if r.IntN(3) == 0 {
					if at := r.IntN(len(out) + 1); !dropped(s, at) {
						f, err := s.ForkAt(at)
						if err == nil {
							err = checkHeldIDs(f, out, 0, at)
							f.Close()
						}
						if err != nil && !errors.Is(err, accounting.ErrBudgetExceeded) {
							return err
						}
					}
				}
				if r.IntN(3) == 0 {
					if err := pc.Insert(s, out); err != nil && !errors.Is(err, accounting.ErrBudgetExceeded) {
						return err
					}
				}
				if o := s.Close(); !o.OK() {
					return o.Err
				}
			}
			return nil
		})(t)
		st := pc.Stats()
		assert.LessOrEqual(t, st.CachedBytes, 200*int64(e.c.Granularity()))
		assert.Positive(t, st.Hits)
		idleBooks(t, e, pc, "after the workers")
		freed, err := pc.Evict(st.CachedBytes)
		require.NoError(t, err)
		assert.Equal(t, st.CachedBytes, freed)
		assert.Zero(t, pc.Stats().CachedBytes)
		idleBooks(t, e, pc, "after evicting everything")
	})
}

// TestPrefixCacheHybridCloseWhileInserting: Close while an insert maps the window
// units of the entry it takes the place of: the insert ends first (it is done, or
// refused with ErrClosed), no range is closed under it, and every byte comes back.
func TestPrefixCacheHybridCloseWhileInserting(t *testing.T) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 512, BlockTokens: 1})}, func(t *testing.T, e *env) {
		turn := make([]int32, 300)
		for i := range turn {
			turn[i] = int32(i % 13)
		}
		next := append(slices.Clone(turn), 3, 4)
		for range 20 {
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			s, _, _, err := serveHybrid(pc, turn)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			q, m, err := pc.Lookup(next)
			require.NoError(t, err)
			require.Equal(t, len(turn), m)
			require.NoError(t, q.Append(len(next)-m))
			done := make(chan error, 1)
			go func() { done <- pc.Insert(q, next) }()
			require.NoError(t, pc.Close())
			if err := <-done; err != nil {
				require.ErrorIs(t, err, kv.ErrClosed)
			}
			require.True(t, q.Close().OK())
			e.books(t, "after Close")
			assert.Zero(t, e.c.Stats().Committed)
		}
	})
}

// TestPrefixCacheHybridKeepsMappedEntry: eviction on a model of window groups does not
// take an entry whose last whole units a live sequence maps (a hit on all of it), as
// on one group, even where units under them would give memory back: its tokens stay
// in the index, and a lookup still hits them.
func TestPrefixCacheHybridKeepsMappedEntry(t *testing.T) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 512, BlockTokens: 1})}, func(t *testing.T, e *env) {
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
		require.NoError(t, err)
		defer func() { assert.NoError(t, pc.Close()) }()
		a := make([]int32, 300)
		for i := range a {
			a[i] = int32(i % 17)
		}
		b := append(slices.Clone(a[:100]), make([]int32, 200)...)
		for _, ids := range [][]int32{a, b} {
			s, _, _, err := serveHybrid(pc, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
		}
		next := append(slices.Clone(a), 1)
		live, m, err := pc.Lookup(next) // maps a's entry to its end
		require.NoError(t, err)
		require.Equal(t, len(a), m)
		defer live.Close()

		_, err = pc.Evict(pc.Stats().CachedBytes)
		require.NoError(t, err)
		// The tokens past a's last whole unit were copied, not mapped: those may go.
		assert.Greater(t, pc.Match(next), len(a)-32, "a's entry stays: a live sequence maps its units up to the last whole one")
		assert.Positive(t, pc.Stats().PinnedBytes)
		e.books(t, "after the eviction")
	})
}
