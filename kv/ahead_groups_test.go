package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// aheadHybrid is a model whose groups cross their Blocked block boundaries (one
// granule of blockGranule each) at different tokens: a sliding window of 16 tokens a
// block, a full group of 10 (384 bytes a token in 4 KiB: 256 bytes of the block
// unused), an MLA group of 64, and a recurrent state, which is never mapped ahead.
var aheadHybrid = func() kv.Model {
	kvh := int(blockGranule / 4096)
	return kv.Model{Name: "ahead-hybrid", Layers: 7, Groups: []kv.Group{
		{Kind: kv.SlidingWindow, Window: 24, Layers: []int{0, 2}, KVHeads: kvh, HeadDim: 32, DType: arena.Float16},
		{Kind: kv.FullAttention, Layers: []int{1, 3, 4}, KVHeads: kvh, HeadDim: 32, DType: arena.Float16},
		{Kind: kv.MLALatent, Layers: []int{5}, KVHeads: 1, HeadDim: 32 * kvh, DType: arena.Float16},
		{Kind: kv.Recurrent, Layers: []int{6}, StateBytes: 256},
	}}
}()

// TestMapAheadOnGPTOSS: on gpt-oss-20b (a 128-token sliding window beside full
// attention), in the Blocked layout at 2 MiB granules and in PerLayer at 64 KiB (24
// ranges a group), every step that crosses a unit boundary (a block, or a granule of
// each range) adopts both groups' units, mapped ahead, and makes no backing call, and
// so does every step whose window gives a unit back: it leaves the unit behind for
// the worker. What the tokens wrote reads back, and the ledger and the governor are
// exact at every step and after Close.
func TestMapAheadOnGPTOSS(t *testing.T) {
	m := kv.GPTOSS20B()
	const window = 128
	for _, lt := range []struct {
		layout  kv.Layout
		granule int
	}{{kv.Blocked, 2 << 20}, {kv.PerLayer, 64 << 10}} {
		for _, name := range aheadBackings {
			t.Run(lt.layout.String()+"/"+name, func(t *testing.T) {
				e := openEnv(t, withGranule(lt.granule), withConfig(kv.Config{Model: m, MaxTokens: 512, Layout: lt.layout, BlockTokens: oldBlock(lt.layout), MapAhead: true}), aheadBacking(t, name))
				win, err := e.c.LayerStrides(0)
				require.NoError(t, err)
				full, err := e.c.LayerStrides(1)
				require.NoError(t, err)
				require.Equal(t, kv.SlidingWindow, m.Groups[win.Group].Kind)
				require.Equal(t, kv.FullAttention, m.Groups[full.Group].Kind)
				require.Equal(t, window, m.Groups[win.Group].Window)
				// unit is the tokens of a block (Blocked) or of a granule of one
				// range (PerLayer); ranges a group's ranges.
				unit, ranges := full.BlockTokens, 1
				if lt.layout == kv.PerLayer {
					unit, ranges = lt.granule/full.TokenStride, 2*len(m.Groups[full.Group].Layers)
				}
				require.Equal(t, full, kv.Strides{Group: full.Group, TokenBytes: win.TokenBytes, TokenStride: win.TokenStride, BlockTokens: win.BlockTokens, BlockStride: win.BlockStride,
					RunTokens: win.RunTokens, RunStride: win.RunStride},
					"gpt-oss's groups have one shape, and cross together")
				s, err := e.c.NewSequence()
				require.NoError(t, err)
				tok := make([]byte, full.TokenBytes)
				got := make([]byte, full.TokenBytes)
				crossings, drops := 0, 0
				for n := 0; n < 5*unit; n++ {
					e.c.WaitAhead()
					if n > 0 && n%unit == 0 {
						require.Equal(t, int64(2*ranges*lt.granule), e.c.Stats().Ahead, "token %d: the next unit of each group is mapped ahead", n)
					}
					held, ahead := s.FirstHeld(0), e.c.Stats().Ahead
					release := e.c.HoldAhead() // NB: the worker's calls wait: the step's alone are counted
					calls := e.faults.Calls()
					require.NoError(t, s.Append(1))
					if n > 0 && n%unit == 0 {
						require.Equal(t, calls, e.faults.Calls(), "token %d: the step that crossed a unit boundary made no backing call", n)
						crossings++
					}
					if s.FirstHeld(0) > held {
						require.Equal(t, calls, e.faults.Calls(), "token %d: the step that gave back the window's unit made no backing call", n)
						adopted := int64(0)
						if n%unit == 0 {
							adopted = int64(2 * ranges * lt.granule)
						}
						require.Equal(t, ahead-adopted+int64(ranges*lt.granule), e.c.Stats().Ahead, "token %d: the unit left behind is shown", n)
						drops++
					}
					release()
					for _, layer := range []int{0, 1} {
						for i := range tok {
							tok[i] = byte(n + layer + i)
						}
						require.NoError(t, s.WriteTokens(layer, kv.K, n, n+1, tok))
						require.NoError(t, s.ReadTokens(layer, kv.K, n, n+1, got))
						require.Equal(t, tok, got, "token %d layer %d", n, layer)
					}
					e.c.WaitAhead() // NB: the worker charges a granule before the pool shows it
					st, ps := e.c.Stats(), e.pool.PoolStats()
					require.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned, "token %d: the governor", n)
					require.Equal(t, ps.Owned, st.Committed+st.Ahead+ps.Idle, "token %d: every granule is the sequence's, ahead or idle", n)
				}
				assert.Equal(t, 4, crossings)
				assert.Equal(t, (5*unit-window)/unit, drops, "the window gave back a unit each unit's tokens past its first")
				// The full group holds every unit, the window group those from its
				// FirstLive of the length of the last step on: it gave the others back.
				e.c.WaitAhead()
				last := 5*unit - 1
				held := int64(last/unit+1) + int64(last/unit-(last-window+1)/unit+1)
				assert.Equal(t, held*int64(ranges*lt.granule), e.c.Stats().Committed)
				assert.True(t, s.Close().OK())
				assert.Zero(t, e.c.Stats().Ahead, "the runs went back with the sequence")
				e.finish(t)
			})
		}
	}
}

