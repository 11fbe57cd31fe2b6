package kv_test

import (
	"bytes"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

func TestTierNamespace(t *testing.T) {
	base := kv.Config{Model: kv.Llama3_8B(), BlockTokens: 16}
	const gran = 2 << 20
	ns, err := kv.TierNamespace(base, gran, "p")
	require.NoError(t, err)
	again, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_8B(), BlockTokens: 16, MaxTokens: 1 << 20, MapAhead: true}, gran, "p")
	require.NoError(t, err)
	assert.Equal(t, ns, again, "MaxTokens and MapAhead do not change a block's bytes")
	// Llama-3-8B's token of all layers is 128 KiB, so 16 tokens fill one 2 MiB block
	// exactly, as does any BlockTokens from 1 to 16.
	one, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_8B(), BlockTokens: 1}, gran, "p")
	require.NoError(t, err)
	assert.Equal(t, ns, one, "two BlockTokens that make the same block")

	fp8 := kv.Llama3_8B()
	fp8.Groups[0].DType = arena.Float8E4M3
	fp8Scaled := withScales(fp8, kv.ScalePerTensor)
	with := func(f func(g *kv.Model)) kv.Config {
		c := base
		c.Model = cloned(c.Model)
		f(&c.Model)
		return c
	}
	seen := map[uint64]string{ns: "base"}
	for _, tt := range []namespaceCase{
		{"name", with(func(g *kv.Model) { g.Name = "other" }), gran, "p"},
		{"layers", with(func(g *kv.Model) {
			u := g.Groups[0]
			*g = kv.Uniform(g.Name, g.Layers+1, u.KVHeads, u.HeadDim, u.DType)
		}), gran, "p"},
		{"KV heads", with(func(g *kv.Model) { g.Groups[0].KVHeads *= 2 }), gran, "p"},
		{"head dim", with(func(g *kv.Model) { g.Groups[0].HeadDim = 64 }), gran, "p"},
		{"element type", kv.Config{Model: fp8, BlockTokens: 16}, gran, "p"},
		{"scales", kv.Config{Model: fp8Scaled, BlockTokens: 16}, gran, "p"},
		{"layout", kv.Config{Model: kv.Llama3_8B(), Layout: kv.PerLayer}, gran, "p"},
		{"granule", base, 4 << 20, "p"},
		{"block tokens", kv.Config{Model: kv.Llama3_8B(), BlockTokens: 17}, gran, "p"},
		{"prefix", base, gran, "q"},
		{"empty prefix", base, gran, ""},
		{"prefix moved into the name", with(func(g *kv.Model) { g.Name += "p" }), gran, ""},
	} {
		distinctNamespace(t, seen, tt.name, tt.cfg, tt.granule, tt.prefix)
	}
}

// namespaceCase is a configuration whose namespace must be its own.
type namespaceCase struct {
	name    string
	cfg     kv.Config
	granule int
	prefix  string
}

// distinctNamespace checks that cfg's namespace is none of those in seen, and adds
// it under name.
func distinctNamespace(t *testing.T, seen map[uint64]string, name string, cfg kv.Config, granule int, prefix string) {
	t.Helper()
	got, err := kv.TierNamespace(cfg, granule, prefix)
	require.NoError(t, err, name)
	if prev, dup := seen[got]; dup {
		t.Errorf("%s: namespace %#x already given to %s", name, got, prev)
	}
	seen[got] = name
}

func TestTierNamespaceBadInputs(t *testing.T) {
	for _, tt := range []struct {
		name    string
		cfg     kv.Config
		granule int
		want    error
	}{
		{"no model", kv.Config{}, 2 << 20, kv.ErrModel},
		{"no layers", kv.Config{Model: kv.Uniform("", 0, 1, 8, arena.Float16)}, 2 << 20, kv.ErrModel},
		{"granule not a power of two", kv.Config{Model: kv.Tiny()}, 3 << 20, kv.ErrConfig},
		{"granule 0", kv.Config{Model: kv.Tiny()}, 0, kv.ErrConfig},
		{"negative block tokens", kv.Config{Model: kv.Tiny(), BlockTokens: -1}, 4096, kv.ErrConfig},
		{"block tokens outside Blocked", kv.Config{Model: kv.Tiny(), Layout: kv.PerLayer, BlockTokens: 4}, 4096, kv.ErrConfig},
		{"unknown layout", kv.Config{Model: kv.Tiny(), Layout: kv.Layout(9)}, 4096, kv.ErrConfig},
		{"removed layout", kv.Config{Model: kv.Tiny(), Layout: kv.Layout(1)}, 4096, kv.ErrConfig},
		{"model: no groups", kv.Config{Model: kv.Model{Name: "m", Layers: 2}}, 2 << 20, kv.ErrModel},
		{"model: a layer in no group", kv.Config{Model: kv.Model{Name: "m", Layers: 2, Groups: []kv.Group{
			{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 1, HeadDim: 8, DType: arena.Float16}}}}, 2 << 20, kv.ErrModel},
		{"model: window larger than MaxTokens", kv.Config{Model: kv.GPTOSS20B(), MaxTokens: 64}, 2 << 20, kv.ErrModel},
		{"model: granule not a power of two", kv.Config{Model: kv.GPTOSS20B()}, 3 << 20, kv.ErrConfig},
		{"model: block tokens outside Blocked", kv.Config{Model: kv.GPTOSS20B(), Layout: kv.PerLayer, BlockTokens: 4}, 2 << 20, kv.ErrConfig},
	} {
		_, err := kv.TierNamespace(tt.cfg, tt.granule, "")
		assert.ErrorIs(t, err, tt.want, tt.name)
	}
}

