//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// Tiers on models with recurrent groups beside groups of tokens (Qwen3-Next's
// pattern): a tier block whose end an entry holds a checkpoint at goes down with the
// states, and a load starts on the states of the last block it loads that has them.

// stateTierModels are the recurrent hybrids the tier tests run on.
var stateTierModels = []kv.Model{tinyNext, tinyNextWin}

// stateTierEnv opens a cache of m on kind with a prefix cache over tier, and returns
// them with the tier block's tokens.
func stateTierEnv(t *testing.T, m kv.Model, kind backingKind, tier kv.Tier) (*env, *kv.PrefixCache, int) {
	t.Helper()
	e := openEnv(t, kind, scaled, withLimit(1<<30), withConfig(kv.Config{Model: m, MaxTokens: 2048}))
	pc := newGroupTierCache(t, e.c, t.Name(), tier)
	return e, pc, tierBlock(t, e.c)
}

// serveStates serves ids as a server of a recurrent hybrid does: a lookup, a prefill
// of the rest that records a checkpoint at each multiple of every past the hit (none
// for 0), an insert. It checks the hit's tokens and states and returns the sequence
// and the match.
func serveStates(t *testing.T, pc *kv.PrefixCache, ids []int32, every int) (*kv.Sequence, int) {
	t.Helper()
	s, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	require.NoError(t, checkHeldIDs(s, ids, 0, m), "the hit's tokens")
	if m > 0 {
		require.NoError(t, checkStates(s, ids[:m]), "the hit's states")
	}
	require.NoError(t, prefillTo(s, ids, len(ids), every))
	require.NoError(t, pc.Insert(s, ids))
	return s, m
}

// evictStates serves ids with checkpoints every every tokens, closes the sequence and
// evicts the whole cache, so that the entry's blocks (and states) go down.
func evictStates(t *testing.T, e *env, pc *kv.PrefixCache, ids []int32, every int) {
	t.Helper()
	s, _ := serveStates(t, pc, ids, every)
	require.True(t, s.Close().OK())
	evictsAll(t, pc)
	st := pc.Stats()
	assert.Zero(t, st.CheckpointBytes, "the checkpoints left with their entry")
	assert.Zero(t, st.PendingCheckpointBytes)
	idleBooks(t, e, pc, "after evicting the entry into the tiers")
}

// TestPrefixCacheTierStates: on recurrent hybrids, on host memory and the CUDA fake,
// with an in-memory tier and the host tier, an entry with checkpoints at its tier
// blocks' ends goes down with their states, and a lookup of its prompt (or of one
// that shares part of it) starts on the tier's blocks: the tokens of every group and
// the states after the match read back bit-exact, the window rule holds, the
// checkpoints' memory comes back once written, and the books are exact.
func TestPrefixCacheTierStates(t *testing.T) {
	for _, model := range stateTierModels {
		for _, be := range tierBackends {
			for _, tk := range tierKinds {
				t.Run(model.Name+"/"+be.name+"/"+tk.name, func(t *testing.T) {
					e, pc, bt := stateTierEnv(t, model, be.kind, tk.make(t))
					ids := promptIDs(7, 5*bt+5)
					owned := e.auth.Stats().Owned - poolIdle(e)
					evictStates(t, e, pc, ids, bt)
					assert.Equal(t, owned, e.auth.Stats().Owned-poolIdle(e), "every granule and state came back")
					st := pc.Stats().Tiers[0]
					assert.Positive(t, st.StoreBytes)
					assert.Zero(t, st.Drops)

					// A block inside the entry serves where its window groups' units
					// went down with it: on tinyNextWin the prefill's window gave them
					// back, so that the step there could not read its window (the
					// window rule, as on the device), and only the entry's last block
					// serves.
					mid := 3 * bt
					if model.Name == tinyNextWin.Name {
						mid = 0
					}
					prompts := []struct {
						ids  []int32
						want int
					}{
						{ids, 5 * bt},
						{append(slices.Clone(ids[:3*bt+7]), promptIDs(9000, 30)...), mid},
						{append(slices.Clone(ids), promptIDs(900, 30)...), 5 * bt},
					}
					for i, p := range prompts {
						probe, err := pc.Probe(p.ids)
						require.NoError(t, err)
						q, m := serveStates(t, pc, p.ids, 0)
						assert.Equal(t, p.want, m, "prompt %d: the last block with states below its last token", i)
						assert.Equal(t, m, probe.Total, "prompt %d: Probe peeks at the values: the load", i)
						require.NoError(t, checkHeldIDs(q, p.ids, 0, len(p.ids)), "prompt %d", i)
						require.NoError(t, checkStates(q, p.ids), "prompt %d: the states stepped on from the loaded ones", i)
						require.True(t, q.Close().OK())
						evictsAll(t, pc)
						idleBooks(t, e, pc, "after a lookup from the tier")
					}
					st = pc.Stats().Tiers[0]
					assert.EqualValues(t, 10*bt+mid, st.Hits, "the tier's tokens")
					assert.Zero(t, st.Invalid)
				})
			}
		}
	}
}

