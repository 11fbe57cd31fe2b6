package kvsub_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/kvsub"
)

func newPublisher(t *testing.T, opts kvevents.Options) *kvevents.Publisher {
	t.Helper()
	opts.Endpoint, opts.ReplayEndpoint = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
	p, err := kvevents.New(opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// collect reads batches until it has n events, checking sequence numbers run on
// from the first without a gap.
func collect(t *testing.T, s *kvsub.Subscriber, n int) []kvsub.Event {
	t.Helper()
	var out []kvsub.Event
	var next uint64
	for len(out) < n {
		b, err := s.Next()
		require.NoError(t, err)
		require.Equal(t, next, b.Seq, "in order, without a gap")
		next = b.Seq + 1
		out = append(out, b.Events...)
	}
	return out
}

// TestLateSubscriberCatchesUp: a subscriber that connects after events were
// published gets them from the replay socket, then the live ones, each field as the
// cache gave it to the publisher.
func TestLateSubscriberCatchesUp(t *testing.T) {
	p := newPublisher(t, kvevents.Options{Topic: "kv@r0", DataParallelRank: 0})
	p.BlocksStored(kv.BlocksStored{Hashes: []uint64{1, 1 << 63}, Tokens: []int32{1, 2, 3, 4, 5, 6, 7, 8}, BlockSize: 4, Medium: "CPU",
		LoRA: "adapter", ExtraKeys: [][]any{{"adapter", "salt"}, {"adapter"}}})
	p.BlocksStored(kv.BlocksStored{Hashes: []uint64{3}, Parent: 1 << 63, HasParent: true, Tokens: []int32{9, 10, 11, 12}, BlockSize: 4, Medium: "CPU",
		Group: 1, Attention: kv.SlidingWindow, Window: 128})
	p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{3}, Medium: "CPU", Group: 1})
	require.Eventually(t, func() bool { return p.Stats().Published == 3 }, 5*time.Second, time.Millisecond)

	s, err := kvsub.Dial(kvsub.Options{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint(), Topic: "kv@", CatchUp: true})
	require.NoError(t, err)
	defer s.Close()
	p.AllBlocksCleared()
	got := collect(t, s, 4)
	require.Len(t, got, 4)
	assert.Equal(t, kvsub.Event{Kind: kvsub.Stored, Hashes: []uint64{1, 1 << 63}, Tokens: []int32{1, 2, 3, 4, 5, 6, 7, 8}, BlockSize: 4,
		LoRAName: "adapter", Medium: "CPU", ExtraKeys: [][]any{{"adapter", "salt"}, {"adapter"}}, HasGroup: true}, got[0])
	assert.Equal(t, kvsub.Event{Kind: kvsub.Stored, Hashes: []uint64{3}, Parent: 1 << 63, HasParent: true, Tokens: []int32{9, 10, 11, 12},
		BlockSize: 4, Medium: "CPU", Group: 1, HasGroup: true, SpecKind: "sliding_window", Window: 128}, got[1])
	assert.Equal(t, kvsub.Event{Kind: kvsub.Removed, Hashes: []uint64{3}, Medium: "CPU", Group: 1, HasGroup: true}, got[2])
	assert.Equal(t, kvsub.Event{Kind: kvsub.Cleared}, got[3])
	st := s.Stats()
	assert.Positive(t, st.Replayed)
	assert.Positive(t, st.Bytes)
	assert.Zero(t, st.Missed)
	require.NoError(t, s.Close())
	_, err = s.Next()
	assert.ErrorIs(t, err, kvsub.ErrClosed)
	assert.ErrorIs(t, s.Close(), kvsub.ErrClosed, "a second Close changes nothing")
}

// TestSlowSubscriberFillsGaps: a subscriber that reads slowly loses live messages
// to the publisher's per-subscriber queue; it takes them from the replay socket, and
// reads every message once, in order.
func TestSlowSubscriberFillsGaps(t *testing.T) {
	p := newPublisher(t, kvevents.Options{SubscriberQueue: 1, MaxBatchEvents: 1})
	s, err := kvsub.Dial(kvsub.Options{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint(), CatchUp: true, QueueSize: 1})
	require.NoError(t, err)
	defer s.Close()
	const n = 300
	toks := make([]int32, 4096) // a 16 KiB message: the socket buffers do not hold them all
	for i := range n {
		p.BlocksStored(kv.BlocksStored{Hashes: []uint64{uint64(i)}, Tokens: toks, BlockSize: len(toks), Medium: "GPU"})
	}
	got := collect(t, s, n)
	for i, e := range got {
		require.Equal(t, []uint64{uint64(i)}, e.Hashes)
	}
	st := s.Stats()
	assert.Zero(t, st.Missed)
	t.Logf("live %d, replayed %d, duplicates %d, publisher's drops for the subscriber %d", st.Live, st.Replayed, st.Duplicates, p.Stats().SubscriberDrops)
}

// TestDecodeArrayForm: the positional form older vLLM sent is read as the map form.
func TestDecodeArrayForm(t *testing.T) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	require.NoError(t, enc.Encode([]any{1.5, []any{
		[]any{"BlockStored", []uint64{7, 8}, nil, []int{1, 2, 3, 4}, 2, nil, "GPU", nil},
		[]any{"BlockRemoved", []any{[]byte{0xff, 1, 2, 3, 4, 5, 6, 7, 8}}, "GPU"},
		[]any{"AllBlocksCleared"},
	}, 3}))
	b, err := kvsub.Decode(buf.Bytes())
	require.NoError(t, err)
	assert.Equal(t, 1.5, b.TS)
	assert.Equal(t, 3, b.Rank)
	require.Len(t, b.Events, 3)
	assert.Equal(t, kvsub.Event{Kind: kvsub.Stored, Hashes: []uint64{7, 8}, Tokens: []int32{1, 2, 3, 4}, BlockSize: 2, Medium: "GPU"}, b.Events[0])
	assert.Equal(t, []uint64{0x0102030405060708}, b.Events[1].Hashes, "a byte hash is reduced to its last 8 bytes, as vLLM does")
	assert.Equal(t, kvsub.Cleared, b.Events[2].Kind)
}

func TestBadInputs(t *testing.T) {
	for _, o := range []kvsub.Options{
		{Endpoint: "udp://127.0.0.1:1"},
		{Endpoint: "tcp://127.0.0.1"},
		{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: "ipc:///tmp/x"},
		{Endpoint: "tcp://127.0.0.1:1", CatchUp: true},
	} {
		_, err := kvsub.Dial(o)
		assert.ErrorIs(t, err, kvsub.ErrEndpoint, "%+v", o)
	}
	_, err := kvsub.Dial(kvsub.Options{Endpoint: "tcp://127.0.0.1:1", Timeout: time.Second})
	assert.Error(t, err, "nothing listens there")
	for _, payload := range [][]byte{nil, {0xc1}, {0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x91, 0x81, 0xa4, 't', 'y', 'p', 'e', 0xa3, 'F', 'o', 'o'}} {
		_, err := kvsub.Decode(payload)
		assert.ErrorIs(t, err, kvsub.ErrPayload, "%x", payload)
	}
	_, _, err = kvsub.Replay("tcp://nowhere", 0, kvsub.Options{})
	assert.True(t, errors.Is(err, kvsub.ErrEndpoint))
}