// TestTierNamespaceModel: a Model's namespace covers each group's kind, window,
// layers, heads, dim, element type and scales, so two models that differ in any one
// of them, a uniform model among them (one full-attention group of every layer in
// order), never share keys.
func TestTierNamespaceModel(t *testing.T) {
	const gran = 2 << 20
	base := kv.Config{Model: kv.GPTOSS20B()}
	ns, err := kv.TierNamespace(base, gran, "p")
	require.NoError(t, err)
	again, err := kv.TierNamespace(kv.Config{Model: kv.GPTOSS20B(), MaxTokens: 1 << 17}, gran, "p")
	require.NoError(t, err)
	assert.Equal(t, ns, again, "MaxTokens does not change a block's bytes")

	with := func(f func(m *kv.Model)) kv.Config {
		m := kv.GPTOSS20B()
		f(&m)
		return kv.Config{Model: m}
	}
	uniform, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_8B()}, gran, "p")
	require.NoError(t, err)
	reversed := kv.Llama3_8B()
	slices.Reverse(reversed.Groups[0].Layers)
	seen := map[uint64]string{ns: "base", uniform: "a uniform model"}
	for _, tt := range []namespaceCase{
		{"a uniform model's layers in another order", kv.Config{Model: reversed}, gran, "p"},
		{"name", with(func(m *kv.Model) { m.Name = "other" }), gran, "p"},
		{"kind", with(func(m *kv.Model) { m.Groups[0].Kind = kv.ChunkedLocal }), gran, "p"},
		{"window", with(func(m *kv.Model) { m.Groups[0].Window++ }), gran, "p"},
		{"layers swapped between groups", with(func(m *kv.Model) {
			m.Groups[0].Layers[0], m.Groups[1].Layers[0] = m.Groups[1].Layers[0], m.Groups[0].Layers[0]
		}), gran, "p"},
		{"groups in another order", with(func(m *kv.Model) { m.Groups[0], m.Groups[1] = m.Groups[1], m.Groups[0] }), gran, "p"},
		{"KV heads", with(func(m *kv.Model) { m.Groups[1].KVHeads *= 2 }), gran, "p"},
		{"head dim", with(func(m *kv.Model) { m.Groups[1].HeadDim *= 2 }), gran, "p"},
		{"element type", with(func(m *kv.Model) { m.Groups[1].DType = arena.Float8E4M3 }), gran, "p"},
		{"scales", with(func(m *kv.Model) { m.Groups[1].DType, m.Groups[1].Scales = arena.Float8E4M3, kv.ScalePerHead }), gran, "p"},
		{"scales per tensor", with(func(m *kv.Model) { m.Groups[1].DType, m.Groups[1].Scales = arena.Float8E4M3, kv.ScalePerTensor }), gran, "p"},
		{"layout", kv.Config{Model: kv.GPTOSS20B(), Layout: kv.PerLayer}, gran, "p"},
		{"granule", base, 4 << 20, "p"},
		{"block tokens", kv.Config{Model: kv.GPTOSS20B(), BlockTokens: 1000}, gran, "p"},
		{"prefix", base, gran, "q"},
		{"MLA", kv.Config{Model: kv.DeepSeekV3()}, gran, "p"},
		{"recurrent", kv.Config{Model: kv.Qwen3Next80B()}, gran, "p"},
		{"state bytes", with(func(m *kv.Model) {
			m.Groups[0] = kv.Group{Kind: kv.Recurrent, Layers: m.Groups[0].Layers, StateBytes: 1 << 20}
		}), gran, "p"},
		{"other state bytes", with(func(m *kv.Model) {
			m.Groups[0] = kv.Group{Kind: kv.Recurrent, Layers: m.Groups[0].Layers, StateBytes: 2 << 20}
		}), gran, "p"},
	} {
		distinctNamespace(t, seen, tt.name, tt.cfg, tt.granule, tt.prefix)
	}
	presets := map[uint64]string{}
	for _, m := range kv.Presets() {
		distinctNamespace(t, presets, m.Name, kv.Config{Model: m}, gran, "p")
	}
}

// TestTierValueOtherModel: a value written under another model's namespace is
// refused as of another namespace, and as nothing else.
func TestTierValueOtherModel(t *testing.T) {
	mine, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_8B()}, 2<<20, "tenant-a")
	require.NoError(t, err)
	other, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_70B()}, 2<<20, "tenant-a")
	require.NoError(t, err)
	require.NotEqual(t, mine, other)
	toks, payload := []int32{5, -6, 7, 1 << 30, 9, 10, 11, 12}, bytes.Repeat([]byte{0xa5}, 64)
	v := make([]byte, tierval.Size(len(toks), len(payload)))
	require.NoError(t, tierval.Encode(v, tierval.Key{Namespace: other, Hash: 9}, toks, len(payload), func(p []byte) error {
		copy(p, payload)
		return nil
	}))
	_, err = tierval.Decode(v, tierval.Key{Namespace: mine, Hash: 9}, toks, len(payload))
	require.ErrorIs(t, err, tierval.ErrValue)
	require.ErrorIs(t, err, tierval.ErrNamespace, "a value of another model")
	for _, kind := range []error{tierval.ErrTruncated, tierval.ErrFormat, tierval.ErrChecksum, tierval.ErrBlock} {
		require.NotErrorIs(t, err, kind)
	}
}