// noPeek is a tier that can not peek at its values (no kv.TierPeeker).
type noPeek struct{ kv.Tier }

// TestPrefixCacheTierStatesSparse: only the blocks whose ends hold a checkpoint carry
// states; a load keeps the blocks up to the last of them it loaded and cuts off the
// rest, so that the sequence holds nothing past the states it starts on. A
// checkpoint off a tier block's end goes down with no block. Probe peeks at the
// values and counts exactly what the lookup loads; from a tier that can not peek it
// counts the whole run the tier holds, its upper bound.
func TestPrefixCacheTierStatesSparse(t *testing.T) {
	for _, be := range tierBackends {
		for _, peek := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/peek=%v", be.name, peek), func(t *testing.T) {
				testTierStatesSparse(t, be.kind, peek)
			})
		}
	}
}

func testTierStatesSparse(t *testing.T, kind backingKind, peek bool) {
	var tier kv.Tier = tiertest.NewMap(64 << 20)
	if !peek {
		tier = noPeek{tier}
	}
	e, pc, bt := stateTierEnv(t, tinyNext, kind, tier)
	ids := promptIDs(7, 5*bt+5)
	s, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	require.Zero(t, m)
	require.NoError(t, prefillTo(s, ids, 2*bt, 0))
	require.NoError(t, s.Checkpoint(2*bt))
	require.NoError(t, prefillTo(s, ids, 4*bt-1, 0))
	require.NoError(t, s.Checkpoint(4*bt-1), "off a tier block's end")
	require.NoError(t, prefillTo(s, ids, len(ids), 0))
	require.NoError(t, pc.Insert(s, ids))
	require.True(t, s.Close().OK())
	evictsAll(t, pc)
	idleBooks(t, e, pc, "after the write-down")

	probe, err := pc.Probe(ids)
	require.NoError(t, err)
	if peek {
		assert.Equal(t, 2*bt, probe.Total, "up to the one block with states, as the lookup")
	} else {
		assert.Equal(t, 5*bt, probe.Total, "the tier holds every block: Probe's bound")
	}
	assert.Equal(t, probe.Total, probe.Tiers[0])
	q, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	assert.Equal(t, 2*bt, m, "the one block with states")
	assert.Equal(t, 2*bt, q.Len(), "nothing held past it")
	require.NoError(t, checkHeldIDs(q, ids, 0, m))
	require.NoError(t, checkStates(q, ids[:m]))
	require.True(t, q.Close().OK())
	st := pc.Stats().Tiers[0]
	assert.EqualValues(t, 2*bt, st.Hits)
	assert.Zero(t, st.Invalid)
	assert.Equal(t, st.StoreBytes, st.LoadBytes, "every block read, and those past the states cut off")
	idleBooks(t, e, pc, "after the load")
}

// TestPrefixCacheTierStatesKept: a block written down without states (its entry had
// no checkpoint at its end: a sequence that started on the tier's blocks and recorded
// none) does not replace the tier's value that has them, so that the next lookup
// still starts on them.
func TestPrefixCacheTierStatesKept(t *testing.T) {
	tier := tiertest.NewMap(64 << 20)
	e, pc, bt := stateTierEnv(t, tinyNext, onShared, tier)
	ids := promptIDs(7, 5*bt+5)
	evictStates(t, e, pc, ids, bt)
	for round := range 2 {
		s, m := serveStates(t, pc, ids, 0)
		require.Equal(t, 5*bt, m, "round %d", round)
		require.True(t, s.Close().OK())
		evictsAll(t, pc)
	}
	assert.Zero(t, pc.Stats().Tiers[0].Drops)
	idleBooks(t, e, pc, "after the rounds")
}

