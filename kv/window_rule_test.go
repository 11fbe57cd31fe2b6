package kv_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// The window rule at and around chunk boundaries: every fork, freeze, truncate,
// insert and hit of n tokens, for every n from 0 to a few chunks past the window, on
// models of chunked-local and sliding groups beside full ones, succeeds exactly when
// the rule lets it, and an entry that nothing holds always goes.

// Wide window tokens (a Blocked block of 4 KiB holds 4 tokens of a 256-wide head, a
// PerLayer granule 8), so that the windows give units back within a few chunks.
var (
	// tinyScout is llama-4-scout's shape in small: chunked-local layers beside full
	// ones, and no other window group.
	tinyScout = kv.Model{Name: "tiny-scout", Layers: 2, Groups: []kv.Group{
		{Kind: kv.ChunkedLocal, Window: 6, Layers: []int{0}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
		{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	}}
	// tinySlide1 has a sliding window of one token: a step reads no earlier token of it.
	tinySlide1 = kv.Model{Name: "tiny-slide1", Layers: 2, Groups: []kv.Group{
		{Kind: kv.SlidingWindow, Window: 1, Layers: []int{0}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
		{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	}}
	// tinyMixed has chunks, windows of one and of three tokens, a full group and an
	// MLA latent.
	tinyMixed = kv.Model{Name: "tiny-mixed", Layers: 5, Groups: []kv.Group{
		{Kind: kv.ChunkedLocal, Window: 6, Layers: []int{0}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
		{Kind: kv.SlidingWindow, Window: 1, Layers: []int{1}, KVHeads: 1, HeadDim: 256, DType: arena.Float16},
		{Kind: kv.SlidingWindow, Window: 3, Layers: []int{2}, KVHeads: 1, HeadDim: 128, DType: arena.Float16},
		{Kind: kv.FullAttention, Layers: []int{3}, KVHeads: 1, HeadDim: 32, DType: arena.Float16},
		{Kind: kv.MLALatent, Layers: []int{4}, KVHeads: 1, HeadDim: 24, DType: arena.Float16},
	}}
	windowRuleModels = []kv.Model{tinyScout, tinySlide1, tinyMixed}
)

// windowRuleLen is the longest sequence the tests build: four chunks past the window
// and a few tokens.
const windowRuleLen = 29

// stepReads returns the first of the earlier tokens that the step of a sequence of n
// tokens (its token at position n) reads in a group of g's kind, from the kinds'
// definitions (a sliding window reads the keys at n-Window+1 .. n, a chunk the
// earlier tokens of its own chunk): [from, n), empty when from is n. It is written
// here without Group.FirstLive, the code under test.
func stepReads(g kv.Group, n int) int {
	switch g.Kind {
	case kv.SlidingWindow:
		return max(0, n-g.Window+1)
	case kv.ChunkedLocal:
		return n - n%g.Window
	}
	return 0
}

// mayServe reports whether a holder of n tokens whose layers hold their tokens from
// held[layer] on has every token the step at n reads: the rule.
func mayServe(m kv.Model, held []int, n int) bool {
	for _, g := range m.Groups {
		for _, l := range g.Layers {
			if from := stepReads(g, n); from < n && held[l] > from {
				return false
			}
		}
	}
	return true
}

// readsEarlier reports whether a step reads earlier tokens of some window group of m:
// a sliding window of one token reads none.
func readsEarlier(m kv.Model) bool {
	for _, g := range m.Groups {
		if g.Kind == kv.ChunkedLocal || g.Kind == kv.SlidingWindow && g.Window > 1 {
			return true
		}
	}
	return false
}

// ruleIDs returns the token IDs of the tests' sequences.
func ruleIDs(n int, salt int32) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32(i)*7 + salt
	}
	return ids
}

// decoded returns a sequence of ids' tokens, prefilled with p tokens in one step and
// decoded one step at a time from there, each token written as it comes.
func decoded(t *testing.T, c *kv.Cache, ids []int32, p int) *kv.Sequence {
	t.Helper()
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(p))
	require.NoError(t, writeHeldIDs(s, ids, 0, p))
	for n := p; n < len(ids); n++ {
		require.NoError(t, s.Append(1))
		require.NoError(t, writeHeldIDs(s, ids, n, n+1))
	}
	return s
}

// servesStep checks that s, a holder of ids' first n tokens, holds every token the
// step at n reads, that those read back, and that the step itself works: it appends
// token n, writes it and reads it back.
func servesStep(s *kv.Sequence, ids []int32, n int) error {
	m := s.Cache().Config().Model
	for _, g := range m.Groups {
		for _, l := range g.Layers {
			if from := stepReads(g, n); from < n && s.FirstHeld(l) > from {
				return fmt.Errorf("layer %d holds from %d, the step at %d reads from %d", l, s.FirstHeld(l), n, from)
			}
		}
	}
	if err := checkHeldIDs(s, ids, 0, n); err != nil {
		return err
	}
	if n == len(ids) {
		return nil
	}
	if err := s.Append(1); err != nil {
		return err
	}
	if err := writeHeldIDs(s, ids, n, n+1); err != nil {
		return err
	}
	return checkHeldIDs(s, ids, n, n+1)
}

// ruleOutcome checks a call at n against the rule: done when may, else refused with
// ErrDropped.
func ruleOutcome(t *testing.T, err error, may bool, what string, n int) bool {
	t.Helper()
	if may {
		return assert.NoError(t, err, "%s at %d: the rule lets it", what, n)
	}
	assert.ErrorIs(t, err, kv.ErrDropped, "%s at %d: a step there reads a dropped token", what, n)
	return false
}

// TestWindowRuleSequence: ForkAt, Freeze (and a sequence started on the prefix) and
// Truncate at every n from 0 to a few chunks past the window, of sequences prefilled
// with p tokens and decoded one token a step from there, succeed exactly when the
// step at n reads only tokens the sequence still holds, and what they make holds
// those tokens, reads them back and takes the step; with map-ahead too (on the
// backings that pool), whose worker gives back what the windows leave behind.
func TestWindowRuleSequence(t *testing.T) {
	for _, model := range windowRuleModels {
		for _, ahead := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/ahead=%t", model.Name, ahead), func(t *testing.T) {
				testWindowRuleSequence(t, model, ahead)
			})
		}
	}
}

