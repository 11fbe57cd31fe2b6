package tierval_test

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv/tierval"
)

// groupKinds are the kinds a refused grouped value carries, exactly one each.
var groupKinds = []error{tierval.ErrTruncated, tierval.ErrFormat, tierval.ErrChecksum, tierval.ErrNamespace, tierval.ErrLayout, tierval.ErrBlock}

// requireGroupRefused checks that err refuses a grouped value with kind alone.
func requireGroupRefused(t testing.TB, err, kind error, what string) {
	t.Helper()
	require.ErrorIs(t, err, tierval.ErrValue, what)
	for _, k := range groupKinds {
		if k == kind {
			require.ErrorIs(t, err, k, what)
		} else {
			require.NotErrorIs(t, err, k, what)
		}
	}
}

// ossLayout is a gpt-oss-like layout: a sliding-window group beside a full one, and
// the place of a recurrent state.
func ossLayout(t testing.TB, model string, window int) *tierval.Layout {
	t.Helper()
	l, err := tierval.NewLayout(model, []tierval.GroupLayout{
		{Part: tierval.PartUnits, Kind: 2, DType: 1, Window: window, Layers: 12, KVHeads: 8, HeadDim: 64, Tensors: 2, UnitTokens: 64, UnitBytes: 96},
		{Part: tierval.PartUnits, Kind: 1, DType: 1, Layers: 12, KVHeads: 8, HeadDim: 64, Tensors: 2, UnitTokens: 32, UnitBytes: 48},
		{Part: tierval.PartState, Kind: 5, UnitBytes: 40},
	})
	require.NoError(t, err)
	return l
}

// encodeGroups returns the grouped value of key under l for tokens holding parts
// (a nil part: none).
func encodeGroups(t testing.TB, l *tierval.Layout, key tierval.Key, tokens []int32, parts [][]byte, inProcess bool) []byte {
	t.Helper()
	sizes := make([]int, len(parts))
	for i, p := range parts {
		sizes[i] = len(p)
	}
	v := make([]byte, l.Size(len(tokens), sizes))
	enc := tierval.EncodeGroups
	if inProcess {
		enc = tierval.EncodeGroupsInProcess
	}
	var called []int
	require.NoError(t, enc(v, key, l, tokens, sizes, func(g int, dst []byte) error {
		called = append(called, g)
		require.Len(t, dst, len(parts[g]))
		copy(dst, parts[g])
		return nil
	}))
	var want []int
	for i, p := range parts {
		if p != nil {
			want = append(want, i)
		}
	}
	require.Equal(t, want, called, "fill is called once per part present, in order")
	return v
}

// TestGroupsRoundTrip: a grouped value reads back each group's part, nil where it
// has none, through DecodeGroups and (for an in-process value) DecodeGroupsInProcess.
func TestGroupsRoundTrip(t *testing.T) {
	l := ossLayout(t, "gpt-oss-20b", 128)
	key := tierval.Key{Namespace: 7, Hash: 9}
	toks := tierTokens(64, 3)
	want := []int{192, 96, 40}
	for _, tt := range []struct {
		name      string
		parts     [][]byte
		inProcess bool
	}{
		{"every part", [][]byte{tierPayload(192, 1), tierPayload(96, 2), tierPayload(40, 3)}, false},
		{"no window part", [][]byte{nil, tierPayload(96, 2), nil}, false},
		{"the window's last unit", [][]byte{tierPayload(96, 1), tierPayload(96, 2), nil}, false},
		{"in process", [][]byte{tierPayload(192, 1), tierPayload(96, 2), nil}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			v := encodeGroups(t, l, key, toks, tt.parts, tt.inProcess)
			dec := tierval.DecodeGroups
			if tt.inProcess {
				dec = tierval.DecodeGroupsInProcess
				requireGroupRefused(t, tierval.DecodeGroups(v, key, l, toks, want, make([][]byte, 3)), tierval.ErrFormat, "an unsummed value outside the process")
			}
			got := make([][]byte, 3)
			require.NoError(t, dec(v, key, l, toks, want, got))
			for i := range got {
				if tt.parts[i] == nil {
					assert.Nil(t, got[i], "group %d", i)
				} else {
					assert.Equal(t, tt.parts[i], got[i], "group %d", i)
				}
			}
		})
	}
}

