package kvevents_test

import (
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

// TestStalledSubscriber: a subscriber that stops reading (a 4 KiB receive buffer,
// so that the kernel soon stops taking for it) costs the cache nothing and the other
// subscriber nothing: the publisher drops what its full queue will not take, counts
// it, and the stalled one, once it reads again, sees the gap in the sequence
// numbers and recovers every missed message from the replay socket, byte for byte.
func TestStalledSubscriber(t *testing.T) {
	const n = 300 // messages of ~20 KB: far more than the stalled socket's buffers hold
	p := newPublisher(t, kvevents.Options{
		MaxBatchEvents:  1,
		SubscriberQueue: 8,
		ReplayBytes:     256 << 20,
	})
	healthy := subscribe(t, p, "", 1)

	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	nc, err := d.Dial("tcp", p.Endpoint()[len("tcp://"):])
	require.NoError(t, err)
	stalled, err := zmtp.Handshake(nc, zmtp.TypeSub, testLimits, time.Now().Add(5*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = stalled.Close() })
	require.NoError(t, stalled.Subscribe(nil))
	require.Eventually(t, func() bool { return p.Subscribed() == 2 }, 5*time.Second, time.Millisecond)

	// The healthy one reads each message before the next is published, so that it
	// never needs more than its queue; the stalled one's queue and socket fill.
	want := make(map[uint64][]byte)
	for i := range n {
		p.BlocksStored(stored(uint64(i)<<20, 1000, 0, false))
		m, err := healthy.ReadMsg()
		require.NoError(t, err)
		want[beUint64(m.Frames[1])] = m.Frames[2]
	}
	require.Len(t, want, n, "the healthy subscriber got every message")
	require.Eventually(t, func() bool { return p.Stats().Published == n }, 30*time.Second, time.Millisecond)
	st := p.Stats()
	assert.Zero(t, st.Dropped, "the cache's events all went out")
	assert.Positive(t, st.SubscriberDrops, "the stalled subscriber's queue overflowed")
	t.Logf("messages dropped for the stalled subscriber: %d of %d", st.SubscriberDrops, n)

	// The stalled one reads again: what its queue and the kernel held, in order; a
	// few messages are enough, since the replay below covers the rest.
	var seqs []uint64
	mine := make(map[uint64][]byte)
	for len(seqs) < 5 {
		m, err := stalled.ReadMsg()
		require.NoError(t, err)
		seq := beUint64(m.Frames[1])
		if len(seqs) > 0 {
			require.Greater(t, seq, seqs[len(seqs)-1], "in order")
		}
		seqs = append(seqs, seq)
		mine[seq] = m.Frames[2]
	}

	// Recovery: replay from the first gap.
	first := uint64(0)
	for ; first < n; first++ {
		if _, ok := mine[first]; !ok {
			break
		}
	}
	for _, m := range replayFrom(t, dealer(t, p), first) {
		mine[m.seq] = m.payload
	}
	assert.Equal(t, want, mine, "after the replay the stalled subscriber's view is the healthy one's")
}
