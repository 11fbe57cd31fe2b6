package kv_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// tierValueKinds are the precise kinds a refused value carries, exactly one each.
var tierValueKinds = []error{kv.ErrTierTruncated, kv.ErrTierFormat, kv.ErrTierChecksum, kv.ErrTierNamespace, kv.ErrTierBlock}

// requireRefused checks that err refuses a value with kind and no other kind.
func requireRefused(t testing.TB, err, kind error, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	require.ErrorIs(t, err, kv.ErrTierValue, msg)
	for _, k := range tierValueKinds {
		if k == kind {
			require.ErrorIs(t, err, k, msg)
		} else {
			require.NotErrorIs(t, err, k, msg)
		}
	}
}

// encodeTierValue returns the value of key for tokens holding payload.
func encodeTierValue(t testing.TB, key kv.TierKey, tokens []int32, payload []byte) []byte {
	t.Helper()
	v := make([]byte, kv.TierValueSize(len(tokens), len(payload)))
	calls := 0
	require.NoError(t, kv.EncodeTierValue(v, key, tokens, len(payload), func(p []byte) error {
		calls++
		require.Len(t, p, len(payload))
		copy(p, payload)
		return nil
	}))
	require.Equal(t, 1, calls, "fill calls")
	return v
}

func tierTokens(n int, seed int32) []int32 {
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = seed*7919 + int32(i)*104729 - 1<<30
	}
	return toks
}

func tierPayload(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131) ^ seed
	}
	return b
}

func TestTierValueRoundTrip(t *testing.T) {
	key := kv.TierKey{Namespace: 0x1234_5678_9abc_def0, Hash: 0xfedc_ba98_7654_3210}
	for _, tt := range []struct {
		name            string
		tokens, payload int
	}{
		{"empty", 0, 0},
		{"tokens only", 3, 0},
		{"payload only", 0, 5},
		{"small", 16, 4096},
		{"block=2MiB", 1024, 2 << 20},
	} {
		t.Run(tt.name, func(t *testing.T) {
			toks, payload := tierTokens(tt.tokens, 1), tierPayload(tt.payload, 1)
			v := encodeTierValue(t, key, toks, payload)
			assert.Equal(t, kv.TierHeaderSize+4*tt.tokens+tt.payload, len(v))
			got, err := kv.DecodeTierValue(v, key, toks, len(payload))
			require.NoError(t, err)
			assert.True(t, bytes.Equal(payload, got), "payload read back")
			if len(got) > 0 {
				assert.Same(t, &v[len(v)-len(got)], &got[0], "the payload is a sub-slice of the value, not a copy")
			}
		})
	}
}

func TestTierValueFlipAnyByte(t *testing.T) {
	key := kv.TierKey{Namespace: 11, Hash: 22}
	toks, payload := tierTokens(5, 2), tierPayload(300, 2)
	v := encodeTierValue(t, key, toks, payload)
	for i := range v {
		for _, mask := range []byte{0x01, 0x80, 0xff} {
			bad := bytes.Clone(v)
			bad[i] ^= mask
			_, err := kv.DecodeTierValue(bad, key, toks, len(payload))
			require.ErrorIs(t, err, kv.ErrTierValue, "byte %d ^ %#x", i, mask)
		}
	}
	// In the payload and tokens, and in the header's covered fields other than the
	// lengths, a flip is a checksum failure: nothing past the check is believed.
	for _, i := range []int{8, 15, 16, 23, 40, 43, kv.TierHeaderSize, kv.TierHeaderSize + 19, kv.TierHeaderSize + 20, len(v) - 1} {
		bad := bytes.Clone(v)
		bad[i] ^= 0x10
		_, err := kv.DecodeTierValue(bad, key, toks, len(payload))
		requireRefused(t, err, kv.ErrTierChecksum, "byte %d", i)
	}
	for _, i := range []int{0, 3, 4, 6, 28, 44} {
		bad := bytes.Clone(v)
		bad[i] ^= 0x10
		_, err := kv.DecodeTierValue(bad, key, toks, len(payload))
		requireRefused(t, err, kv.ErrTierFormat, "byte %d", i)
	}
	for _, i := range []int{24, 27, 32, 39} {
		bad := bytes.Clone(v)
		bad[i] ^= 0x10
		_, err := kv.DecodeTierValue(bad, key, toks, len(payload))
		requireRefused(t, err, kv.ErrTierTruncated, "byte %d (a length)", i)
	}
}

func TestTierValueFlipLarge(t *testing.T) {
	key := kv.TierKey{Namespace: 11, Hash: 22}
	toks, payload := tierTokens(1024, 3), tierPayload(2<<20, 3)
	v := encodeTierValue(t, key, toks, payload)
	for i := kv.TierHeaderSize; i < len(v); i += 4093 {
		v[i] ^= 0x04
		_, err := kv.DecodeTierValue(v, key, toks, len(payload))
		requireRefused(t, err, kv.ErrTierChecksum, "byte %d", i)
		v[i] ^= 0x04
	}
	_, err := kv.DecodeTierValue(v, key, toks, len(payload))
	require.NoError(t, err, "every flip undone")
}