// TestGroupsRefused: each way a grouped value can be wrong is refused with its one
// kind; a value of another model, window or group count with ErrLayout; a one-group
// value and a grouped one each refused by the other's decoder.
func TestGroupsRefused(t *testing.T) {
	l := ossLayout(t, "gpt-oss-20b", 128)
	key := tierval.Key{Namespace: 7, Hash: 9}
	toks := tierTokens(64, 3)
	want := []int{192, 96, 40}
	parts := [][]byte{tierPayload(192, 1), tierPayload(96, 2), nil}
	good := encodeGroups(t, l, key, toks, parts, false)
	dec := func(v []byte) error { return tierval.DecodeGroups(v, key, l, toks, want, make([][]byte, 3)) }
	require.NoError(t, dec(good))

	other := func(name string, window int) []byte {
		return encodeGroups(t, ossLayout(t, name, window), key, toks, parts, false)
	}
	twoGroups, err := tierval.NewLayout("gpt-oss-20b", []tierval.GroupLayout{{Part: tierval.PartUnits, Kind: 1, UnitTokens: 32, UnitBytes: 48}})
	require.NoError(t, err)
	flip := func(at int) []byte {
		v := bytes.Clone(good)
		v[at] ^= 0x10
		return v
	}
	for _, tt := range []struct {
		name string
		v    []byte
		kind error
	}{
		{"short", good[:20], tierval.ErrTruncated},
		{"cut", good[:len(good)-1], tierval.ErrTruncated},
		{"magic", flip(0), tierval.ErrFormat},
		{"a one-group value", encodeTierValue(t, key, toks, tierPayload(192, 1)), tierval.ErrFormat},
		{"a layout byte", flip(tierval.HeaderSize + 20), tierval.ErrChecksum},
		{"a part byte", flip(len(good) - 5), tierval.ErrChecksum},
		{"a token", flip(len(good) - 288 - 3), tierval.ErrChecksum},
		{"another model", other("gemma-3-27b", 128), tierval.ErrLayout},
		{"another window", other("gpt-oss-20b", 1024), tierval.ErrLayout},
		{"another group count", encodeGroups(t, twoGroups, key, toks, [][]byte{tierPayload(96, 2)}, false), tierval.ErrLayout},
		{"another namespace", encodeGroups(t, l, tierval.Key{Namespace: 8, Hash: 9}, toks, parts, false), tierval.ErrNamespace},
		{"another hash", encodeGroups(t, l, tierval.Key{Namespace: 7, Hash: 10}, toks, parts, false), tierval.ErrBlock},
		{"other tokens", encodeGroups(t, l, key, tierTokens(64, 4), parts, false), tierval.ErrBlock},
		{"fewer tokens", encodeGroups(t, l, key, toks[:63], parts, false), tierval.ErrBlock},
		{"a part of no whole unit", encodeGroups(t, l, key, toks, [][]byte{tierPayload(48, 1), tierPayload(96, 2), nil}, false), tierval.ErrBlock},
		{"a part too long", encodeGroups(t, l, key, toks, [][]byte{tierPayload(288, 1), tierPayload(96, 2), nil}, false), tierval.ErrBlock},
		{"a state part short", encodeGroups(t, l, key, toks, [][]byte{tierPayload(192, 1), tierPayload(96, 2), tierPayload(20, 3)}, false), tierval.ErrBlock},
	} {
		t.Run(tt.name, func(t *testing.T) {
			requireGroupRefused(t, dec(tt.v), tt.kind, tt.name)
		})
	}
	_, err = tierval.Decode(good, key, toks, len(good)-tierval.HeaderSize-4*len(toks))
	requireGroupRefused(t, err, tierval.ErrFormat, "a grouped value is no one-group value")

	// Every single-byte change is refused, never decoded.
	for at := range good {
		require.Error(t, dec(flip(at)), "byte %d", at)
	}
}

