package tierval_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv/tierval"
)

// tierValueKinds are the precise kinds a refused value carries, exactly one each.
var tierValueKinds = []error{tierval.ErrTruncated, tierval.ErrFormat, tierval.ErrChecksum, tierval.ErrNamespace, tierval.ErrBlock}

// requireRefused checks that err refuses a value with kind and no other kind.
func requireRefused(t testing.TB, err, kind error, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	require.ErrorIs(t, err, tierval.ErrValue, msg)
	for _, k := range tierValueKinds {
		if k == kind {
			require.ErrorIs(t, err, k, msg)
		} else {
			require.NotErrorIs(t, err, k, msg)
		}
	}
}

// encodeTierValue returns the value of key for tokens holding payload.
func encodeTierValue(t testing.TB, key tierval.Key, tokens []int32, payload []byte) []byte {
	t.Helper()
	v := make([]byte, tierval.Size(len(tokens), len(payload)))
	calls := 0
	require.NoError(t, tierval.Encode(v, key, tokens, len(payload), func(p []byte) error {
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
	key := tierval.Key{Namespace: 0x1234_5678_9abc_def0, Hash: 0xfedc_ba98_7654_3210}
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
			assert.Equal(t, tierval.HeaderSize+4*tt.tokens+tt.payload, len(v))
			got, err := tierval.Decode(v, key, toks, len(payload))
			require.NoError(t, err)
			assert.True(t, bytes.Equal(payload, got), "payload read back")
			if len(got) > 0 {
				assert.Same(t, &v[len(v)-len(got)], &got[0], "the payload is a sub-slice of the value, not a copy")
			}
		})
	}
}

func TestTierValueFlipAnyByte(t *testing.T) {
	key := tierval.Key{Namespace: 11, Hash: 22}
	toks, payload := tierTokens(5, 2), tierPayload(300, 2)
	v := encodeTierValue(t, key, toks, payload)
	for i := range v {
		for _, mask := range []byte{0x01, 0x80, 0xff} {
			bad := bytes.Clone(v)
			bad[i] ^= mask
			_, err := tierval.Decode(bad, key, toks, len(payload))
			require.ErrorIs(t, err, tierval.ErrValue, "byte %d ^ %#x", i, mask)
		}
	}
	// In the payload and tokens, and in the header's covered fields other than the
	// lengths, a flip is a checksum failure: nothing past the check is believed.
	for _, i := range []int{8, 15, 16, 23, 40, 43, tierval.HeaderSize, tierval.HeaderSize + 19, tierval.HeaderSize + 20, len(v) - 1} {
		bad := bytes.Clone(v)
		bad[i] ^= 0x10
		_, err := tierval.Decode(bad, key, toks, len(payload))
		requireRefused(t, err, tierval.ErrChecksum, "byte %d", i)
	}
	for _, i := range []int{0, 3, 4, 6, 28, 44} {
		bad := bytes.Clone(v)
		bad[i] ^= 0x10
		_, err := tierval.Decode(bad, key, toks, len(payload))
		requireRefused(t, err, tierval.ErrFormat, "byte %d", i)
	}
	for _, i := range []int{24, 27, 32, 39} {
		bad := bytes.Clone(v)
		bad[i] ^= 0x10
		_, err := tierval.Decode(bad, key, toks, len(payload))
		requireRefused(t, err, tierval.ErrTruncated, "byte %d (a length)", i)
	}
}

func TestTierValueFlipLarge(t *testing.T) {
	key := tierval.Key{Namespace: 11, Hash: 22}
	toks, payload := tierTokens(1024, 3), tierPayload(2<<20, 3)
	v := encodeTierValue(t, key, toks, payload)
	for i := tierval.HeaderSize; i < len(v); i += 4093 {
		v[i] ^= 0x04
		_, err := tierval.Decode(v, key, toks, len(payload))
		requireRefused(t, err, tierval.ErrChecksum, "byte %d", i)
		v[i] ^= 0x04
	}
	_, err := tierval.Decode(v, key, toks, len(payload))
	require.NoError(t, err, "every flip undone")
}

func TestTierValueTruncated(t *testing.T) {
	key := tierval.Key{Namespace: 1, Hash: 2}
	toks, payload := tierTokens(4, 4), tierPayload(100, 4)
	v := encodeTierValue(t, key, toks, payload)
	for n := range len(v) {
		_, err := tierval.Decode(v[:n], key, toks, len(payload))
		requireRefused(t, err, tierval.ErrTruncated, "cut at %d of %d", n, len(v))
	}
	_, err := tierval.Decode(append(bytes.Clone(v), 0), key, toks, len(payload))
	requireRefused(t, err, tierval.ErrTruncated, "one byte too long")
	_, err = tierval.Decode(nil, key, toks, len(payload))
	requireRefused(t, err, tierval.ErrTruncated, "nil")
}