func TestTierValueTruncated(t *testing.T) {
	key := kv.TierKey{Namespace: 1, Hash: 2}
	toks, payload := tierTokens(4, 4), tierPayload(100, 4)
	v := encodeTierValue(t, key, toks, payload)
	for n := range len(v) {
		_, err := kv.DecodeTierValue(v[:n], key, toks, len(payload))
		requireRefused(t, err, kv.ErrTierTruncated, "cut at %d of %d", n, len(v))
	}
	_, err := kv.DecodeTierValue(append(bytes.Clone(v), 0), key, toks, len(payload))
	requireRefused(t, err, kv.ErrTierTruncated, "one byte too long")
	_, err = kv.DecodeTierValue(nil, key, toks, len(payload))
	requireRefused(t, err, kv.ErrTierTruncated, "nil")
}

func TestTierValueOtherModel(t *testing.T) {
	mine, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_8B()}, 2<<20, "tenant-a")
	require.NoError(t, err)
	other, err := kv.TierNamespace(kv.Config{Model: kv.Llama3_70B()}, 2<<20, "tenant-a")
	require.NoError(t, err)
	require.NotEqual(t, mine, other)
	toks, payload := tierTokens(8, 5), tierPayload(64, 5)
	v := encodeTierValue(t, kv.TierKey{Namespace: other, Hash: 9}, toks, payload)
	_, err = kv.DecodeTierValue(v, kv.TierKey{Namespace: mine, Hash: 9}, toks, len(payload))
	requireRefused(t, err, kv.ErrTierNamespace, "a value of another model")
}

func TestTierValueOtherBlock(t *testing.T) {
	key := kv.TierKey{Namespace: 3, Hash: 4}
	toks, payload := tierTokens(6, 6), tierPayload(64, 6)
	v := encodeTierValue(t, key, toks, payload)
	changed := func(i int, d int32) []int32 { c := append([]int32(nil), toks...); c[i] += d; return c }
	for _, tt := range []struct {
		name    string
		key     kv.TierKey
		tokens  []int32
		payload int
	}{
		{"another hash", kv.TierKey{Namespace: 3, Hash: 5}, toks, len(payload)},
		{"first token differs", key, changed(0, 1), len(payload)},
		{"last token differs", key, changed(5, -1), len(payload)},
		{"one token fewer", key, toks[:5], len(payload)},
		{"one token more", key, append(append([]int32(nil), toks...), 1), len(payload)},
		{"no tokens", key, nil, len(payload)},
		{"another payload length", key, toks, len(payload) - 1},
		{"a negative payload length", key, toks, -1},
	} {
		_, err := kv.DecodeTierValue(v, tt.key, tt.tokens, tt.payload)
		requireRefused(t, err, kv.ErrTierBlock, "%s", tt.name)
	}
}

func TestEncodeTierValueBadInputs(t *testing.T) {
	key := kv.TierKey{Namespace: 1, Hash: 1}
	toks := tierTokens(2, 7)
	fill := func([]byte) error { t.Fatal("fill called"); return nil }
	size := kv.TierValueSize(2, 10)
	for _, tt := range []struct {
		name    string
		dst     int
		payload int
	}{
		{"dst one byte short", size - 1, 10},
		{"dst one byte long", size + 1, 10},
		{"no dst", 0, 10},
		{"negative payload", size, -1},
	} {
		err := kv.EncodeTierValue(make([]byte, tt.dst), key, toks, tt.payload, fill)
		assert.ErrorIs(t, err, kv.ErrTierValueSize, tt.name)
	}
	boom := errors.New("copy failed")
	err := kv.EncodeTierValue(make([]byte, size), key, toks, 10, func([]byte) error { return boom })
	assert.ErrorIs(t, err, boom, "fill's error is EncodeTierValue's")
	assert.PanicsWithValue(t, kv.PanicNilTierFill, func() { _ = kv.EncodeTierValue(make([]byte, size), key, toks, 10, nil) })
}