// TestGroupsSizes: Size and NewLayout refuse what does not fit, and EncodeGroups a
// destination of another size, before fill is called.
func TestGroupsSizes(t *testing.T) {
	l := ossLayout(t, "m", 8)
	assert.Equal(t, 3, l.Groups())
	assert.Equal(t, -1, l.Size(1, []int{1, 2}), "a part per group")
	assert.Equal(t, -1, l.Size(-1, []int{0, 0, 0}))
	assert.Equal(t, -1, l.Size(1, []int{0, -1, 0}))
	size := l.Size(2, []int{8, 0, 0})
	require.Positive(t, size)
	// The header, the name's record (4 + 1 bytes, padded to 8), 3 records, 3
	// lengths, 2 tokens, the one part.
	assert.Equal(t, tierval.HeaderSize+8+3*40+3*8+2*4+8, size)
	err := tierval.EncodeGroups(make([]byte, size-1), tierval.Key{}, l, []int32{1, 2}, []int{8, 0, 0}, func(int, []byte) error {
		t.Fatal("fill called")
		return nil
	})
	require.ErrorIs(t, err, tierval.ErrSize)
	assert.Panics(t, func() {
		_ = tierval.EncodeGroups(make([]byte, size), tierval.Key{}, l, []int32{1, 2}, []int{8, 0, 0}, nil)
	})
	for _, tt := range []struct {
		name   string
		groups []tierval.GroupLayout
	}{
		{"no group", nil},
		{"no part kind", []tierval.GroupLayout{{Kind: 1}}},
		{"a negative field", []tierval.GroupLayout{{Part: tierval.PartUnits, Window: -1}}},
		{"a negative unit", []tierval.GroupLayout{{Part: tierval.PartUnits, UnitBytes: -1}}},
	} {
		_, err := tierval.NewLayout("m", tt.groups)
		assert.ErrorIs(t, err, tierval.ErrSize, tt.name)
	}
	// The header's layout length is a multiple of 8, and its group count the
	// layout's.
	v := encodeGroups(t, l, tierval.Key{}, []int32{1, 2}, [][]byte{tierPayload(8, 1), nil, nil}, false)
	assert.EqualValues(t, 3, binary.LittleEndian.Uint32(v[28:]))
	assert.Zero(t, binary.LittleEndian.Uint32(v[44:])%8)
}

