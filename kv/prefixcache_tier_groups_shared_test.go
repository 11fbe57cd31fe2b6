//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// tinyChunks is Llama-4's pattern in small: chunked local layers beside a full one,
// its chunk two tier blocks, so that every other tier block ends a chunk, where a
// step reads none of the chunked group's tokens.
var tinyChunks = kv.Model{Name: "tiny-chunks", Layers: 4, Groups: []kv.Group{
	{Kind: kv.ChunkedLocal, Window: 32, Layers: []int{0, 1, 2}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{3}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
}}

// groupTierModels are the models the tier tests on groups run on.
var groupTierModels = []kv.Model{tinyOSS, tinyGemma, tinyChunks, tinyWindows}

// tierBlock returns the tokens of a tier block of c: the least common multiple of its
// layers' blocks (a recurrent layer has none).
func tierBlock(t testing.TB, c *kv.Cache) int {
	t.Helper()
	bt := 1
	for l := range c.Config().Model.Layers {
		st, err := c.LayerStrides(l)
		require.NoError(t, err)
		if st.StateBytes > 0 {
			continue
		}
		a, b := bt, st.BlockTokens
		for b != 0 {
			a, b = b, a%b
		}
		bt = bt / a * st.BlockTokens
	}
	return bt
}

// groupTierKeys returns the tier keys of ids' whole tier blocks in c's prefix cache
// made with TierPrefix prefix (the default namespace).
func groupTierKeys(t testing.TB, c *kv.Cache, prefix string, ids []int32) []tierval.Key {
	t.Helper()
	ns, err := kv.TierNamespace(c.Config(), c.Granularity(), prefix)
	require.NoError(t, err)
	h, err := blockhash.New(blockhash.Options{BlockSize: tierBlock(t, c)})
	require.NoError(t, err)
	var keys []tierval.Key
	for _, x := range h.Chain(nil, h.Root(), 0, ids) {
		keys = append(keys, tierval.Key{Namespace: ns, Hash: x.Uint64()})
	}
	return keys
}

// newGroupTierCache returns a prefix cache over c with tiers under TierPrefix prefix,
// closed by the test's cleanup.
func newGroupTierCache(t *testing.T, c *kv.Cache, prefix string, tiers ...kv.Tier) *kv.PrefixCache {
	t.Helper()
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: tiers, TierPrefix: prefix, TierWait: time.Minute})
	require.NoError(t, err)
	closeAtCleanup(t, pc)
	return pc
}

// evictGroups serves ids on a model of groups, closes the sequence and evicts the
// whole cache, so that the entry's blocks go down into the tiers.
func evictGroups(t *testing.T, e *env, pc *kv.PrefixCache, ids []int32) {
	t.Helper()
	s, _, _, err := serveHybrid(pc, ids)
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	evictsAll(t, pc)
	idleBooks(t, e, pc, "after evicting the entry into the tiers")
}