// TestPrefixCacheTierStatesRefused: a value whose states are not the layout's (a
// recurrent group's state of another size, put under this cache's key) is refused as
// corruption, never loaded: the lookup is a miss and the prefill's states read back.
func TestPrefixCacheTierStatesRefused(t *testing.T) {
	tier := tiertest.NewMap(64 << 20)
	e, pc, bt := stateTierEnv(t, tinyNext, onShared, tier)
	ids := promptIDs(7, 2*bt+5)
	evictStates(t, e, pc, ids, bt)
	keys := groupTierKeys(t, e.c, t.Name(), ids)
	// The same value with its state's bytes changed in the layout and the part.
	storeOtherStateSize(t, e.c, tier, keys[0], ids[:bt])

	s, m := serveStates(t, pc, ids, 0)
	assert.Zero(t, m, "the first block refused, nothing past it loaded")
	require.NoError(t, checkStates(s, ids))
	require.True(t, s.Close().OK())
	assert.EqualValues(t, 1, pc.Stats().Tiers[0].Invalid)
	evictsAll(t, pc)
	idleBooks(t, e, pc, "after the refusal")
}

// TestPrefixCacheTierStatesClose: a prefix cache's Close writes its entries down with
// every checkpoint on a tier block's end, so that a new cache of the same model over
// the same tier (a server started again) starts a prompt on the states of any of them.
func TestPrefixCacheTierStatesClose(t *testing.T) {
	tier := tiertest.NewMap(64 << 20)
	e, pc, bt := stateTierEnv(t, tinyNext, onShared, tier)
	ids := promptIDs(7, 5*bt+5)
	s, _ := serveStates(t, pc, ids, bt)
	require.True(t, s.Close().OK())
	require.NoError(t, pc.Close())
	assert.Zero(t, pc.Stats().Tiers[0].Drops)
	assert.Equal(t, 5, tier.Len(), "a value per block")
	e.books(t, "after Close")

	e2 := openEnv(t, onShared, scaled, withLimit(1<<30), withConfig(kv.Config{Model: tinyNext, MaxTokens: 2048}))
	pc2 := newGroupTierCache(t, e2.c, t.Name(), tier)
	for _, shared := range []int{5*bt + 5, 4*bt + 1, 2*bt + 3, bt - 1} {
		p := append(slices.Clone(ids[:shared]), promptIDs(9000, 30)...)
		q, m := serveStates(t, pc2, p, 0)
		assert.Equal(t, min(shared, 5*bt)/bt*bt, m, "sharing %d tokens: the last block end at or below", shared)
		require.True(t, q.Close().OK())
	}
	idleBooks(t, e2, pc2, "after the lookups")
}

// TestPrefixCacheTierStatesRandom is TestPrefixCacheGroupTierRandom on recurrent
// hybrids: random prompts with a host tier small enough to evict, random evictions,
// checkpoints at every tier block's end and at some prompts' ends, by write-back and
// by write-through; every hit, from the device, the tier or both, reads back every
// token and the states after it.
func TestPrefixCacheTierStatesRandom(t *testing.T) {
	for _, model := range stateTierModels {
		for _, through := range []bool{false, true} {
			name := model.Name + "/write-back"
			if through {
				name = model.Name + "/write-through"
			}
			t.Run(name, func(t *testing.T) {
				r := rand.New(rand.NewPCG(49, 1))
				testPrefixCacheGroupTierRandom(t, model, through, 47, func(pc *kv.PrefixCache, ids []int32) (*kv.Sequence, int) {
					s, m, err := pc.Lookup(ids)
					require.NoError(t, err)
					bt := tierBlock(t, s.Cache())
					require.NoError(t, checkHeldIDs(s, ids, 0, m))
					if m > 0 {
						require.NoError(t, checkStates(s, ids[:m]))
					}
					require.NoError(t, prefillTo(s, ids, len(ids), bt))
					if r.IntN(3) == 0 && len(ids)%bt != 0 {
						require.NoError(t, s.Checkpoint(len(ids)), "the prompt's end")
					}
					require.NoError(t, pc.Insert(s, ids))
					return s, m
				})
			})
		}
	}
}