func TestTierValueSize(t *testing.T) {
	assert.Equal(t, kv.TierHeaderSize, kv.TierValueSize(0, 0))
	assert.Equal(t, kv.TierHeaderSize+4*1024+2<<20, kv.TierValueSize(1024, 2<<20))
	for _, tt := range [][2]int{{-1, 0}, {0, -1}, {math.MaxInt / 2, 0}, {0, math.MaxInt}, {1, math.MaxInt - kv.TierHeaderSize - 3}} {
		assert.Equal(t, -1, kv.TierValueSize(tt[0], tt[1]), "tokens %d payload %d", tt[0], tt[1])
	}
	assert.Equal(t, math.MaxInt, kv.TierValueSize(1, math.MaxInt-kv.TierHeaderSize-4), "the largest that fits")
}

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
		{"no model", kv.Config{}, 2 << 20, kv.ErrGeometry},
		{"no layers", kv.Config{Model: kv.Uniform("", 0, 1, 8, arena.Float16)}, 2 << 20, kv.ErrGeometry},
		{"granule not a power of two", kv.Config{Model: kv.Tiny()}, 3 << 20, kv.ErrConfig},
		{"granule 0", kv.Config{Model: kv.Tiny()}, 0, kv.ErrConfig},
		{"negative block tokens", kv.Config{Model: kv.Tiny(), BlockTokens: -1}, 4096, kv.ErrConfig},
		{"block tokens outside Blocked", kv.Config{Model: kv.Tiny(), Layout: kv.PerLayer, BlockTokens: 4}, 4096, kv.ErrConfig},
		{"unknown layout", kv.Config{Model: kv.Tiny(), Layout: kv.Layout(9)}, 4096, kv.ErrConfig},
		{"removed layout", kv.Config{Model: kv.Tiny(), Layout: kv.Layout(1)}, 4096, kv.ErrConfig},
		{"model: no groups", kv.Config{Model: kv.Model{Name: "m", Layers: 2}}, 2 << 20, kv.ErrGeometry},
		{"model: a layer in no group", kv.Config{Model: kv.Model{Name: "m", Layers: 2, Groups: []kv.Group{
			{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 1, HeadDim: 8, DType: arena.Float16}}}}, 2 << 20, kv.ErrGeometry},
		{"model: window larger than MaxTokens", kv.Config{Model: kv.GPTOSS20B(), MaxTokens: 64}, 2 << 20, kv.ErrGeometry},
		{"model: granule not a power of two", kv.Config{Model: kv.GPTOSS20B()}, 3 << 20, kv.ErrConfig},
		{"model: block tokens outside Blocked", kv.Config{Model: kv.GPTOSS20B(), Layout: kv.PerLayer, BlockTokens: 4}, 2 << 20, kv.ErrConfig},
	} {
		_, err := kv.TierNamespace(tt.cfg, tt.granule, "")
		assert.ErrorIs(t, err, tt.want, tt.name)
	}
}

// FuzzDecodeTierValue feeds DecodeTierValue arbitrary bytes for one fixed block: it
// must never panic, must refuse with exactly one kind, and may accept only the very
// bytes EncodeTierValue writes for that block.
func FuzzDecodeTierValue(f *testing.F) {
	key := kv.TierKey{Namespace: 0xabcdef, Hash: 0x123456}
	toks := tierTokens(3, 8)
	payload := tierPayload(40, 8)
	valid := encodeTierValue(f, key, toks, payload)
	f.Add(valid)
	f.Add(valid[:kv.TierHeaderSize])
	f.Add([]byte{})
	f.Add(encodeTierValue(f, kv.TierKey{Namespace: 1, Hash: key.Hash}, toks, payload))
	f.Add(encodeTierValue(f, key, toks[:2], payload))
	f.Fuzz(func(t *testing.T, v []byte) {
		got, err := kv.DecodeTierValue(v, key, toks, len(payload))
		if err == nil {
			require.Equal(t, valid, v, "accepted bytes other than the block's value")
			require.Equal(t, payload, got)
			return
		}
		kinds := 0
		for _, k := range tierValueKinds {
			if errors.Is(err, k) {
				kinds++
			}
		}
		require.ErrorIs(t, err, kv.ErrTierValue)
		require.Equal(t, 1, kinds, "kinds of %v", err)
	})
}

// ExampleEncodeTierValue writes a block's value as a tier's Store would hand the
// cache its memory, and checks it as a Load would.
func ExampleEncodeTierValue() {
	ns, _ := kv.TierNamespace(kv.Config{Model: kv.Tiny()}, 4096, "example")
	key := kv.TierKey{Namespace: ns, Hash: 42}
	tokens := []int32{101, 102, 103}
	block := []byte("the block's K and V")

	value := make([]byte, kv.TierValueSize(len(tokens), len(block)))
	_ = kv.EncodeTierValue(value, key, tokens, len(block), func(p []byte) error {
		copy(p, block) // the cache's one copy, from its granules
		return nil
	})

	payload, err := kv.DecodeTierValue(value, key, tokens, len(block))
	fmt.Printf("%s %v\n", payload, err)
	_, err = kv.DecodeTierValue(value, key, []int32{101, 102, 104}, len(block))
	fmt.Println(errors.Is(err, kv.ErrTierBlock))
	value[len(value)-1] ^= 1
	_, err = kv.DecodeTierValue(value, key, tokens, len(block))
	fmt.Println(errors.Is(err, kv.ErrTierChecksum))
	// Output:
	// the block's K and V <nil>
	// true
	// true
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