func TestTierValueOtherBlock(t *testing.T) {
	key := tierval.Key{Namespace: 3, Hash: 4}
	toks, payload := tierTokens(6, 6), tierPayload(64, 6)
	v := encodeTierValue(t, key, toks, payload)
	changed := func(i int, d int32) []int32 { c := append([]int32(nil), toks...); c[i] += d; return c }
	for _, tt := range []struct {
		name    string
		key     tierval.Key
		tokens  []int32
		payload int
	}{
		{"another hash", tierval.Key{Namespace: 3, Hash: 5}, toks, len(payload)},
		{"first token differs", key, changed(0, 1), len(payload)},
		{"last token differs", key, changed(5, -1), len(payload)},
		{"one token fewer", key, toks[:5], len(payload)},
		{"one token more", key, append(append([]int32(nil), toks...), 1), len(payload)},
		{"no tokens", key, nil, len(payload)},
		{"another payload length", key, toks, len(payload) - 1},
		{"a negative payload length", key, toks, -1},
	} {
		_, err := tierval.Decode(v, tt.key, tt.tokens, tt.payload)
		requireRefused(t, err, tierval.ErrBlock, "%s", tt.name)
	}
}

func TestEncodeTierValueBadInputs(t *testing.T) {
	key := tierval.Key{Namespace: 1, Hash: 1}
	toks := tierTokens(2, 7)
	fill := func([]byte) error { t.Fatal("fill called"); return nil }
	size := tierval.Size(2, 10)
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
		err := tierval.Encode(make([]byte, tt.dst), key, toks, tt.payload, fill)
		assert.ErrorIs(t, err, tierval.ErrSize, tt.name)
	}
	boom := errors.New("copy failed")
	err := tierval.Encode(make([]byte, size), key, toks, 10, func([]byte) error { return boom })
	assert.ErrorIs(t, err, boom, "fill's error is Encode's")
	assert.PanicsWithValue(t, tierval.PanicNilFill, func() { _ = tierval.Encode(make([]byte, size), key, toks, 10, nil) })
}

func TestTierValueSize(t *testing.T) {
	assert.Equal(t, tierval.HeaderSize, tierval.Size(0, 0))
	assert.Equal(t, tierval.HeaderSize+4*1024+2<<20, tierval.Size(1024, 2<<20))
	for _, tt := range [][2]int{{-1, 0}, {0, -1}, {math.MaxInt / 2, 0}, {0, math.MaxInt}, {1, math.MaxInt - tierval.HeaderSize - 3}} {
		assert.Equal(t, -1, tierval.Size(tt[0], tt[1]), "tokens %d payload %d", tt[0], tt[1])
	}
	assert.Equal(t, math.MaxInt, tierval.Size(1, math.MaxInt-tierval.HeaderSize-4), "the largest that fits")
}

// FuzzDecodeTierValue feeds Decode arbitrary bytes for one fixed block: it
// must never panic, must refuse with exactly one kind, and may accept only the very
// bytes Encode writes for that block.
func FuzzDecodeTierValue(f *testing.F) {
	key := tierval.Key{Namespace: 0xabcdef, Hash: 0x123456}
	toks := tierTokens(3, 8)
	payload := tierPayload(40, 8)
	valid := encodeTierValue(f, key, toks, payload)
	f.Add(valid)
	f.Add(valid[:tierval.HeaderSize])
	f.Add([]byte{})
	f.Add(encodeTierValue(f, tierval.Key{Namespace: 1, Hash: key.Hash}, toks, payload))
	f.Add(encodeTierValue(f, key, toks[:2], payload))
	f.Fuzz(func(t *testing.T, v []byte) {
		got, err := tierval.Decode(v, key, toks, len(payload))
		if err == nil {
			require.Equal(t, valid, v, "accepted bytes other than the block's value")
			require.Equal(t, payload, got)
			return
		}
		requireOneKind(t, err, tierValueKinds)
	})
}

// ExampleEncode writes a block's value as a tier's Store would hand the cache its
// memory, and checks it as a Load would.
func ExampleEncode() {
	const ns = 0x5eed_cac4e // a cache's kv.TierNamespace
	key := tierval.Key{Namespace: ns, Hash: 42}
	tokens := []int32{101, 102, 103}
	block := []byte("the block's K and V")

	value := make([]byte, tierval.Size(len(tokens), len(block)))
	_ = tierval.Encode(value, key, tokens, len(block), func(p []byte) error {
		copy(p, block) // the cache's one copy, from its granules
		return nil
	})

	payload, err := tierval.Decode(value, key, tokens, len(block))
	fmt.Printf("%s %v\n", payload, err)
	_, err = tierval.Decode(value, key, []int32{101, 102, 104}, len(block))
	fmt.Println(errors.Is(err, tierval.ErrBlock))
	value[len(value)-1] ^= 1
	_, err = tierval.Decode(value, key, tokens, len(block))
	fmt.Println(errors.Is(err, tierval.ErrChecksum))
	// Output:
	// the block's K and V <nil>
	// true
	// true
}

// requireOneKind fails t unless err is a refusal (ErrValue) of exactly one of kinds.
func requireOneKind(t *testing.T, err error, kinds []error) {
	t.Helper()
	n := 0
	for _, k := range kinds {
		if errors.Is(err, k) {
			n++
		}
	}
	require.ErrorIs(t, err, tierval.ErrValue)
	require.Equal(t, 1, n, "kinds of %v", err)
}
