package kvsub_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvevents/internal/golden"
	"github.com/vmarena/vmarena/kvevents/kvsub"
)

// TestDecodeGolden: each release's form, as written by hand in
// kvevents/testdata/golden, decodes to the same events.
func TestDecodeGolden(t *testing.T) {
	want := kvsub.Batch{TS: 1_700_000_000.25, Rank: 3, Events: []kvsub.Event{
		{Kind: kvsub.Stored, Hashes: []uint64{7, math.MaxUint64 - 1}, Tokens: []int32{28, 29, 30, 31, 32, 33, 34, 35}, BlockSize: 4,
			Medium: "GPU", LoRAName: "adapter-a", ExtraKeys: [][]any{{"adapter-a", "salt"}, nil}, HasGroup: true,
			SpecKind: "sliding_window", Window: 128},
		{Kind: kvsub.Removed, Hashes: []uint64{7}, Medium: "GPU", Group: 1, HasGroup: true},
		{Kind: kvsub.Cleared},
		{Kind: kvsub.Stored, Hashes: []uint64{9}, Parent: 8, HasParent: true, Tokens: []int32{36, 37, 38, 39}, BlockSize: 4,
			Medium: "CPU", Group: 2, HasGroup: true},
	}}
	for _, file := range []string{"vllm-0.26.0.hex", "vllm-0.23.0.hex"} {
		t.Run(file, func(t *testing.T) {
			payload, err := golden.Read(file)
			require.NoError(t, err)
			got, err := kvsub.Decode(payload)
			require.NoError(t, err)
			assert.Equal(t, want, got)
		})
	}
}

// TestDecodeMalformed: a malformed batch fails with ErrPayload, naming what is
// wrong; it is never read as an empty batch.
func TestDecodeMalformed(t *testing.T) {
	for _, tt := range []struct {
		name, file, text, msg string
	}{
		{name: "map batch", file: "bad-map-batch.hex", msg: "the batch is a map"},
		{name: "batch of 4", file: "bad-batch-len4.hex", msg: "of 4 elements"},
		{name: "batch of 1", file: "bad-batch-len1.hex", msg: "of 1 elements"},
		{name: "ts a string", file: "bad-ts-string.hex", msg: "ts is a string"},
		{name: "event without type", file: "bad-event-untyped.hex", msg: "without a type"},
		{name: "empty", text: "", msg: "missing value"},
		{name: "nil", text: "c0", msg: "the batch is a nil"},
		{name: "empty array", text: "90", msg: "of 0 elements"},
		{name: "events a map", text: `92 cb 0000000000000000 80`, msg: "events is a map"},
		{name: "events nil", text: `92 cb 0000000000000000 c0`, msg: "events is a nil"},
		{name: "trailing bytes", text: `92 cb 0000000000000000 90 00`, msg: "1 bytes after"},
		{name: "rank a string", text: `93 cb 0000000000000000 90 a1 "x"`, msg: "data_parallel_rank"},
		{name: "unknown type", text: `92 00 91 81 a4 "type" a3 "Foo"`, msg: `event type "Foo"`},
		{name: "type not a string", text: `92 00 91 81 a4 "type" 07`, msg: "type is a number"},
		{name: "type twice", text: `92 00 91 82 a4 "type" a3 "Foo" a4 "type" a3 "Foo"`, msg: `"type" twice`},
		{name: "key not a string", text: `92 00 91 81 07 07`, msg: "a key that is a number"},
		{name: "event a number", text: `92 00 91 07`, msg: "an event that is a number"},
		{name: "array event untyped", text: `92 00 91 91 07`, msg: "not led by its type"},
		{name: "array event empty", text: `92 00 91 90`, msg: "not led by its type"},
		{name: "stored too short", text: `92 00 91 93 ab "BlockStored" 91 07 c0`, msg: "BlockStored of 2 fields"},
		{name: "stored without tokens", text: `92 00 91 83 a4 "type" ab "BlockStored" ac "block_hashes" 91 07 aa "block_size" 04`, msg: "without parent_block_hash"},
		{name: "hashes nil", text: `92 00 91 92 ac "BlockRemoved" c0`, msg: "block_hashes: a nil"},
		{name: "hash a float", text: `92 00 91 92 ac "BlockRemoved" 91 cb 0000000000000000`, msg: "a hash of type float64"},
		{name: "block size nil", text: `92 00 91 96 ab "BlockStored" 90 c0 90 c0 c0`, msg: "block_size: a nil"},
		{name: "truncated", text: `92 cb 0000`, msg: "ts"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var payload []byte
			var err error
			if tt.file != "" {
				payload, err = golden.Read(tt.file)
			} else {
				payload, err = golden.Parse(tt.text)
			}
			require.NoError(t, err)
			b, err := kvsub.Decode(payload)
			require.ErrorIs(t, err, kvsub.ErrPayload)
			assert.ErrorContains(t, err, tt.msg)
			assert.Zero(t, b)
		})
	}
}

// FuzzDecode: any payload decodes or fails with ErrPayload; it never panics.
func FuzzDecode(f *testing.F) {
	for _, file := range []string{"vllm-0.26.0.hex", "vllm-0.23.0.hex", "bad-map-batch.hex", "bad-batch-len4.hex"} {
		b, err := golden.Read(file)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		_, err := kvsub.Decode(payload)
		if err != nil {
			require.ErrorIs(t, err, kvsub.ErrPayload)
		}
	})
}