func testWindowRuleSequence(t *testing.T, model kv.Model, ahead bool) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: model, MaxTokens: 64, MapAhead: ahead})}, func(t *testing.T, e *env) {
		ids := ruleIDs(windowRuleLen, 3)
		for _, p := range []int{0, 13, windowRuleLen} {
			s := decoded(t, e.c, ids, p)
			held := heldOf(s)
			refused := 0
			for n := 0; n <= windowRuleLen; n++ {
				may := mayServe(model, held, n)
				if !may {
					refused++
				}
				f, err := s.ForkAt(n)
				if ruleOutcome(t, err, may, "ForkAt", n) {
					assert.NoError(t, servesStep(f, ids, n), "a fork at %d", n)
					require.True(t, f.Close().OK())
				}
				pr, err := s.Freeze(n)
				if ruleOutcome(t, err, may, "Freeze", n) {
					q, err := e.c.NewSequenceFrom(pr)
					require.NoError(t, err)
					assert.NoError(t, servesStep(q, ids, n), "a sequence on a prefix of %d", n)
					require.True(t, q.Close().OK())
					pr.Release()
				}
			}
			require.NoError(t, checkHeldIDs(s, ids, 0, windowRuleLen), "the forks left s as it was")
			require.True(t, s.Close().OK())
			if p == windowRuleLen || !readsEarlier(model) {
				assert.Zero(t, refused, "a sequence prefilled in one step holds every token, and a window of one reads none")
			} else {
				assert.Positive(t, refused, "the windows gave tokens back")
			}
			for n := 0; n <= windowRuleLen; n++ {
				s := decoded(t, e.c, ids, p)
				err := s.Truncate(n)
				if ruleOutcome(t, err, mayServe(model, heldOf(s), n), "Truncate", n) {
					assert.NoError(t, servesStep(s, ids, n), "rolled back to %d", n)
				} else {
					assert.Equal(t, windowRuleLen, s.Len(), "a refused truncate changes nothing")
				}
				require.True(t, s.Close().OK())
			}
		}
		e.books(t, "after the calls")
	})
}