// TestMapAheadAdoptsTheGroupItCrosses: each group's run is its own. A step that
// crosses the window group's block boundary alone adopts the window's run and leaves
// the full group's mapped; the step that crosses the full group's then adopts that
// one, and neither makes a backing call. The recurrent state is never mapped ahead.
func TestMapAheadAdoptsTheGroupItCrosses(t *testing.T) {
	gran := blockGranule
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(gran)), withConfig(kv.Config{Model: aheadHybrid, MaxTokens: 256, Layout: kv.Blocked, BlockTokens: 1, MapAhead: true}), aheadBacking(t, name))
			for layer, want := range map[int]int{0: 16, 1: 10, 5: 64} {
				st, err := e.c.LayerStrides(layer)
				require.NoError(t, err)
				require.Equal(t, want, st.BlockTokens, "layer %d", layer)
			}
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			// 12 tokens: the window's block 0, the full group's blocks 0 and 1, the
			// latent's block 0 and the state. Ahead: the window's block 1 and the full
			// group's block 2; the latent's next block is 52 tokens away.
			require.NoError(t, s.Append(12))
			e.mappedAhead(t, 2*gran)
			require.Equal(t, 5*gran, e.c.Stats().Committed)
			require.NoError(t, s.Append(4)) // 16: no group crosses
			e.c.WaitAhead()

			calls := e.faults.Calls()
			require.NoError(t, s.Append(1)) // the window crosses into its block 1
			assert.Equal(t, calls, e.faults.Calls(), "the crossing step made no backing call")
			assert.Equal(t, 6*gran, e.c.Stats().Committed, "the window's run adopted")
			assert.Equal(t, gran, e.c.Stats().Ahead, "the full group's run stays mapped")

			require.NoError(t, s.Append(3)) // 20: pays the kick; no group crosses
			e.mappedAhead(t, 2*gran)        // the window's block 2 too
			calls = e.faults.Calls()
			require.NoError(t, s.Append(1)) // the full group crosses into its block 2
			assert.Equal(t, calls, e.faults.Calls(), "the crossing step made no backing call")
			assert.Equal(t, 7*gran, e.c.Stats().Committed, "the full group's run adopted")
			assert.Equal(t, gran, e.c.Stats().Ahead, "the window's run stays mapped")

			for n := s.Len(); n < 64; n++ {
				require.NoError(t, s.Append(1))
			}
			e.c.WaitAhead()
			calls = e.faults.Calls()
			require.NoError(t, s.Append(1)) // 65: the latent crosses into its block 1
			assert.Equal(t, calls, e.faults.Calls(), "the latent's crossing step made no backing call")
			closeAhead(t, e, s)
		})
	}
}

