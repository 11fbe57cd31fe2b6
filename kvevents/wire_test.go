package kvevents_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
)

// TestWireFormat reads each event kind back with the test's own msgpack decoder and
// checks it field by field, key order included, against vLLM v0.26.0's
// kv_events.py: a positional batch of map events. (TestGolden checks the bytes.)
func TestWireFormat(t *testing.T) {
	clock := time.Unix(1_700_000_000, 250_000_000)
	p := newPublisher(t, kvevents.Options{
		Topic:            "kv@r1",
		DataParallelRank: 3,
		MaxBatchEvents:   1, // one event a message, to check each alone
		Now:              func() time.Time { return clock },
	})
	sub := subscribe(t, p, "kv@", 1)

	first := stored(7, 2, 0, false)
	first.LoRA = "adapter-a"
	first.Medium = "GPU"
	first.ExtraKeys = [][]any{{"adapter-a", "salt"}, nil}
	first.Attention, first.Window = kv.SlidingWindow, 128
	big := stored(9, 1, 8, true)
	big.Hashes[0] = math.MaxUint64 - 1 // past int64: a uint64 on the wire
	big.Group = 2
	big.Attention, big.Window = kv.ChunkedLocal, 9 // a chunk is no sliding window
	plain := stored(11, 1, 0, false)               // no kind: both spec fields omitted
	mla := stored(12, 1, 0, false)
	mla.Attention = kv.MLALatent
	p.BlocksStored(first)
	p.BlocksStored(big)
	p.BlocksStored(plain)
	p.BlocksStored(mla)
	p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{7, 8}, Medium: "GPU", Group: 1})
	p.AllBlocksCleared()

	want := []struct {
		keys   []string
		fields map[string]any
	}{{
		keys: []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
			"kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
		fields: map[string]any{
			"type": "BlockStored", "block_hashes": []any{int64(7), int64(8)}, "parent_block_hash": nil,
			"token_ids":  []any{int64(28), int64(29), int64(30), int64(31), int64(32), int64(33), int64(34), int64(35)},
			"block_size": int64(4), "lora_id": nil, "medium": "GPU", "lora_name": "adapter-a",
			"extra_keys": []any{[]any{"adapter-a", "salt"}, nil}, "group_idx": int64(0),
			"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": int64(128),
		},
	}, {
		// No extra keys, and no window: those fields (default None) are omitted.
		keys: []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"},
		fields: map[string]any{
			"type": "BlockStored", "block_hashes": []any{uint64(math.MaxUint64 - 1)}, "parent_block_hash": int64(8),
			"token_ids":  []any{int64(36), int64(37), int64(38), int64(39)},
			"block_size": int64(4), "lora_id": nil, "medium": "CPU", "lora_name": nil, "group_idx": int64(2),
			"kv_cache_spec_kind": "chunked_local_attention",
		},
	}, {
		keys: []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "group_idx"},
		fields: map[string]any{
			"type": "BlockStored", "block_hashes": []any{int64(11)}, "parent_block_hash": nil,
			"token_ids":  []any{int64(44), int64(45), int64(46), int64(47)},
			"block_size": int64(4), "lora_id": nil, "medium": "CPU", "lora_name": nil, "group_idx": int64(0),
		},
	}, {
		keys: []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"},
		fields: map[string]any{
			"type": "BlockStored", "block_hashes": []any{int64(12)}, "parent_block_hash": nil,
			"token_ids":  []any{int64(48), int64(49), int64(50), int64(51)},
			"block_size": int64(4), "lora_id": nil, "medium": "CPU", "lora_name": nil, "group_idx": int64(0),
			"kv_cache_spec_kind": "mla_attention",
		},
	}, {
		keys:   []string{"type", "block_hashes", "medium", "group_idx"},
		fields: map[string]any{"type": "BlockRemoved", "block_hashes": []any{int64(7), int64(8)}, "medium": "GPU", "group_idx": int64(1)},
	}, {
		keys:   []string{"type"},
		fields: map[string]any{"type": "AllBlocksCleared"},
	}}
	for i, w := range want {
		m := recv(t, sub)
		assert.Equal(t, "kv@r1", m.topic)
		assert.Equal(t, uint64(i), m.seq, "sequence numbers count from 0, one a message")
		v, err := mpDecode(m.payload)
		require.NoError(t, err)
		batch, ok := v.([]any)
		require.True(t, ok, "the batch is an array (EventBatch is array_like), not a %T", v)
		require.Len(t, batch, 3, "[ts, events, data_parallel_rank]")
		assert.Equal(t, mpFloat64(1_700_000_000.25), batch[0], "ts is a float64 of Unix seconds")
		assert.Equal(t, int64(3), batch[2], "data_parallel_rank")
		evs := batch[1]
		require.Len(t, evs, 1)
		ev, ok := evs.([]any)[0].(mpMap)
		require.True(t, ok, "an event is a map")
		assert.Equal(t, w.keys, ev.keys(), "event %d: keys, in vLLM's field order", i)
		for k, wv := range w.fields {
			got, _ := ev.get(k)
			assert.Equal(t, wv, got, "event %d field %s", i, k)
		}
	}
	st := p.Stats()
	assert.Equal(t, int64(6), st.Events)
	assert.Equal(t, int64(6), st.Published)
	assert.Equal(t, int64(6), st.Batches)
	assert.Zero(t, st.Dropped)
}

// TestTopicFilter: a subscriber to another topic gets nothing; one to the topic
// gets everything.
func TestTopicFilter(t *testing.T) {
	p := newPublisher(t, kvevents.Options{Topic: "kv@a"})
	other := subscribe(t, p, "kv@b", 1)
	mine := subscribe(t, p, "kv@a", 2)
	p.AllBlocksCleared()
	m := recv(t, mine)
	assert.Equal(t, "kv@a", m.topic)
	require.NoError(t, p.Close())
	_, err := other.ReadMsg()
	assert.Error(t, err, "the other topic's subscriber got nothing before the close")
}

// TestBatching: events queued together go out in one message, up to MaxBatchEvents,
// and Close publishes what is still queued.
func TestBatching(t *testing.T) {
	release := make(chan struct{})
	var calls int
	p := newPublisher(t, kvevents.Options{
		MaxBatchEvents: 3,
		Now: func() time.Time {
			calls++
			if calls == 1 {
				<-release // hold the publisher's goroutine while events queue up
			}
			return time.Unix(0, 0)
		},
	})
	sub := subscribe(t, p, "", 1)
	p.AllBlocksCleared() // taken alone; held in Now
	require.Eventually(t, func() bool { return p.Stats().QueueDepth == 0 }, 5*time.Second, time.Millisecond)
	for i := range 7 {
		p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{uint64(i)}})
	}
	assert.Equal(t, 7, p.Stats().QueueDepth)
	close(release)
	require.NoError(t, p.Close())
	var sizes []int
	for _, evs := range readBatches(t, sub) {
		sizes = append(sizes, len(evs))
	}
	assert.Equal(t, []int{1, 3, 3, 1}, sizes)
	st := p.Stats()
	assert.Equal(t, int64(8), st.Published)
	assert.Equal(t, int64(4), st.Batches)
}