// TestWindowRulePrefixCache: an insert of a sequence's first n tokens, for every n
// from 0 to a few chunks past the window, succeeds exactly when the rule lets a step
// at n go on from what the sequence holds; a prompt that shares k of its tokens then
// matches (and a lookup hits) the longest m <= k at which the rule lets a step go on
// from what the entry holds (every token the sequence held below n); and an eviction
// of everything with no sequence live and no pin leaves no entry and no byte.
func TestWindowRulePrefixCache(t *testing.T) {
	for _, model := range windowRuleModels {
		t.Run(model.Name, func(t *testing.T) {
			onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: model, MaxTokens: 64})}, func(t *testing.T, e *env) {
				ids := ruleIDs(windowRuleLen, 5)
				pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
				require.NoError(t, err)
				defer func() { assert.NoError(t, pc.Close()) }()
				partial := 0
				for _, p := range []int{0, 13, windowRuleLen} {
					for n := 0; n <= windowRuleLen; n++ {
						s := decoded(t, e.c, ids, p)
						held := heldOf(s)
						err := pc.Insert(s, ids[:n])
						require.True(t, s.Close().OK())
						if !ruleOutcome(t, err, mayServe(model, held, n), "Insert", n) {
							continue
						}
						for l := range held {
							held[l] = min(held[l], n) // the entry's: what s held below n
						}
						for k := 0; k <= n; k++ {
							prompt := append(append([]int32(nil), ids[:k]...), -1, -2)
							want := 0
							for m := k; m > 0; m-- {
								if mayServe(model, held, m) {
									want = m
									break
								}
							}
							if want < k {
								partial++
							}
							require.Equal(t, want, pc.Match(prompt), "an entry of %d (prefill %d): a prompt sharing %d", n, p, k)
							q, got, err := pc.Lookup(prompt)
							require.NoError(t, err)
							require.Equal(t, want, got)
							assert.NoError(t, servesStep(q, prompt, got), "a hit of %d", got)
							require.True(t, q.Close().OK())
						}
						freed, err := pc.Evict(1 << 40)
						require.NoError(t, err)
						st := pc.Stats()
						assert.Zero(t, st.Entries, "an entry of %d (prefill %d) with no holder goes", n, p)
						assert.Zero(t, st.CachedTokens)
						assert.Zero(t, st.CachedBytes)
						assert.Equal(t, st.InsertedTokens, st.EvictedTokens)
						if n > 0 && n == windowRuleLen {
							assert.Positive(t, freed)
						}
						idleBooks(t, e, pc, fmt.Sprintf("after evicting an entry of %d", n))
					}
				}
				if readsEarlier(model) {
					assert.Positive(t, partial, "the rule cut some hits short")
				} else {
					assert.Zero(t, partial, "a window of one token reads none: every shared token is a hit")
				}
			})
		})
	}
}