// TestPrefixCacheGroupTiers: on models of window (sliding, chunked) groups beside
// full and MLA ones, on host memory and the CUDA fake, with an in-memory tier and the
// host tier, an evicted entry goes down into the tier as one value per tier block and
// a lookup of its prompt, or of a longer one, starts on the tier's blocks again: every
// token of every group that the step at the match reads (and every full group's
// token) reads back as written, the window rule holds for the hit, and the counts and
// the books are exact.
func TestPrefixCacheGroupTiers(t *testing.T) {
	for _, model := range groupTierModels {
		for _, be := range tierBackends {
			for _, tk := range tierKinds {
				t.Run(model.Name+"/"+be.name+"/"+tk.name, func(t *testing.T) {
					// NB: tinyWindows' tier block is its MLA group's, 256 tokens.
					e := openEnv(t, be.kind, scaled, withConfig(kv.Config{Model: model, MaxTokens: 2048}))
					tier := tk.make(t)
					pc := newGroupTierCache(t, e.c, t.Name(), tier)
					bt := tierBlock(t, e.c)
					ids := promptIDs(7, 5*bt+5)
					evictGroups(t, e, pc, ids)
					st := pc.Stats().Tiers[0]
					assert.Positive(t, st.StoreBytes)
					assert.Zero(t, st.Drops)

					for i, prompt := range [][]int32{ids, append(slices.Clone(ids), promptIDs(900, 30)...)} {
						q, m, _, err := serveHybrid(pc, prompt)
						require.NoError(t, err, "prompt %d", i)
						assert.Equal(t, 5*bt, m, "prompt %d: the whole tier blocks below its last token", i)
						require.NoError(t, checkHeldIDs(q, prompt, 0, len(prompt)), "prompt %d", i)
						require.True(t, q.Close().OK())
						if i == 0 {
							st := pc.Stats()
							assert.EqualValues(t, 5*bt, st.Tiers[0].Hits, "the tier's tokens")
							assert.EqualValues(t, 5*bt, st.Hits, "tier tokens count as hits")
							assert.Zero(t, st.Tiers[0].Invalid)
							evictsAll(t, pc)
						}
						idleBooks(t, e, pc, "after a lookup from the tier")
					}
				})
			}
		}
	}
}

// TestPrefixCacheGroupTierPartial: a load stops at the first block the tier lacks,
// and a hit ends at the last tier block before it at which every window group holds
// what the step reads: on tinyChunks, whose entry gave back its older chunk units before
// it went down, the last chunk boundary. The sequence holds nothing past it, and what
// it holds reads back.
func TestPrefixCacheGroupTierPartial(t *testing.T) {
	for _, be := range tierBackends {
		t.Run(be.name, func(t *testing.T) {
			e := openEnv(t, be.kind, scaled, withConfig(kv.Config{Model: tinyChunks, MaxTokens: 1024}))
			tier := tiertest.NewMap(4 << 20)
			pc := newGroupTierCache(t, e.c, t.Name(), tier)
			bt := tierBlock(t, e.c)
			chunk := tinyChunks.Groups[0].Window
			require.Zero(t, chunk%bt, "the test wants chunks of whole tier blocks")
			ids := promptIDs(7, 5*bt+5)
			evictGroups(t, e, pc, ids)
			keys := groupTierKeys(t, e.c, t.Name(), ids)
			require.NoError(t, tier.Delete(context.Background(), keys[3]))

			probe, err := pc.Probe(ids)
			require.NoError(t, err)
			q, m, _, err := serveHybrid(pc, ids)
			require.NoError(t, err)
			assert.Equal(t, 3*bt/chunk*chunk, m, "the last chunk boundary of the three blocks loaded")
			assert.Equal(t, m, probe.Total, "Probe peeked at the three values: the window rule's hit")
			require.NoError(t, checkHeldIDs(q, ids, 0, len(ids)))
			require.True(t, q.Close().OK())
			st := pc.Stats().Tiers[0]
			assert.EqualValues(t, m, st.Hits)
			assert.EqualValues(t, 3*bt/chunk*chunk, st.Hits)
			idleBooks(t, e, pc, "after the partial load")
		})
	}
}