// TestPrefixCacheTierStatesWriteThrough: with TierWriteThrough an entry of a recurrent
// hybrid goes down at its insert, with the states of its checkpoints at its blocks'
// ends, with nothing evicted; eviction (its older checkpoints first) then stores
// nothing again, and a lookup after it starts on the tier's blocks and states.
func TestPrefixCacheTierStatesWriteThrough(t *testing.T) {
	for _, model := range stateTierModels {
		t.Run(model.Name, func(t *testing.T) {
			e := openEnv(t, onShared, scaled, withLimit(1<<30), withConfig(kv.Config{Model: model, MaxTokens: 2048}))
			m := tiertest.NewMap(64 << 20)
			tier := &storeCounter{Tier: m}
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: time.Minute, TierWriteThrough: true})
			require.NoError(t, err)
			closeAtCleanup(t, pc)
			bt := tierBlock(t, e.c)
			ids := promptIDs(7, 5*bt+5)
			s, _ := serveStates(t, pc, ids, bt)
			require.True(t, s.Close().OK())
			require.Eventually(t, func() bool { return m.Len() == 5 }, time.Minute, time.Millisecond)
			assert.EqualValues(t, len(ids), pc.Stats().CachedTokens, "nothing was evicted")
			// The entry is busy until its write-through ended (after its stores); an
			// eviction's stores run within Evict.
			require.Eventually(t, func() bool {
				_, err := pc.Evict(1 << 40)
				return err == nil && pc.Stats().CachedTokens == 0
			}, time.Minute, time.Millisecond)
			assert.EqualValues(t, 5, tier.stores.Load(), "stored through already: not again")
			idleBooks(t, e, pc, "after the eviction")
			q, hit := serveStates(t, pc, ids, 0)
			assert.Equal(t, 5*bt, hit)
			require.True(t, q.Close().OK())
		})
	}
}

// storeCounter counts the stores made into its tier.
type storeCounter struct {
	kv.Tier
	stores atomic.Int64
}

func (c *storeCounter) Store(ctx context.Context, key tierval.Key, size int, fill func([]byte) error) error {
	c.stores.Add(1)
	return c.Tier.Store(ctx, key, size, fill)
}

// TestPrefixCacheTierStatesTruncateFails: where a load wrote the states after a block
// and the cut of the blocks past it fails (the backing refuses the decommit), the new
// sequence would start on other tokens than its states are after: it is damaged
// (ErrDamaged on its next call), never served with wrong states, and its close gives
// everything back. With the full group first its failed cut changes nothing of the
// sequence (Truncate leaves it whole), so only the load knows the states are wrong.
// (The tier can not peek; a load reads the blocks past the states either way.)
func TestPrefixCacheTierStatesTruncateFails(t *testing.T) {
	fullFirst := kv.Model{Name: "tiny-next-full-first", Layers: 4, Groups: []kv.Group{
		tinyNext.Groups[1], tinyNext.Groups[0]}}
	for _, model := range []kv.Model{tinyNext, fullFirst} {
		t.Run(model.Name, func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withFaults, withConfig(kv.Config{Model: model, MaxTokens: 2048}))
			pc := newGroupTierCache(t, e.c, t.Name(), noPeek{tiertest.NewMap(64 << 20)})
			bt := tierBlock(t, e.c)
			ids := promptIDs(7, 3*bt+5)
			s, _, err := pc.Lookup(ids)
			require.NoError(t, err)
			require.NoError(t, prefillTo(s, ids, bt, 0))
			require.NoError(t, s.Checkpoint(bt))
			require.NoError(t, prefillTo(s, ids, len(ids), 0))
			require.NoError(t, pc.Insert(s, ids))
			require.True(t, s.Close().OK())
			evictsAll(t, pc)

			e.faults.FailOp(backingtest.OpDecommit, 1, errInjectedTier)
			q, m, err := pc.Lookup(ids)
			e.faults.Reset()
			require.NoError(t, err, "a tier's failure is a shorter match, never an error of Lookup")
			assert.Zero(t, m)
			err = q.Append(1)
			require.ErrorIs(t, err, kv.ErrDamaged)
			assert.ErrorIs(t, err, errInjectedTier)
			q.Close()
			e.books(t, "after the damaged sequence closed")
		})
	}
}

