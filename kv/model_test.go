package kv_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// hybrid is a small model with every kind: layers 0-1 full, 2-3 sliding (window 5),
// 4 chunked (chunks of 6), 5 an MLA latent, 6 recurrent.
func hybrid() kv.Model {
	return kv.Model{Name: "hybrid", Layers: 7, Groups: []kv.Group{
		{Kind: kv.FullAttention, Layers: []int{0, 1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
		{Kind: kv.SlidingWindow, Window: 5, Layers: []int{2, 3}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
		{Kind: kv.ChunkedLocal, Window: 6, Layers: []int{4}, KVHeads: 1, HeadDim: 32, DType: arena.Q8_0},
		{Kind: kv.MLALatent, Layers: []int{5}, KVHeads: 1, HeadDim: 48, DType: arena.Float8E4M3, Scales: kv.ScalePerTensor},
		{Kind: kv.Recurrent, Layers: []int{6}, StateBytes: 1000},
	}}
}

func TestModelValidateBadInputs(t *testing.T) {
	require.NoError(t, hybrid().Validate(64))
	tests := []struct {
		name  string
		edit  func(m *kv.Model)
		max   int
		words string
	}{
		{"zero layers", func(m *kv.Model) { m.Layers = 0 }, 0, "0 layers"},
		{"no groups", func(m *kv.Model) { m.Groups = nil }, 0, "no layer groups"},
		{"unknown kind", func(m *kv.Model) { m.Groups[0].Kind = 0 }, 0, "unknown attention kind"},
		{"a kind past the last", func(m *kv.Model) { m.Groups[0].Kind = kv.Recurrent + 1 }, 0, "unknown attention kind"},
		{"a group without layers", func(m *kv.Model) { m.Groups[4].Layers = nil }, 0, "no layers"},
		{"a window larger than MaxTokens", func(m *kv.Model) {}, 4, "larger than MaxTokens 4"},
		{"a sliding window of no tokens", func(m *kv.Model) { m.Groups[1].Window = 0 }, 0, "window 0 must be positive"},
		{"a chunk of negative tokens", func(m *kv.Model) { m.Groups[2].Window = -6 }, 0, "window -6 must be positive"},
		{"a window on full attention", func(m *kv.Model) { m.Groups[0].Window = 8 }, 0, "only for sliding-window"},
		{"an MLA group with V", func(m *kv.Model) { m.Groups[3].Tensors = 2 }, 0, "no V"},
		{"attention without V", func(m *kv.Model) { m.Groups[0].Tensors = 1 }, 0, "K and V"},
		{"a recurrent group without state", func(m *kv.Model) { m.Groups[4].StateBytes = 0 }, 0, "must be positive"},
		{"a recurrent group with heads", func(m *kv.Model) { m.Groups[4].KVHeads = 2 }, 0, "no per-token tensors"},
		{"state bytes on attention", func(m *kv.Model) { m.Groups[0].StateBytes = 8 }, 0, "only for recurrent"},
		{"a layer outside the model", func(m *kv.Model) { m.Groups[0].Layers = []int{0, 7} }, 0, "layer 7 of a 7-layer model"},
		{"a negative layer", func(m *kv.Model) { m.Groups[0].Layers = []int{-1, 1} }, 0, "layer -1"},
		{"a layer listed twice", func(m *kv.Model) { m.Groups[1].Layers = []int{1, 3} }, 0, "layer 1 is listed twice (groups 0 and 1)"},
		{"a layer in no group", func(m *kv.Model) { m.Groups[1].Layers = []int{3} }, 0, "layer 2 of model \"hybrid\" is in no group"},
		{"zero KV heads", func(m *kv.Model) { m.Groups[0].KVHeads = 0 }, 0, "must be positive"},
		{"a head dim Q8_0 can not block", func(m *kv.Model) { m.Groups[2].HeadDim = 20 }, 0, "head dim 20"},
		{"FP8 scales on bf16", func(m *kv.Model) { m.Groups[0].Scales = kv.ScalePerHead }, 0, "scales are for FP8"},
		{"an unknown element type", func(m *kv.Model) { m.Groups[0].DType = 0 }, 0, "element type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := hybrid()
			tt.edit(&m)
			err := m.Validate(tt.max)
			require.ErrorIs(t, err, kv.ErrModel)
			assert.Contains(t, err.Error(), tt.words)
			_, err = m.Size(64<<10, 0, 10)
			if tt.max == 0 {
				assert.ErrorIs(t, err, kv.ErrModel, "Size validates too")
			}
		})
	}
	assert.ErrorIs(t, hybrid().Validate(-1), kv.ErrConfig)
	for _, bad := range []struct{ granule, blockTokens, tokens int }{{0, 0, 1}, {3 << 10, 0, 1}, {64 << 10, 0, -1}, {64 << 10, -1, 1}, {64 << 10, 1 << 62, 1}} {
		_, err := hybrid().Size(bad.granule, bad.blockTokens, bad.tokens)
		assert.ErrorIs(t, err, kv.ErrConfig, "Size(%d, %d, %d)", bad.granule, bad.blockTokens, bad.tokens)
	}
}

func TestModelBytesPerToken(t *testing.T) {
	m := hybrid()
	want := []int{
		2 * 2 * 2 * 16 * 2, // full: 2 layers × K,V × 2 heads × 16 × 2 bytes
		2 * 2 * 2 * 16 * 2, // sliding: the same shape
		1 * 2 * 1 * 34,     // chunked: 1 layer × K,V × 1 head × one Q8_0 block of 32 values
		1 * 1 * 1 * 48,     // MLA: 1 layer × 1 latent × 48 FP8 values (the scales are the cache's)
		0,                  // recurrent: no tokens
	}
	total := 0
	for i, g := range m.Groups {
		assert.Equal(t, want[i], g.BytesPerToken(), "group %d (%v)", i, g.Kind)
		total += want[i]
	}
	assert.Equal(t, total, m.BytesPerToken())
	assert.Equal(t, 0, kv.Group{Kind: kv.FullAttention, KVHeads: 1, HeadDim: 33, DType: arena.Q8_0}.TokenBytes(), "a shape the type can not hold")
}

// firstLive is Group.FirstLive from the kinds' definitions: the least token the
// next one (at position n) reads.
func firstLive(g kv.Group, n int) int {
	for t := 0; t < n; t++ {
		switch {
		case g.Kind == kv.SlidingWindow && n-t < g.Window,
			g.Kind == kv.ChunkedLocal && t/g.Window == n/g.Window,
			g.Kind == kv.FullAttention || g.Kind == kv.MLALatent:
			return t
		}
	}
	if g.Kind == kv.FullAttention || g.Kind == kv.MLALatent || g.Kind == kv.Recurrent {
		return 0
	}
	return n
}

// TestModelSizeModel checks Size against a plain model: the blocks that hold a live
// token, counted one token at a time.
func TestModelSizeModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 1))
	models := append(kv.Presets(), hybrid())
	for _, m := range models {
		for _, granule := range []int{4 << 10, 2 << 20} {
			for range 8 {
				n, bt := rng.IntN(9000), []int{0, 1, 7, 64}[rng.IntN(4)]
				s, err := m.Size(granule, bt, n)
				require.NoError(t, err)
				var need, committed, packed int64
				for i, g := range m.Groups {
					gs := s.Groups[i]
					assert.Equal(t, g.Kind, gs.Kind)
					assert.Equal(t, len(g.Layers), gs.Layers)
					if g.Kind == kv.Recurrent {
						state := len(g.Layers) * g.StateBytes
						if n > 0 {
							assert.Equal(t, int64(state), gs.Need)
							assert.Equal(t, int64((state+granule-1)/granule*granule), gs.Committed)
							assert.Equal(t, gs.Committed, gs.Packed)
						}
						need, committed, packed = need+gs.Need, committed+gs.Committed, packed+gs.Packed
						continue
					}
					require.Equal(t, firstLive(g, n), g.FirstLive(n), "%s group %d at %d tokens", m.Name, i, n)
					// A sequence of n tokens holds what its last step read: the step
					// that appended token n-1.
					first := firstLive(g, max(n-1, 0))
					bpt := g.BytesPerToken()
					tpb, blk := refBlock(g, granule, bt)
					require.Equal(t, blk, gs.BlockBytes)
					require.Equal(t, tpb, gs.BlockTokens)
					require.Equal(t, blk-tpb*bpt, gs.DeadBytes)
					blocks, granules := map[int]bool{}, map[int]bool{}
					for tok := first; tok < n; tok++ {
						blocks[tok/gs.BlockTokens] = true
						granules[tok*bpt/granule] = true
						granules[((tok+1)*bpt-1)/granule] = true
					}
					if bpt > granule { // a token spans whole granules between its ends
						granules = map[int]bool{}
						for b := first * bpt / granule; n > first && b <= (n*bpt-1)/granule; b++ {
							granules[b] = true
						}
					}
					assert.Equal(t, n-first, gs.Live)
					assert.Equal(t, int64(n-first)*int64(bpt), gs.Need, "%s group %d at %d tokens", m.Name, i, n)
					assert.Equal(t, int64(len(blocks))*int64(blk), gs.Committed, "%s group %d at %d tokens", m.Name, i, n)
					assert.Equal(t, int64(len(granules))*int64(granule), gs.Packed, "%s group %d at %d tokens", m.Name, i, n)
					need, committed, packed = need+gs.Need, committed+gs.Committed, packed+gs.Packed
				}
				assert.Equal(t, need, s.Need)
				assert.Equal(t, committed, s.Committed)
				assert.Equal(t, packed, s.Packed)
			}
		}
	}
}