// TestPrefixCacheGroupTierCut: where eviction can only shorten an entry (a live
// sequence maps its first units), the whole tier blocks it cuts off go down first,
// from a holder mapping them, so that a later lookup loads the entry's every block:
// on tinyChunks, whose cut stops at a chunk boundary, where the entry still serves.
func TestPrefixCacheGroupTierCut(t *testing.T) {
	for _, be := range tierBackends {
		t.Run(be.name, func(t *testing.T) {
			e := openEnv(t, be.kind, scaled, withConfig(kv.Config{Model: tinyChunks, MaxTokens: 1024}))
			tier := tiertest.NewMap(4 << 20)
			pc := newGroupTierCache(t, e.c, t.Name(), tier)
			bt := tierBlock(t, e.c)
			chunk := tinyChunks.Groups[0].Window
			require.Equal(t, 2*bt, chunk, "the test cuts at the first chunk boundary")
			ids := promptIDs(7, 5*bt+5)
			s, _, _, err := serveHybrid(pc, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			// A live hit on the first chunk and a half.
			live, m, err := pc.Lookup(append(slices.Clone(ids[:chunk+bt/2]), promptIDs(5000, 20)...))
			require.NoError(t, err)
			require.Equal(t, chunk+bt/2, m)
			_, err = pc.Evict(1 << 40)
			require.NoError(t, err)
			assert.Equal(t, chunk, heldPrefix(pc, ids), "the entry was cut to the chunk the live hit maps")
			require.True(t, live.Close().OK())
			evictsAll(t, pc)
			assert.Zero(t, pc.Stats().Tiers[0].Drops)

			q, m, _, err := serveHybrid(pc, ids)
			require.NoError(t, err)
			assert.Equal(t, 5*bt, m, "every block of the entry, the cut ones too, from the tier")
			require.NoError(t, checkHeldIDs(q, ids, 0, len(ids)))
			require.True(t, q.Close().OK())
			idleBooks(t, e, pc, "after the load")
		})
	}
}

// TestPrefixCacheGroupTierRefused: a value of another model (another window: another
// namespace), of another layout under this model's namespace, or of one group, put
// under this cache's key of a prompt's first block is refused as corruption: counted
// in TierStats.Invalid, never mapped, the lookup a miss whose prefill reads back.
func TestPrefixCacheGroupTierRefused(t *testing.T) {
	e := openEnv(t, onShared, scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 1024}))
	// NB: of e's model, scaled as e's is where the granule is larger.
	other := e.c.Config().Model
	other.Name = "tiny-oss-wide"
	other.Groups = slices.Clone(other.Groups)
	other.Groups[0].Window = 48
	c2 := e.cache(t, kv.Config{Model: other, MaxTokens: 1024})
	bt := tierBlock(t, e.c)
	require.Equal(t, bt, tierBlock(t, c2), "the other model's tier blocks are as many tokens")
	ids := promptIDs(7, 3*bt+5)

	// The other model's values of the same prompt.
	theirs := tiertest.NewMap(4 << 20)
	pc2 := newGroupTierCache(t, c2, "p", theirs)
	s, _, _, err := serveHybrid(pc2, ids)
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	evictsAll(t, pc2)
	theirKeys := groupTierKeys(t, c2, "p", ids)
	require.Positive(t, theirs.Len())
	var theirValue []byte
	require.NoError(t, theirs.Load(context.Background(), theirKeys[0], func(src []byte) error {
		theirValue = slices.Clone(src)
		return nil
	}))

	keys := groupTierKeys(t, e.c, "p", ids)
	forged := func(model string, groups int) []byte {
		gl := []tierval.GroupLayout{
			{Part: tierval.PartUnits, Kind: uint8(kv.SlidingWindow), DType: uint8(arena.Float16), Window: 24, Layers: 2, KVHeads: 1, HeadDim: 16, Tensors: 2, UnitTokens: 1, UnitBytes: 1},
			{Part: tierval.PartUnits, Kind: uint8(kv.FullAttention), DType: uint8(arena.Float16), Layers: 2, KVHeads: 2, HeadDim: 32, Tensors: 2, UnitTokens: 1, UnitBytes: 1},
		}
		l, err := tierval.NewLayout(model, gl[:groups])
		require.NoError(t, err)
		parts := make([]int, groups)
		v := make([]byte, l.Size(bt, parts))
		require.NoError(t, tierval.EncodeGroups(v, keys[0], l, ids[:bt], parts, func(int, []byte) error { return nil }))
		return v
	}
	oneGroup := make([]byte, tierval.Size(bt, 8))
	require.NoError(t, tierval.Encode(oneGroup, keys[0], ids[:bt], 8, func([]byte) error { return nil }))
	for _, tt := range []struct {
		name  string
		value []byte
	}{
		{"another model's value", theirValue},
		{"another layout", forged("tiny-oss", 2)},
		{"another group count", forged(tinyOSS.Name, 1)},
		{"a one-group value", oneGroup},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tier := tiertest.NewMap(4 << 20)
			pc := newGroupTierCache(t, e.c, "p", tier)
			require.NoError(t, tier.Store(context.Background(), keys[0], len(tt.value), func(dst []byte) error {
				copy(dst, tt.value)
				return nil
			}))
			p, err := pc.Probe(ids)
			require.NoError(t, err)
			assert.Zero(t, p.Total, "Probe peeked: a head the load refuses serves nothing")
			q, m, _, err := serveHybrid(pc, ids)
			require.NoError(t, err)
			assert.Zero(t, m, "nothing of the value is served")
			require.NoError(t, checkHeldIDs(q, ids, 0, len(ids)))
			require.True(t, q.Close().OK())
			st := pc.Stats().Tiers[0]
			assert.EqualValues(t, 1, st.Invalid)
			assert.Zero(t, st.Hits)
			assert.Zero(t, st.LoadBytes)
			require.NoError(t, pc.Close())
			e.books(t, "after the refusal")
		})
	}
}

