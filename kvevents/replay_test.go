package kvevents_test

import (
	"encoding/binary"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func seqFrame(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }

// TestReplayMalformed: every request not [empty, 8 bytes] is dropped without an
// answer and counted, and the client's next good request is served.
func TestReplayMalformed(t *testing.T) {
	p := newPublisher(t, kvevents.Options{Logger: quiet})
	p.AllBlocksCleared()
	require.Eventually(t, func() bool { return p.Stats().Batches == 1 }, 5*time.Second, time.Millisecond)
	c := dealer(t, p)
	bad := [][][]byte{
		{seqFrame(0)},                        // no empty frame
		{{}, seqFrame(0)[:7]},                // 7 bytes
		{{}, append(seqFrame(0), 0)},         // 9 bytes
		{{1}, seqFrame(0)},                   // a first frame that is not empty
		{{}, seqFrame(0), {}},                // a frame too many
		{{}, make([]byte, 1<<20)},            // a frame past the limit: skipped, not kept
		{{}, {}, {}, {}, {}, {}, {}, {}, {}}, // frames past the limit
	}
	for _, frames := range bad {
		require.NoError(t, c.WriteMsg(frames, time.Time{}))
	}
	got := replayFrom(t, c, 0)
	require.Len(t, got, 1, "the good request after them is answered, and only it")
	assert.Equal(t, uint64(0), got[0].seq)
	st := p.Stats()
	assert.Equal(t, int64(len(bad)), st.BadRequests)
	assert.Equal(t, int64(1), st.Replays)
}

// TestReplayWindow: the replay buffer keeps the latest ReplayBatches messages; a
// request from before them gets what is kept.
func TestReplayWindow(t *testing.T) {
	p := newPublisher(t, kvevents.Options{ReplayBatches: 5, MaxBatchEvents: 1})
	for range 12 {
		p.AllBlocksCleared()
	}
	require.Eventually(t, func() bool { return p.Stats().Batches == 12 }, 5*time.Second, time.Millisecond)
	st := p.Stats()
	assert.Equal(t, 5, st.ReplayBatches)
	assert.Equal(t, uint64(7), st.ReplayFirstSeq)
	var seqs []uint64
	for _, m := range replayFrom(t, dealer(t, p), 0) {
		seqs = append(seqs, m.seq)
	}
	assert.Equal(t, []uint64{7, 8, 9, 10, 11}, seqs)
	seqs = seqs[:0]
	for _, m := range replayFrom(t, dealer(t, p), 10) {
		seqs = append(seqs, m.seq)
	}
	assert.Equal(t, []uint64{10, 11}, seqs)
	assert.Empty(t, replayFrom(t, dealer(t, p), 12))
}

// TestReplayBytes: the replay buffer keeps at most ReplayBytes of payload.
func TestReplayBytes(t *testing.T) {
	p := newPublisher(t, kvevents.Options{ReplayBytes: 10 << 10, MaxBatchEvents: 1})
	for i := range 50 {
		p.BlocksStored(stored(uint64(i)<<10, 256, 0, false)) // ~2.5 KB a payload
	}
	require.Eventually(t, func() bool { return p.Stats().Batches == 50 }, 5*time.Second, time.Millisecond)
	st := p.Stats()
	assert.LessOrEqual(t, st.ReplayBytes, int64(10<<10))
	assert.Positive(t, st.ReplayBatches)
	got := replayFrom(t, dealer(t, p), 0)
	assert.Len(t, got, st.ReplayBatches)
	assert.Equal(t, uint64(49), got[len(got)-1].seq)
}

// TestReplayLimits: with MaxReplays 1, a replay to a client that does not read holds
// the one slot, so another client's request is dropped and counted (publishing goes
// on meanwhile); once ReplayWriteTimeout drops the stuck client, the slot is free.
func TestReplayLimits(t *testing.T) {
	p := newPublisher(t, kvevents.Options{
		MaxReplays:         1,
		ReplayWriteTimeout: 2 * time.Second,
		MaxBatchEvents:     1,
		ReplayBytes:        256 << 20,
		Logger:             quiet,
	})
	for i := range 400 {
		p.BlocksStored(stored(uint64(i)<<20, 1000, 0, false)) // ~20 KB each: 8 MB in all
	}
	require.Eventually(t, func() bool { return p.Stats().Batches == 400 }, 30*time.Second, time.Millisecond)
	stuck := dealer(t, p)
	require.NoError(t, stuck.WriteMsg([][]byte{{}, seqFrame(0)}, time.Time{})) // and never read
	require.Eventually(t, func() bool { return p.Stats().ReplaysActive == 1 }, 10*time.Second, time.Millisecond)
	other := dealer(t, p)
	require.Eventually(t, func() bool {
		require.NoError(t, other.WriteMsg([][]byte{{}, seqFrame(399)}, time.Time{}))
		return p.Stats().ReplaysRefused > 0
	}, 10*time.Second, 5*time.Millisecond, "a second replay is refused while the stuck one holds the only slot")
	assert.LessOrEqual(t, p.Stats().ReplaysActive, 1)
	p.AllBlocksCleared() // publishing is not held up by the stuck replay
	require.Eventually(t, func() bool { return p.Stats().Batches == 401 }, 5*time.Second, time.Millisecond)

	// The stuck client is dropped after ReplayWriteTimeout; then a request is served.
	require.Eventually(t, func() bool { return p.Stats().ReplaysAborted == 1 }, 10*time.Second, time.Millisecond)
	_, err := readUntilClosed(stuck)
	require.Error(t, err, "what the kernel held, then the close")
	fresh := dealer(t, p)
	require.Eventually(t, func() bool {
		got := replayFrom(t, fresh, 400)
		return len(got) == 1 && got[0].seq == 400
	}, 10*time.Second, 10*time.Millisecond)
}

// readUntilClosed reads c until an error: the connection closed by the other end.
func readUntilClosed(c *zmtp.Conn) (int, error) {
	n := 0
	for {
		if _, err := c.ReadMsg(); err != nil {
			return n, err
		}
		n++
	}
}