// TestPrefixCacheTierStatesRefusedReplaced: a refused value is deleted from the tier
// by the load that refused it, so that the next write-down of its block, which has no
// states there, puts a good one in its place (a value without states never replaces
// one the tier holds) and the blocks past it serve again.
func TestPrefixCacheTierStatesRefusedReplaced(t *testing.T) {
	tier := tiertest.NewMap(64 << 20)
	e, pc, bt := stateTierEnv(t, tinyNext, onShared, tier)
	ids := promptIDs(7, 2*bt+5)
	serveAt := func() (*kv.Sequence, int) {
		s, m, err := pc.Lookup(ids)
		require.NoError(t, err)
		if m > 0 {
			require.NoError(t, checkStates(s, ids[:m]))
		}
		require.NoError(t, prefillTo(s, ids, 2*bt, 0))
		if s.Len() == 2*bt && m < 2*bt {
			require.NoError(t, s.Checkpoint(2*bt))
		}
		require.NoError(t, prefillTo(s, ids, len(ids), 0))
		require.NoError(t, pc.Insert(s, ids))
		return s, m
	}
	s, _ := serveAt()
	require.True(t, s.Close().OK())
	evictsAll(t, pc)
	keys := groupTierKeys(t, e.c, t.Name(), ids)
	ctx := context.Background()
	// Block 0's value (no states) damaged in the tier: its last byte flipped.
	var v []byte
	require.NoError(t, tier.Load(ctx, keys[0], func(src []byte) error { v = slices.Clone(src); return nil }))
	v[len(v)-1] ^= 0xff
	require.NoError(t, tier.Store(ctx, keys[0], len(v), func(dst []byte) error { copy(dst, v); return nil }))

	s, m := serveAt()
	assert.Zero(t, m, "block 0 refused: nothing past it loaded")
	assert.EqualValues(t, 1, pc.Stats().Tiers[0].Invalid)
	require.True(t, s.Close().OK())
	evictsAll(t, pc)
	s, m = serveAt()
	assert.Equal(t, 2*bt, m, "block 0 written again, and block 1's states loaded past it")
	require.True(t, s.Close().OK())
	assert.EqualValues(t, 1, pc.Stats().Tiers[0].Invalid)
	idleBooks(t, e, pc, "after the lookups")
}

// TestProbeStatesAllocatesNothing: a Probe that peeks at an in-process tier's values
// to find the last with states allocates nothing either, and counts up to it.
func TestProbeStatesAllocatesNothing(t *testing.T) {
	if probeRace {
		t.Skip("the race detector's sync.Pool drops what is put back: its allocations are not the Probe's")
	}
	e, pc, bt := stateTierEnv(t, tinyNext, onShared, probeHostTier(t))
	ids := promptIDs(7, 5*bt+5)
	evictStates(t, e, pc, ids, 2*bt)
	p, err := pc.Probe(ids)
	require.NoError(t, err)
	assert.Equal(t, 4*bt, p.Total, "the last block with states")
	assert.Zero(t, testing.AllocsPerRun(50, func() {
		_, _ = pc.Probe(ids)
	}))
}

// downTier is a tier whose Contains answers from its Map but whose Load, and Peek
// (peekDown), fail once down is set: at once, or (block) once their context ends.
type downTier struct {
	*tiertest.Map
	down, block bool
}

func (d *downTier) fail(ctx context.Context) error {
	if d.block {
		<-ctx.Done()
		return ctx.Err()
	}
	return errInjectedTier
}

func (d *downTier) Load(ctx context.Context, k tierval.Key, use func([]byte) error) error {
	if d.down {
		return d.fail(ctx)
	}
	return d.Map.Load(ctx, k, use)
}

// noPeekDown is a downTier that can not peek; peekDown one that can.
type (
	noPeekDown struct{ kv.Tier }
	peekDown   struct{ *downTier }
)

func (p peekDown) Peek(ctx context.Context, k tierval.Key, n int, use func([]byte) error) error {
	if p.down {
		return p.fail(ctx)
	}
	return p.Map.Peek(ctx, k, n, use)
}

// TestPrefixCacheTierStatesPeekFails: a tier that fails after its Contains (an error,
// or no answer within TierWait) is a counted drop whether it can peek or not, and a
// Probe whose peek fails counts the run, its upper bound.
func TestPrefixCacheTierStatesPeekFails(t *testing.T) {
	for _, block := range []bool{false, true} {
		for _, peek := range []bool{false, true} {
			t.Run(fmt.Sprintf("block=%v/peek=%v", block, peek), func(t *testing.T) {
				d := &downTier{Map: tiertest.NewMap(64 << 20), block: block}
				var tier kv.Tier = noPeekDown{d}
				if peek {
					tier = peekDown{d}
				}
				e := openEnv(t, onShared, scaled, withLimit(1<<30), withConfig(kv.Config{Model: tinyNext, MaxTokens: 2048}))
				// A wait the blocking tier runs out, long enough that nothing before the
				// peek or the load (a Contains, say) does on a loaded machine.
				pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: 500 * time.Millisecond})
				require.NoError(t, err)
				closeAtCleanup(t, pc)
				bt := tierBlock(t, e.c)
				ids := promptIDs(7, 5*bt+5)
				evictStates(t, e, pc, ids, 2*bt)
				before := pc.Stats().Tiers[0]
				d.down = true
				p, err := pc.Probe(ids)
				require.NoError(t, err)
				assert.Equal(t, 5*bt, p.Total, "the run the tier holds: an upper bound")
				s, m, err := pc.Lookup(ids)
				require.NoError(t, err)
				assert.Zero(t, m)
				st := pc.Stats().Tiers[0]
				assert.EqualValues(t, 1, st.Drops-before.Drops, "the failed load, counted")
				assert.EqualValues(t, 1, st.Misses-before.Misses)
				require.True(t, s.Close().OK())
				idleBooks(t, e, pc, "after the failed load")
			})
		}
	}
}