// TestPrefixCacheGroupTiersLayout: on a model of groups, tiers need the Blocked layout
// (a block of each group is one contiguous unit), as on one group, and a tier block
// (whole blocks of every group) within MaxTokens.
func TestPrefixCacheGroupTiersLayout(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	for _, tt := range []struct {
		name string
		cfg  kv.Config
		says string
	}{
		{"per layer", kv.Config{Model: tinyWindows, MaxTokens: 1024, Layout: kv.PerLayer}, "only the Blocked layout"},
		{"a tier block past MaxTokens", kv.Config{Model: tinyWindows, MaxTokens: 100}, "more than MaxTokens 100"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := e.cache(t, tt.cfg)
			_, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}})
			require.ErrorIs(t, err, kv.ErrConfig)
			assert.ErrorContains(t, err, tt.says)
		})
	}
}

// TestPrefixCacheGroupTierRandom: random prompts (new ones, earlier ones and their
// continuations) on a gpt-oss-like, a Gemma-like and a Llama-4-like model with a host tier small
// enough to evict, and random evictions of the device's cache, by write-back and by
// write-through: every hit, from the device, the tier or both, holds what the step at
// it reads in every window group and reads back as written; no tier value is
// refused; the counts add up and the books are exact after every request
// (write-back) and after Close.
func TestPrefixCacheGroupTierRandom(t *testing.T) {
	for _, model := range []kv.Model{tinyOSS, tinyGemma, tinyChunks} {
		for _, through := range []bool{false, true} {
			name := model.Name + "/write-back"
			if through {
				name = model.Name + "/write-through"
			}
			t.Run(name, func(t *testing.T) {
				testPrefixCacheGroupTierRandom(t, model, through, 43, func(pc *kv.PrefixCache, ids []int32) (*kv.Sequence, int) {
					s, m, _, err := serveHybrid(pc, ids)
					require.NoError(t, err)
					return s, m
				})
			})
		}
	}
}