// TestPeekParts: the head of a grouped value (HeadSize bytes, or the whole value)
// tells each part's length as DecodeGroups finds it, for every shape a value takes
// (window units in whole or in part, states or none, in process or not); a head
// that is short, of another format, namespace, layout or hash, or with a length no
// value holds, is refused with its one kind.
func TestPeekParts(t *testing.T) {
	l := ossLayout(t, "gpt-oss-20b", 128)
	key := tierval.Key{Namespace: 7, Hash: 9}
	toks := tierTokens(64, 3)
	want := []int{192, 96, 40}
	for _, inProcess := range []bool{false, true} {
		for _, parts := range [][][]byte{
			{tierPayload(192, 1), tierPayload(96, 2), tierPayload(40, 3)},
			{nil, tierPayload(96, 2), nil},
			{tierPayload(96, 1), tierPayload(96, 2), tierPayload(40, 3)},
			{nil, nil, nil},
		} {
			v := encodeGroups(t, l, key, toks, parts, inProcess)
			for _, head := range [][]byte{v[:l.HeadSize()], v} {
				lens := make([]int, 3)
				require.NoError(t, tierval.PeekParts(head, key, l, want, lens))
				for i := range parts {
					assert.Equal(t, len(parts[i]), lens[i], "group %d", i)
				}
			}
		}
	}
	assert.PanicsWithValue(t, "tierval: PeekParts with want or lens not one per group", func() {
		_ = tierval.PeekParts(nil, key, l, want, make([]int, 2))
	})

	parts := [][]byte{tierPayload(192, 1), tierPayload(96, 2), nil}
	good := encodeGroups(t, l, key, toks, parts, false)
	head := good[:l.HeadSize()]
	flip := func(at int) []byte {
		v := bytes.Clone(head)
		v[at] ^= 0x10
		return v
	}
	at := func(group int) int { return l.HeadSize() - 8*(3-group) }
	for _, tt := range []struct {
		name string
		v    []byte
		kind error
	}{
		{"short", head[:l.HeadSize()-1], tierval.ErrTruncated},
		{"magic", flip(0), tierval.ErrFormat},
		{"flags", flip(6), tierval.ErrFormat},
		{"a one-group value", encodeTierValue(t, key, toks, tierPayload(192, 1)), tierval.ErrFormat},
		{"another namespace", flip(8), tierval.ErrNamespace},
		{"a layout byte", flip(tierval.HeaderSize + 20), tierval.ErrLayout},
		{"the layout's length", flip(44), tierval.ErrLayout},
		{"another model", encodeGroups(t, ossLayout(t, "gemma-3-27b", 128), key, toks, parts, false), tierval.ErrLayout},
		{"another hash", flip(16), tierval.ErrBlock},
		{"a part of no whole unit", flip(at(0)), tierval.ErrBlock},
		{"the payload's length", flip(32), tierval.ErrBlock},
	} {
		t.Run(tt.name, func(t *testing.T) {
			requireGroupRefused(t, tierval.PeekParts(tt.v, key, l, want, make([]int, 3)), tt.kind, tt.name)
		})
	}
	// A length that another valid one would have is told by the payload's length:
	// the state's part claimed where the value has none.
	v := bytes.Clone(head)
	binary.LittleEndian.PutUint64(v[at(2):], 40)
	requireGroupRefused(t, tierval.PeekParts(v, key, l, want, make([]int, 3)), tierval.ErrBlock, "a part the payload does not hold")
}

// FuzzPeekParts feeds PeekParts arbitrary bytes as the head of a grouped value of one
// fixed block: it must never panic, must refuse with exactly one kind, and where
// DecodeGroups accepts the same bytes as a whole value, PeekParts accepts them too,
// and its lengths are the parts DecodeGroups finds.
func FuzzPeekParts(f *testing.F) {
	l := ossLayout(f, "gpt-oss-20b", 128)
	key := tierval.Key{Namespace: 7, Hash: 9}
	toks := tierTokens(64, 3)
	want := []int{192, 96, 40}
	for _, parts := range [][][]byte{
		{tierPayload(192, 1), tierPayload(96, 2), tierPayload(40, 3)},
		{nil, tierPayload(96, 2), nil},
		{tierPayload(96, 1), tierPayload(96, 2), nil},
	} {
		for _, inProcess := range []bool{false, true} {
			v := encodeGroups(f, l, key, toks, parts, inProcess)
			f.Add(v)
			f.Add(v[:l.HeadSize()])
		}
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, v []byte) {
		lens := make([]int, 3)
		err := tierval.PeekParts(v, key, l, want, lens)
		parts := make([][]byte, 3)
		if derr := tierval.DecodeGroupsInProcess(v, key, l, toks, want, parts); derr == nil {
			require.NoError(t, err, "a value DecodeGroups accepts")
			for i := range parts {
				require.Equal(t, len(parts[i]), lens[i], "group %d", i)
			}
			return
		}
		if err == nil {
			return // a head can pass where the whole value fails (its sum, its tokens)
		}
		requireOneKind(t, err, groupKinds)
	})
}