// TestModelSizeMatchesConfigSize: Model.Size of a uniform preset commits what
// Config.Size says the Blocked layout commits, and Config.Size gives its one group's
// blocks.
func TestModelSizeMatchesConfigSize(t *testing.T) {
	for _, g := range kv.Presets() {
		if !isUniform(g) {
			continue
		}
		m := g
		require.NoError(t, m.Validate(0))
		for _, granule := range []int{64 << 10, 2 << 20} {
			for _, n := range []int{0, 1, 17, 1000, 8191, 32768} {
				for _, bt := range []int{0, 5, 64} {
					want, err := kv.Config{Model: g, Layout: kv.Blocked, BlockTokens: bt, MaxTokens: 32768}.Size(granule, n)
					require.NoError(t, err)
					got, err := m.Size(granule, bt, n)
					require.NoError(t, err)
					assert.Equal(t, want.Committed, got.Committed, "%s at %d tokens in blocks of %d on %d-byte granules", g.Name, n, bt, granule)
					assert.Equal(t, want.Used, got.Need)
					assert.Equal(t, want.BlockTokens, got.Groups[0].BlockTokens)
				}
			}
		}
	}
}

// TestPresets checks the presets' layer groups against the patterns their
// configs state.
func TestPresets(t *testing.T) {
	want := map[string][][2]int{ // per group: kind, layers
		"llama3-8b":          {{int(kv.FullAttention), 32}},
		"llama3-70b":         {{int(kv.FullAttention), 80}},
		"qwen2.5-7b":         {{int(kv.FullAttention), 28}},
		"llama3.2-1b":        {{int(kv.FullAttention), 16}},
		"qwen2.5-0.5b":       {{int(kv.FullAttention), 24}},
		"tiny":               {{int(kv.FullAttention), 2}},
		"gpt-oss-20b":        {{int(kv.SlidingWindow), 12}, {int(kv.FullAttention), 12}},
		"gpt-oss-120b":       {{int(kv.SlidingWindow), 18}, {int(kv.FullAttention), 18}},
		"gemma-3-27b":        {{int(kv.SlidingWindow), 52}, {int(kv.FullAttention), 10}},
		"gemma-3-12b":        {{int(kv.SlidingWindow), 40}, {int(kv.FullAttention), 8}},
		"llama-4-scout":      {{int(kv.ChunkedLocal), 36}, {int(kv.FullAttention), 12}},
		"deepseek-v3":        {{int(kv.MLALatent), 61}},
		"deepseek-r1":        {{int(kv.MLALatent), 61}},
		"qwen3-8b":           {{int(kv.FullAttention), 36}},
		"qwen3-32b":          {{int(kv.FullAttention), 64}},
		"qwen3-next-80b-a3b": {{int(kv.Recurrent), 36}, {int(kv.FullAttention), 12}},
	}
	presets := kv.Presets()
	require.Len(t, presets, len(want))
	for _, m := range presets {
		require.NoError(t, m.Validate(128<<10), m.Name)
		groups, ok := want[m.Name]
		require.True(t, ok, m.Name)
		require.Len(t, m.Groups, len(groups), m.Name)
		for i, g := range m.Groups {
			assert.Equal(t, kv.Attention(groups[i][0]), g.Kind, "%s group %d", m.Name, i)
			assert.Len(t, g.Layers, groups[i][1], "%s group %d", m.Name, i)
		}
		got, err := kv.Preset(m.Name)
		require.NoError(t, err)
		assert.Equal(t, m, got)
		// Each call answers a fresh value: a caller that changes one changes no
		// other caller's.
		got.Name, got.Groups[0].KVHeads, got.Groups[0].Layers[0] = "changed", 99, -1
		again, err := kv.Preset(m.Name)
		require.NoError(t, err)
		assert.Equal(t, m, again, "a changed preset is the caller's")
		assert.Equal(t, m, kv.Presets()[slices.IndexFunc(presets, func(p kv.Model) bool { return p.Name == m.Name })])
	}
	// The figures the issue states, from the configs.
	assert.Equal(t, 576, kv.DeepSeekV3().Groups[0].HeadDim, "kv_lora_rank 512 + rope 64")
	assert.Equal(t, 1024, kv.Gemma3_27B().Groups[0].Window)
	assert.Equal(t, []int{5, 11, 17, 23, 29, 35, 41, 47, 53, 59}, kv.Gemma3_27B().Groups[1].Layers)
	assert.Equal(t, []int{3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47}, kv.Llama4Scout().Groups[1].Layers)
	assert.Equal(t, 1_097_728, kv.Qwen3Next80B().Groups[0].StateBytes)

	_, err := kv.Preset("gpt-5")
	assert.ErrorIs(t, err, kv.ErrUnknownModel)
	assert.Contains(t, err.Error(), "gemma-3-27b")

	// Each call is a fresh value: editing one changes no other.
	a := kv.GPTOSS20B()
	a.Groups[0].Layers[0] = 99
	assert.Equal(t, 0, kv.GPTOSS20B().Groups[0].Layers[0])
}