// testPrefixCacheGroupTierRandom is TestPrefixCacheGroupTierRandom's run on model, by
// write-through or write-back, its prompts drawn from seed, each served by serve (a
// lookup that checks its hit, a prefill, an insert).
func testPrefixCacheGroupTierRandom(t *testing.T, model kv.Model, through bool, seed uint64, serve func(*kv.PrefixCache, []int32) (*kv.Sequence, int)) {
	e := openEnv(t, onShared, scaled, withLimit(1<<30), withConfig(kv.Config{Model: model, MaxTokens: 512}))
	// NB: the tier's budget and the evictions in bytes scale with the model's bytes
	// per token, so that they hold and evict as many tokens on every granule.
	k := scaleOf(onShared)
	ht, err := hosttier.New(hosttier.Options{Budget: int64(k) << 20, Granule: 4 << 10})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, ht.Close()) })
	pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{ht}, TierPrefix: t.Name(), TierWait: time.Minute, TierWriteThrough: through})
	require.NoError(t, err)
	closeAtCleanup(t, pc)
	r := rand.New(rand.NewPCG(seed, uint64(len(model.Groups))))
	var made [][]int32
	var queries, hits int64
	tierHits, exact := 0, 0
	for range 80 {
		ids := hybridStream(r, made)
		was := pc.Stats().Tiers[0]
		before := was.Hits
		probe, err := pc.Probe(ids)
		require.NoError(t, err)
		s, m := serve(pc, ids)
		require.LessOrEqual(t, m, longestCommon(made, ids))
		if now := pc.Stats().Tiers[0]; now.Unfit == was.Unfit && now.Drops == was.Drops && now.Invalid == was.Invalid {
			// Every load succeeded: Probe, which peeked at the values' heads, said
			// where the window rule stops the hit.
			require.Equal(t, m, probe.Total, "Probe is the lookup (device %d)", probe.Device)
			exact++
		}
		require.NoError(t, checkHeldIDs(s, ids, 0, len(ids)))
		if pc.Stats().Tiers[0].Hits > before {
			tierHits++
		}
		queries += int64(len(ids))
		hits += int64(m)
		made = append(made, ids)
		require.True(t, s.Close().OK())
		if through {
			// The stores of the write-through the insert started end before the next
			// step, so that an eviction finds the index as the seed made it, not as
			// far as the background stores got: a run is the same every time.
			require.Eventually(t, func() bool { return pc.Storing() == 0 }, time.Minute, time.Millisecond)
		}
		if r.IntN(3) == 0 {
			_, err := pc.Evict(int64(r.IntN(1<<16)) * int64(k))
			require.NoError(t, err)
		}
		if !through {
			// NB: a write-through's entry closes after its stores, in the
			// background: the books are read after Close then.
			idleBooks(t, e, pc, "after a request")
		}
	}
	st := pc.Stats()
	assert.Equal(t, queries, st.Queries)
	assert.Equal(t, hits, st.Hits)
	assert.Zero(t, st.Tiers[0].Invalid)
	assert.Positive(t, tierHits, "lookups that loaded from the tier")
	assert.Positive(t, exact, "lookups Probe counted exactly")
	require.NoError(t, pc.Close())
	e.books(t, "after the close, every block written down")
}

// TestPrefixCacheGroupTierNamespaces: on a model of groups, a namespace's blocks go
// into the tiers under its own keys: a lookup in another namespace loads none of
// them, even from a tier that hands back a value of the same tokens whatever the
// namespace (refused: TierStats.Invalid), and a lookup in the same one loads them all.
func TestPrefixCacheGroupTierNamespaces(t *testing.T) {
	e := openEnv(t, onShared, scaled, withConfig(kv.Config{Model: tinyGemma, MaxTokens: 1024}))
	tier := &nsTier{blind: true}
	pc := newGroupTierCache(t, e.c, t.Name(), tier)
	bt := tierBlock(t, e.c)
	a, b := kv.Namespace{Adapter: "a"}, kv.Namespace{Adapter: "b"}
	ids := promptIDs(7, 3*bt+5)
	serveIn := func(ns kv.Namespace, insert bool) int {
		s, m, err := pc.LookupIn(ns, ids)
		require.NoError(t, err)
		require.NoError(t, checkHeldIDs(s, ids, 0, m))
		require.NoError(t, s.Append(len(ids)-m))
		require.NoError(t, writeHeldIDs(s, ids, m, len(ids)))
		if insert {
			require.NoError(t, pc.InsertIn(ns, s, ids))
		}
		require.NoError(t, checkHeldIDs(s, ids, 0, len(ids)))
		require.True(t, s.Close().OK())
		return m
	}
	serveIn(a, true)
	evictsAll(t, pc)
	assert.Zero(t, serveIn(b, false), "another namespace's blocks")
	assert.EqualValues(t, 1, pc.Stats().Tiers[0].Invalid, "the blind tier's value of a, refused in b")
	assert.Equal(t, 3*bt, serveIn(a, false), "the namespace's own blocks")
	assert.EqualValues(t, 3*bt, pc.Stats().Tiers[0].Hits)
	idleBooks(t, e, pc, "after the lookups")
}