// TestWindowRuleEvictable: on llama-4-scout's shape under a budget, entries of
// lengths at, below and past a chunk boundary (cut to one by eviction) that nothing
// holds are all evictable: Evict takes them whole, Headroom's bytes are there for an
// Append (it is not refused), and MaxBytes holds after every insert.
func TestWindowRuleEvictable(t *testing.T) {
	for _, model := range windowRuleModels {
		// BlockTokens 1: the repro, one-granule blocks under a budget of 16
		// granules. 0: the default blocks, which on a window of one token are a token
		// each, so a prompt takes a granule a token and the budget is four times larger.
		for _, bt := range []int{1, 0} {
			t.Run(fmt.Sprintf("%s/blocktokens=%d", model.Name, bt), func(t *testing.T) {
				// tinyMixed's 20 PerLayer ranges need more.
				limit := int64(16 * envGranule)
				if len(model.Groups) > 2 {
					limit *= 4
				}
				if bt == 0 {
					limit *= 4
				}
				onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: model, MaxTokens: 64, BlockTokens: bt}), withLimit(limit)}, func(t *testing.T, e *env) {
					gran := int64(e.c.Granularity())
					for _, n := range []int{6, 12, 13, 18, 24, 25} {
						for _, cap := range []int64{0, 2 * gran} {
							pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{MaxBytes: cap})
							require.NoError(t, err)
							ids := ruleIDs(n, int32(n))
							s, m, err := pc.Lookup(ids)
							require.NoError(t, err)
							require.Zero(t, m)
							require.NoError(t, s.Append(n))
							require.NoError(t, writeHeldIDs(s, ids, 0, n))
							require.NoError(t, pc.Insert(s, ids))
							require.True(t, s.Close().OK())
							if cap > 0 {
								assert.LessOrEqual(t, pc.Stats().CachedBytes, cap, "MaxBytes, an entry of %d", n)
							}
							// A request as large as Headroom says fits.
							room := e.c.Headroom()
							q, err := e.c.NewSequence()
							require.NoError(t, err)
							k := 0
							for ; k < 64; k++ {
								need, err := q.Need(k + 1)
								require.NoError(t, err)
								if need > room {
									break
								}
							}
							need, err := q.Need(k)
							require.NoError(t, err)
							err = q.Append(k)
							var be *accounting.BudgetError
							assert.False(t, errors.As(err, &be), "an Append of %d bytes within Headroom's %d, beside an entry of %d: %v", need, room, n, err)
							assert.NoError(t, err)
							require.True(t, q.Close().OK())
							_, err = pc.Evict(1 << 40)
							require.NoError(t, err)
							st := pc.Stats()
							assert.Zero(t, st.Entries, "an entry of %d with no holder goes", n)
							assert.Zero(t, st.CachedBytes)
							assert.Zero(t, st.PinnedBytes)
							require.NoError(t, pc.Close())
						}
					}
					e.books(t, "after the entries")
				})
			})
		}
	}
}

// TestPrefixCacheChunkBoundaryHit: after a 40-token sequence decoded one token a step
// is inserted (its chunked window holds its last chunk only), a prompt that shares 30
// of its tokens (a chunk boundary: the step there reads no earlier token of the
// chunked group) hits all 30, and one that shares 29 the boundary below, 24.
func TestPrefixCacheChunkBoundaryHit(t *testing.T) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyScout, MaxTokens: 64})}, func(t *testing.T, e *env) {
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
		require.NoError(t, err)
		defer func() { assert.NoError(t, pc.Close()) }()
		ids := ruleIDs(40, 1)
		s := decoded(t, e.c, ids, 1)
		require.Greater(t, s.FirstHeld(0), 30, "the window gave the first chunks back")
		require.NoError(t, pc.Insert(s, ids))
		require.True(t, s.Close().OK())
		for _, tt := range []struct{ shared, want int }{{30, 30}, {29, 24}, {36, 36}, {5, 0}} {
			prompt := append(append([]int32(nil), ids[:tt.shared]...), -1)
			assert.Equal(t, tt.want, pc.Match(prompt), "a prompt sharing %d", tt.shared)
			q, m, err := pc.Lookup(prompt)
			require.NoError(t, err)
			assert.Equal(t, tt.want, m)
			assert.NoError(t, servesStep(q, prompt, m))
			require.True(t, q.Close().OK())
		}
		evictsAll(t, pc)
	})
}