func TestModelUniform(t *testing.T) {
	m := hybrid()
	u := m.Uniform()
	kinds := []kv.Attention{kv.FullAttention, kv.FullAttention, kv.FullAttention, kv.MLALatent, kv.Recurrent}
	for i, g := range u.Groups {
		assert.Equal(t, kinds[i], g.Kind)
		assert.Zero(t, g.Window)
	}
	assert.Equal(t, kv.SlidingWindow, m.Groups[1].Kind, "the model itself is unchanged")
	require.NoError(t, u.Validate(0))
}

// TestModelTargetOneBlock checks the issue's target arithmetic on one sequence of 128K
// tokens of each preset on 2 MiB granules: each group commits at most one block beyond
// the fewest whole blocks that hold its live tokens (a full group exactly the fewest).
// NB: a sliding window's live tokens start mid-block, so the window can straddle one
// block more than the fewest, partly dead at its front and partly empty at its end: the
// target holds for it as "one block beyond the fewest", not as "one partly filled
// block". Each block's tail that holds no whole token is waste on top.
func TestModelTargetOneBlock(t *testing.T) {
	const granule = 2 << 20
	straddles := false
	for _, m := range kv.Presets() {
		for _, n := range []int{128 << 10, 128<<10 + 1, 128<<10 - 1, 100_003} {
			s, err := m.Size(granule, 0, n)
			require.NoError(t, err)
			for i, gs := range s.Groups {
				// Packed: at most one partly filled granule at the end, and a window's
				// one partly dead granule at the front.
				if gs.Kind == kv.SlidingWindow || gs.Kind == kv.ChunkedLocal {
					assert.Less(t, gs.Packed-gs.Need, int64(2*granule), "%s group %d at %d tokens", m.Name, i, n)
				} else {
					assert.Less(t, gs.Packed-gs.Need, int64(granule), "%s group %d at %d tokens", m.Name, i, n)
				}
				if gs.Kind == kv.Recurrent {
					assert.Less(t, gs.Committed-gs.Need, int64(granule), "%s: a recurrent state rounds up to one granule at most", m.Name)
					continue
				}
				blocks := int(gs.Committed / int64(gs.BlockBytes))
				fewest := (gs.Live + gs.BlockTokens - 1) / gs.BlockTokens
				switch gs.Kind {
				case kv.SlidingWindow, kv.ChunkedLocal:
					assert.LessOrEqual(t, blocks, fewest+1, "%s group %d at %d tokens", m.Name, i, n)
					straddles = straddles || blocks == fewest+1
				default:
					assert.Equal(t, fewest, blocks, "%s group %d at %d tokens", m.Name, i, n)
				}
				tail := gs.BlockBytes - gs.BlockTokens*gs.BytesPerToken
				assert.LessOrEqual(t, gs.Committed-gs.Need, int64(2*gs.BlockBytes)+int64(blocks*tail)-int64(2*tail), "%s group %d", m.Name, i)
			}
		}
	}
	assert.True(t, straddles, "some window straddles one block more than the fewest: the NB above is real")
}