// TestProbeWindowsAllocatesNothing: on a window hybrid, a Probe that peeks at an
// in-process tier's values to find where the window rule ends the hit allocates
// nothing, and counts up to there.
func TestProbeWindowsAllocatesNothing(t *testing.T) {
	if probeRace {
		t.Skip("the race detector's sync.Pool drops what is put back: its allocations are not the Probe's")
	}
	e := openEnv(t, onShared, scaled, withConfig(kv.Config{Model: tinyGemma, MaxTokens: 2048}))
	pc := newGroupTierCache(t, e.c, t.Name(), probeHostTier(t))
	bt := tierBlock(t, e.c)
	ids := promptIDs(7, 5*bt+5)
	evictGroups(t, e, pc, ids)
	p, err := pc.Probe(ids)
	require.NoError(t, err)
	assert.Equal(t, 5*bt, p.Total, "the entry's last tier block, whose window went down with it")
	assert.Zero(t, testing.AllocsPerRun(50, func() {
		_, _ = pc.Probe(ids)
	}))
}

// tinyOSSLong is tinyOSS with a window of 90 tokens: the step at a tier block's end
// reads that block and the two before it (tier blocks of 32 tokens, scaled).
var tinyOSSLong = kv.Model{Name: "tiny-oss-long", Layers: 4, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 90, Layers: []int{0, 2}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{1, 3}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
}}

// peekFails is a tier whose Peek fails for one key (the load still reads it): with
// an error, or, silent, by returning none without calling use (which TierPeeker's
// contract forbids).
type peekFails struct {
	*tiertest.Map
	key    tierval.Key
	silent bool
}

func (p *peekFails) Peek(ctx context.Context, k tierval.Key, n int, use func([]byte) error) error {
	switch {
	case k == p.key && p.silent:
		return nil
	case k == p.key:
		return errInjectedTier
	}
	return p.Map.Peek(ctx, k, n, use)
}