// TestMapAheadAdoptsInPart: a run that reaches past the step that crosses into it (the
// full group's blocks hold 10 tokens, fewer than the lead) is adopted a block at a
// time, the rest staying mapped for the step that crosses into it; neither step makes
// a backing call, and the sequence never holds a block its tokens do not need.
func TestMapAheadAdoptsInPart(t *testing.T) {
	gran := blockGranule
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(gran)), withConfig(kv.Config{Model: aheadHybrid, MaxTokens: 256, Layout: kv.Blocked, BlockTokens: 1, MapAhead: true}), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			// 7 tokens: each group's block 0 and the state. Ahead: the window's block 1
			// and the full group's blocks 1 and 2 (its next 16 tokens).
			require.NoError(t, s.Append(7))
			e.mappedAhead(t, 3*gran)
			require.Equal(t, 4*gran, e.c.Stats().Committed)

			calls := e.faults.Calls()
			require.NoError(t, s.Append(4)) // 11: the full group crosses into its block 1
			assert.Equal(t, calls, e.faults.Calls(), "the crossing step made no backing call")
			assert.Equal(t, 5*gran, e.c.Stats().Committed, "one block of the full group's run adopted")
			assert.Equal(t, 2*gran, e.c.Stats().Ahead, "its block 2 and the window's block 1 stay mapped")

			require.NoError(t, s.Append(9)) // 20: the window crosses into its block 1
			e.c.WaitAhead()
			calls = e.faults.Calls()
			require.NoError(t, s.Append(1)) // 21: the full group crosses into its block 2
			assert.Equal(t, calls, e.faults.Calls(), "the crossing step made no backing call")
			assert.Equal(t, 7*gran, e.c.Stats().Committed, "the window's blocks 0-1, the full group's 0-2, the latent's and the state")
			closeAhead(t, e, s)
		})
	}
}

// TestMapAheadRefusedStepKeepsNothing: a step that adopts its run and then needs more
// than the budget holds is refused as without map-ahead, with the same figures, and
// leaves the sequence holding what it held before: the run it adopted goes idle to
// the pool, where the next step takes it.
func TestMapAheadRefusedStepKeepsNothing(t *testing.T) {
	gran := blockGranule
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(blockGranule)), withLimit(3*gran), withConfig(oneBlockConfig(256, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(16))
			e.mappedAhead(t, gran)
			need, err := s.Need(40) // blocks 1-3: the run and two more
			require.NoError(t, err)
			require.Equal(t, 2*gran, need)

			err = s.Append(40)
			require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
			var be *accounting.BudgetError
			require.ErrorAs(t, err, &be)
			assert.Equal(t, need, be.Requested, "the refusal says what Need said")
			assert.Equal(t, 16, s.Len())
			assert.Equal(t, gran, e.c.Stats().Committed, "the sequence holds its one block")
			assert.Zero(t, e.c.Stats().Ahead)
			ps := e.pool.PoolStats()
			assert.Equal(t, gran, ps.Idle, "the run went idle")
			assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned)

			require.NoError(t, s.Append(1), "the next step takes the idle granule")
			assert.Equal(t, 2*gran, e.c.Stats().Committed)
			assert.True(t, s.Close().OK())
			e.finish(t)
		})
	}
}