func ExampleModel_Size() {
	m := kv.GPTOSS20B()
	s, err := m.Size(2<<20, 0, 128<<10) // 2 MiB granules, each group's own block
	if err != nil {
		panic(err)
	}
	for _, g := range s.Groups {
		fmt.Printf("%v: %d layers, %d B/token, %d tokens per block of %d bytes, %d dead (%s)\n",
			g.Kind, g.Layers, g.BytesPerToken, g.BlockTokens, g.BlockBytes, g.DeadBytes, g.Block)
		fmt.Printf("  %d live, need %d, commit %d, packed %d\n", g.Live, g.Need, g.Committed, g.Packed)
	}
	// Output:
	// sliding-window: 12 layers, 24576 B/token, 64 tokens per block of 2097152 bytes, 524288 dead (the fewest dead bytes per block of 64 tokens at most, half the window (no whole number of tokens fills whole granules within it))
	//   128 live, need 3145728, commit 4194304, packed 4194304
	// full: 12 layers, 24576 B/token, 256 tokens per block of 6291456 bytes, 0 dead (256 whole tokens fill 3 whole granules)
	//   131072 live, need 3221225472, commit 3221225472, packed 3221225472
}

func ExampleModel_Validate() {
	m := kv.DeepSeekV3()
	m.Groups[0].Tensors = 2 // a V beside the latent
	fmt.Println(m.Validate(128 << 10))
	g := kv.Gemma3_27B()
	fmt.Println(g.Validate(512))
	fmt.Println(kv.Llama3_8B().Validate(8192))
	// Output:
	// kv: invalid model: group 0 (mla-latent): 2 tensors per layer: an MLA group keeps one latent and no V
	// kv: invalid model: group 0 (sliding-window): window of 1024 tokens is larger than MaxTokens 512
	// <nil>
}