// TestProbeWindowsRefusedInRun: on a window hybrid whose window spans three tier
// blocks, where one value of a tier's run is one the load refuses (a head of no
// value, or a value without its full group's part), the load stops there and serves
// up to the last block before it where the window rule holds. Probe peeks at the last
// block's value and at those the step there reads, and says the same where the
// refused one is among them; where it lies below them (a value damaged that only a
// read would tell), and where a peek fails (or returns without reading a head),
// Probe's count is the run's, an upper bound.
func TestProbeWindowsRefusedInRun(t *testing.T) {
	long := tinyOSSLong
	e := openEnv(t, onShared, scaled, withConfig(kv.Config{Model: long, MaxTokens: 2048}))
	bt := tierBlock(t, e.c)
	// The first block the step at block 4's end reads.
	lo := long.Groups[0].FirstLive(5*bt) / bt
	require.Equal(t, 2, lo, "the test wants the step at block 4's end to read blocks 2 to 4 (tier blocks of %d tokens)", bt)
	ids := promptIDs(7, 5*bt+5)
	ctx := context.Background()
	for _, damage := range []string{"no value", "no full part", "peek fails", "peek reads nothing"} {
		for bad := range 5 {
			what := fmt.Sprintf("%s at value %d", damage, bad)
			tier := &peekFails{Map: tiertest.NewMap(64 << 20)}
			pc := newGroupTierCache(t, e.c, t.Name(), tier)
			evictGroups(t, e, pc, ids)
			p, err := pc.Probe(ids)
			require.NoError(t, err)
			require.Equal(t, 5*bt, p.Total, "every value whole: the entry's blocks")
			keys := groupTierKeys(t, e.c, t.Name(), ids)
			switch damage {
			case "no value":
				require.NoError(t, tier.Store(ctx, keys[bad], 64, func(dst []byte) error {
					copy(dst, "not a tier value")
					return nil
				}))
			case "no full part":
				// The window group's part whole, the full group's none: a value
				// the load refuses (ErrBlock), whose head PeekParts takes.
				l, parts := kv.TierLayout(pc)
				require.NotNil(t, l)
				parts[1] = 0
				size := l.Size(bt, parts)
				require.NoError(t, tier.Store(ctx, keys[bad], size, func(dst []byte) error {
					return tierval.EncodeGroups(dst, keys[bad], l, ids[bad*bt:(bad+1)*bt], parts, func(int, []byte) error { return nil })
				}))
			case "peek fails":
				tier.key = keys[bad]
			case "peek reads nothing":
				tier.key, tier.silent = keys[bad], true
			}
			p, err = pc.Probe(ids)
			require.NoError(t, err)
			q, m, _, err := serveHybrid(pc, ids)
			require.NoError(t, err)
			switch {
			case damage == "peek fails", damage == "peek reads nothing":
				assert.Equal(t, 5*bt, m, "%s: the load reads it", what)
				assert.Equal(t, 5*bt, p.Total, "%s: the run", what)
			case bad >= lo:
				assert.LessOrEqual(t, m, bad*bt, "%s: nothing past it served", what)
				assert.Equal(t, m, p.Total, "%s, among those Probe peeks at: Probe is the lookup", what)
				assert.EqualValues(t, 1, pc.Stats().Tiers[0].Invalid, what)
			default:
				assert.LessOrEqual(t, m, bad*bt, "%s: nothing past it served", what)
				assert.Equal(t, 5*bt, p.Total, "%s, below those Probe peeks at: the run", what)
				assert.EqualValues(t, 1, pc.Stats().Tiers[0].Invalid, what)
			}
			require.NoError(t, checkHeldIDs(q, ids, 0, len(ids)), what)
			require.True(t, q.Close().OK())
			require.NoError(t, pc.Close())
			e.books(t, what)
		}
	}
}

// inProcNoPeek is an in-process tier that can not peek at its values.
type inProcNoPeek struct{ kv.Tier }

func (inProcNoPeek) InProcess() bool { return true }

// BenchmarkProbeWindows: what Probe's exact count costs on window hybrids (tinyGemma,
// whose window lies in one tier block; tinyOSSLong, whose window spans three) whose
// whole prompt of 20 tier blocks the host tier holds: peeking at the values' heads
// (peek=true: the last block's, and those before it that the step there reads)
// against counting the run, as from an in-process tier that can not peek
// (peek=false).
func BenchmarkProbeWindows(b *testing.B) {
	for _, model := range []kv.Model{tinyGemma, tinyOSSLong} {
		for _, peek := range []bool{true, false} {
			benchmarkProbeWindows(b, model, peek)
		}
	}
}

// benchmarkProbeWindows is BenchmarkProbeWindows's run on model, with or without
// peeks.
func benchmarkProbeWindows(b *testing.B, model kv.Model, peek bool) {
	var tier kv.Tier = probeHostTier(b)
	if !peek {
		tier = inProcNoPeek{tier}
	}
	e := openEnv(b, onShared, scaled, withConfig(kv.Config{Model: model, MaxTokens: 2048}))
	pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierPrefix: b.Name(), TierWait: time.Minute})
	require.NoError(b, err)
	b.Cleanup(func() { assert.NoError(b, pc.Close()) })
	bt := tierBlock(b, e.c)
	ids := promptIDs(7, 20*bt+5)
	s, _, _, err := serveHybrid(pc, ids)
	require.NoError(b, err)
	require.True(b, s.Close().OK())
	_, err = pc.Evict(1 << 40)
	require.NoError(b, err)
	p, err := pc.Probe(ids)
	require.NoError(b, err)
	require.Equal(b, 20*bt, p.Total)
	b.Run(fmt.Sprintf("model=%s/peek=%v", model.Name, peek), func(b *testing.B) {
		for b.Loop() {
			_, _ = pc.Probe(ids)
		}
	})
}