// TestMapAheadRefusedBatchKeepsNothing: a batch step in which one sequence adopts a
// run in part and another needs more than the budget holds is refused with the
// figures Need gave, and the first sequence holds what it held before: the block it
// adopted and the rest of that run go idle, its other group's run stays mapped.
func TestMapAheadRefusedBatchKeepsNothing(t *testing.T) {
	gran := blockGranule
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(gran)), withLimit(10*gran), withConfig(kv.Config{Model: aheadHybrid, MaxTokens: 256, Layout: kv.Blocked, BlockTokens: 1, MapAhead: true}), aheadBacking(t, name))
			a, err := e.c.NewSequence()
			require.NoError(t, err)
			b, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, a.Append(7))
			e.mappedAhead(t, 3*gran) // the window's block 1, the full group's blocks 1 and 2
			batch := []kv.Growth{{Seq: a, Tokens: 4}, {Seq: b, Tokens: 40}}
			need, err := e.c.Need(batch)
			require.NoError(t, err)

			err = e.c.AppendBatch(batch)
			require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
			var be *accounting.BudgetError
			require.ErrorAs(t, err, &be)
			assert.Equal(t, need, be.Requested, "the refusal says what Need said")
			assert.Equal(t, 7, a.Len())
			assert.Zero(t, b.Len())
			assert.Equal(t, 4*gran, e.c.Stats().Committed, "a holds its blocks of before")
			assert.Equal(t, gran, e.c.Stats().Ahead, "the window's run stays")
			ps := e.pool.PoolStats()
			assert.Equal(t, 2*gran, ps.Idle, "the full group's run went idle")
			assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned)

			require.NoError(t, a.Append(4), "a grows on")
			assert.Equal(t, 5*gran, e.c.Stats().Committed)
			assert.True(t, a.Close().OK())
			assert.True(t, b.Close().OK())
			e.finish(t)
		})
	}
}

// closeAhead waits for the map-ahead worker, checks that the governor charges what

// TestMapAheadLeavesBehind: a step whose window gives units back leaves them behind
// for the worker, with no backing call, whether they are the sequence's own or map a
// parent's (a fork's first blocks; what a long prompt's first decode step gives
// back at once): Stats.Ahead shows the owned ones only. Truncate, ForkAt and Close
// settle what is still left behind; the ledger is exact once the worker rests and
// after Close.
func TestMapAheadLeavesBehind(t *testing.T) {
	gran := blockGranule
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(gran)), withConfig(kv.Config{Model: aheadHybrid, MaxTokens: 256, Layout: kv.Blocked, BlockTokens: 1, MapAhead: true}), aheadBacking(t, name))
			// 71 tokens: no group's block starts at 71 or 72 (window 16, full 10,
			// latent 64 tokens a block), so the next step crosses into none.
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(71))
			f, err := s.ForkAt(71) // maps s's whole blocks: the window's 0-3
			require.NoError(t, err)
			e.c.WaitAhead()
			ahead := e.c.Stats().Ahead

			release := e.c.HoldAhead()
			calls := e.faults.Calls()
			require.NoError(t, f.Append(1)) // FirstLive(71) is 48: window blocks 0-2 go
			assert.Equal(t, calls, e.faults.Calls(), "the step left the shared units behind with no backing call")
			assert.Equal(t, 48, f.FirstHeld(0))
			assert.Equal(t, ahead, e.c.Stats().Ahead, "mapped from s: none of them is the cache's own")
			require.NoError(t, s.Append(1))
			assert.Equal(t, calls, e.faults.Calls(), "and s its own")
			assert.Equal(t, ahead+3*gran, e.c.Stats().Ahead, "its own units left behind are shown")
			books := func(what string) {
				t.Helper()
				st, ps := e.c.Stats(), e.pool.PoolStats()
				assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned, "%s: the governor", what)
				assert.Equal(t, ps.Owned, st.Committed-st.Shared+st.Ahead+ps.Idle, "%s: every granule is a sequence's own, ahead or behind, or idle", what)
			}
			books("left behind")
			release()
			e.c.WaitAhead()
			books("given back")

			// What is still left behind when the owner changes its ranges is
			// settled first.
			require.NoError(t, s.Append(16)) // 88
			require.NoError(t, f.Append(16)) // 88
			e.c.WaitAhead()
			release = e.c.HoldAhead()
			require.NoError(t, s.Append(16)) // FirstLive(88) is 65: block 3 goes
			require.NoError(t, f.Append(16)) // and f's, which maps s's
			require.Equal(t, []int{64, 64}, []int{s.FirstHeld(0), f.FirstHeld(0)})
			books("left behind again")
			g, err := s.ForkAt(s.Len())
			require.NoError(t, err)
			require.NoError(t, f.Truncate(f.Len()-1))
			assert.True(t, g.Close().OK())
			assert.True(t, f.Close().OK())
			release()
			closeAhead(t, e, s)
		})
	}
}

// the pool owns (runs ahead included), closes s and finishes e.
func closeAhead(t *testing.T, e *env, s *kv.Sequence) {
	t.Helper()
	e.c.WaitAhead()
	assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, e.pool.PoolStats().Owned)
	assert.True(t, s.Close().OK())
	e.finish(t)
}