// withScales returns a copy of m (cloned) with every group's Scales set to s.
func withScales(m kv.Model, s kv.ScaleMode) kv.Model {
	m = cloned(m)
	for i := range m.Groups {
		m.Groups[i].Scales = s
	}
	return m
}

// cloned returns a copy of m that shares no slice with it: a test changes the copy's
// groups without changing a model other tests read.
func cloned(m kv.Model) kv.Model {
	m.Groups = slices.Clone(m.Groups)
	for i := range m.Groups {
		m.Groups[i].Layers = slices.Clone(m.Groups[i].Layers)
	}
	return m
}

// TestUniformTierNamespaceKept: a uniform model's tier namespace is the one the same
// shape had before Model described every cache (as a Geometry, the first version's
// encoding), so that blocks a tier stored then are found now; a model of groups keeps
// its own. The figures are TierNamespace's answers on the tree before the change. A
// block cut into runs (Config.RunTokens) lays its bytes out otherwise, so its namespace
// is another, and a block of one run (the default, or a RunTokens that holds the
// block) keeps the namespace it had before runs were made.
func TestUniformTierNamespaceKept(t *testing.T) {
	fp8 := withScales(kv.Uniform("fp8", 3, 4, 64, arena.Float8E4M3), kv.ScalePerHead)
	for _, tt := range []struct {
		cfg     kv.Config
		granule int
		prefix  string
		want    uint64
	}{
		{kv.Config{Model: kv.Llama3_8B()}, 2 << 20, "", 0x1f9c1be504898016},
		{kv.Config{Model: kv.Tiny(), Layout: kv.PerLayer}, 64 << 10, "tenant", 0xd58684cb973a0d69},
		{kv.Config{Model: fp8, BlockTokens: 16}, 64 << 10, "p", 0x461bb1804108110e},
		{kv.Config{Model: kv.GPTOSS20B()}, 2 << 20, "p", 0x1558ab45bdeef5eb},
		{kv.Config{Model: kv.GPTOSS20B(), RunTokens: 256}, 2 << 20, "p", 0x1558ab45bdeef5eb},
		{kv.Config{Model: kv.GPTOSS20B(), RunTokens: 16}, 2 << 20, "p", 0xe669e0afdbd183b8},
	} {
		got, err := kv.TierNamespace(tt.cfg, tt.granule, tt.prefix)
		require.NoError(t, err)
		assert.Equal(t, tt.want, got, "%s", tt.cfg.Model.Name)
	}
}