// TestPrefixCacheTierStatesRefusedPast: a value a load refuses past the last block
// with states (here one written under another state size) is read, counted as
// invalid and deleted, whether the tier can peek or not, so that a good value can
// take its place; Probe, which peeks, counts up to the block before it.
func TestPrefixCacheTierStatesRefusedPast(t *testing.T) {
	for _, peek := range []bool{true, false} {
		t.Run(fmt.Sprintf("peek=%v", peek), func(t *testing.T) {
			m := tiertest.NewMap(64 << 20)
			var tier kv.Tier = m
			if !peek {
				tier = noPeek{m}
			}
			e, pc, bt := stateTierEnv(t, tinyNext, onShared, tier)
			ids := promptIDs(7, 3*bt+5)
			evictStates(t, e, pc, ids, bt)
			keys := groupTierKeys(t, e.c, t.Name(), ids)
			storeOtherStateSize(t, e.c, m, keys[2], ids[2*bt:3*bt])
			p, err := pc.Probe(ids)
			require.NoError(t, err)
			if peek {
				assert.Equal(t, 2*bt, p.Total, "Probe peeks: up to the refused value")
			} else {
				assert.Equal(t, 3*bt, p.Total, "Probe counts the run, an upper bound")
			}

			q, hit := serveStates(t, pc, ids, 0)
			assert.Equal(t, 2*bt, hit, "the last block with states before the refused one")
			st := pc.Stats().Tiers[0]
			assert.EqualValues(t, 1, st.Invalid, "the value of another state size, refused")
			n, err := m.Contains(context.Background(), keys[2:3])
			require.NoError(t, err)
			assert.Zero(t, n, "and deleted")
			require.True(t, q.Close().OK())
		})
	}
}

// storeOtherStateSize stores into m under key a grouped value for the block of tokens
// of c's model with every part present, written under a layout whose recurrent groups'
// states are 8 bytes longer: one a load of c's must refuse.
func storeOtherStateSize(t *testing.T, c *kv.Cache, m *tiertest.Map, key tierval.Key, tokens []int32) {
	t.Helper()
	model := c.Config().Model
	gls := make([]tierval.GroupLayout, len(model.Groups))
	parts := make([]int, len(model.Groups))
	for gi, g := range model.Groups {
		st, err := c.LayerStrides(g.Layers[0])
		require.NoError(t, err)
		if g.Kind == kv.Recurrent {
			gls[gi] = tierval.GroupLayout{Part: tierval.PartState, Kind: uint8(g.Kind), DType: uint8(g.DType),
				Layers: len(g.Layers), UnitBytes: len(g.Layers)*g.StateBytes + 8}
			parts[gi] = gls[gi].UnitBytes
			continue
		}
		gls[gi] = tierval.GroupLayout{Part: tierval.PartUnits, Kind: uint8(g.Kind), DType: uint8(g.DType),
			Window: g.Window, Layers: len(g.Layers), KVHeads: g.KVHeads, HeadDim: g.HeadDim, Tensors: 2,
			UnitTokens: st.BlockTokens, UnitBytes: st.BlockStride}
		parts[gi] = len(tokens) / st.BlockTokens * st.BlockStride
	}
	l, err := tierval.NewLayout(model.Name, gls)
	require.NoError(t, err)
	bad := make([]byte, l.Size(len(tokens), parts))
	require.NoError(t, tierval.EncodeGroups(bad, key, l, tokens, parts, func(int, []byte) error { return nil }))
	require.NoError(t, m.Store(context.Background(), key, len(bad), func(dst []byte) error { copy(dst, bad); return nil }))
}
