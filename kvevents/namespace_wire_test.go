package kvevents_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kvevents"
)

// TestNamespaceWire: the blocks a prefix cache announces for a prompt inserted in a
// namespace (an adapter, a salt) reach the wire as vLLM's BlockStored, read here by
// the msgpack decoder written from the specification (mpdecode_test.go), not by our
// encoder's own: the block hashes, the parent that chains the second announcement to
// the first, lora_name and each block's extra_keys equal the vectors that
// ../kv/testdata/gen_namespace_events.py computes with Python's cbor2 and hashlib
// from vLLM's definition of the block hash and its extra keys.
func TestNamespaceWire(t *testing.T) {
	vectors := struct{ Cases []testutil.NamespaceEvent }{testutil.NamespaceEvents(t, "../kv/testdata/namespace_events.json")}
	ran := 0
	for _, tc := range vectors.Cases {
		if tc.BaseLoRA != "" || tc.BaseSalt != "" {
			continue // the cache's own LoRA and salt: kv's golden test covers them
		}
		ran++
		p := newPublisher(t, kvevents.Options{Topic: "kv"})
		sub := subscribe(t, p, "kv", 1)
		gov := accounting.NewGovernor()
		f := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4 << 10, Authority: gov.Authority("kv", accounting.HostKey)})
		c, err := kv.New(f, kv.Config{Model: kv.Tiny(), MaxTokens: 64})
		require.NoError(t, err)
		pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: p,
			Hash: blockhash.Options{BlockSize: tc.BlockSize, Algorithm: blockhash.SHA256CBOR}}})
		require.NoError(t, err)
		ns := kv.Namespace{Adapter: tc.Adapter, Salt: tc.Salt}
		s, _, err := pc.LookupIn(ns, tc.Tokens)
		require.NoError(t, err)
		require.NoError(t, s.Append(len(tc.Tokens)-s.Len()))
		require.NoError(t, pc.InsertIn(ns, s, tc.Tokens[:tc.Split]))
		require.NoError(t, pc.InsertIn(ns, s, tc.Tokens))
		require.True(t, s.Close().OK())
		pc.FlushEvents()
		require.NoError(t, pc.Close())
		require.NoError(t, c.Close())
		require.NoError(t, p.Close()) // flushes: readBatches reads until the close

		var got []mpMap
		for _, batch := range readBatches(t, sub) {
			for _, ev := range batch {
				m, ok := ev.(mpMap)
				require.True(t, ok, "an event is a map")
				if typ, _ := m.get("type"); typ == "BlockStored" {
					got = append(got, m)
				}
			}
		}
		require.Len(t, got, 2, "%+v: one BlockStored per insert", ns)
		first := tc.Split / tc.BlockSize
		for k, ev := range got {
			from, to := 0, first
			if k == 1 {
				from, to = first, len(tc.Tokens)/tc.BlockSize
			}
			var want []any
			for _, h := range tc.Hashes[from:to] {
				want = append(want, wireInt(h))
			}
			hashes, _ := ev.get("block_hashes")
			assert.Equal(t, want, hashes, "%+v event %d: block_hashes", ns, k)
			parent, _ := ev.get("parent_block_hash")
			if from == 0 {
				assert.Nil(t, parent, "%+v: the first announcement has no parent", ns)
			} else {
				assert.Equal(t, wireInt(tc.Hashes[from-1]), parent, "%+v: chained to the first announcement", ns)
			}
			lora, _ := ev.get("lora_name")
			if tc.LoRAName == "" {
				assert.Nil(t, lora, "%+v: no adapter, lora_name None", ns)
			} else {
				assert.Equal(t, tc.LoRAName, lora, "%+v: lora_name", ns)
			}
			extra, has := ev.get("extra_keys")
			wantExtra := tc.ExtraKeys[from:to]
			if testutil.NoExtraKeys(wantExtra) {
				assert.False(t, has, "%+v: no block has extra keys, so the field (default None) is omitted", ns)
				continue
			}
			require.True(t, has, "%+v event %d: extra_keys", ns, k)
			list, ok := extra.([]any)
			require.True(t, ok, "extra_keys is an array, not a %T", extra)
			require.Len(t, list, len(wantExtra))
			for j, w := range wantExtra {
				if w == nil {
					assert.Nil(t, list[j], "%+v block %d: no extra keys", ns, from+j)
				} else {
					assert.Equal(t, w, list[j], "%+v block %d: extra keys", ns, from+j)
				}
			}
		}
	}
	require.NotZero(t, ran, "the vectors hold cases without the cache's own LoRA and salt")
}

// wireInt is a 64-bit block hash as the decoder reads it: an int64 where it fits (a
// msgpack int), else a uint64.
func wireInt(h uint64) any {
	if h <= 1<<63-1 {
		return int64(h)
	}
	return h
}
