package kvevents_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

var testLimits = zmtp.Limits{MaxFrame: 64 << 20, MaxFrames: 8}

// newPublisher returns a publisher on an ephemeral loopback port (and a replay
// socket on another), closed when the test ends.
func newPublisher(t testing.TB, opts kvevents.Options) *kvevents.Publisher {
	t.Helper()
	if opts.Endpoint == "" {
		opts.Endpoint = "tcp://127.0.0.1:0"
	}
	if opts.ReplayEndpoint == "" {
		opts.ReplayEndpoint = "tcp://127.0.0.1:0"
	}
	p, err := kvevents.New(opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// subscribe connects a SUB to p, subscribed to prefix, and waits until p has seen
// the subscription (n subscribed in all).
func subscribe(t testing.TB, p *kvevents.Publisher, prefix string, n int) *zmtp.Conn {
	t.Helper()
	c, err := zmtp.Dial(p.Endpoint()[len("tcp://"):], zmtp.TypeSub, testLimits, 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.Subscribe([]byte(prefix)))
	require.Eventually(t, func() bool { return p.Subscribed() == n }, 5*time.Second, time.Millisecond)
	return c
}

// dealer connects a DEALER to p's replay socket.
func dealer(t testing.TB, p *kvevents.Publisher) *zmtp.Conn {
	t.Helper()
	c, err := zmtp.Dial(p.ReplayEndpoint()[len("tcp://"):], zmtp.TypeDealer, testLimits, 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// message is one published message, as a subscriber reads it.
type message struct {
	topic   string
	seq     uint64
	payload []byte
}

func recv(t testing.TB, c *zmtp.Conn) message {
	t.Helper()
	m, err := c.ReadMsg()
	require.NoError(t, err)
	require.Empty(t, m.Command)
	require.Len(t, m.Frames, 3, "topic, sequence number, payload")
	require.Len(t, m.Frames[1], 8, "the sequence number is 8 bytes")
	return message{string(m.Frames[0]), beUint64(m.Frames[1]), m.Frames[2]}
}

// stored returns a BlocksStored of n blocks of size 4 whose hashes and tokens start
// at first (hash first+i, tokens (first+i)*4 ...), chained to parent when hasParent.
func stored(first uint64, n int, parent uint64, hasParent bool) kv.BlocksStored {
	s := kv.BlocksStored{Parent: parent, HasParent: hasParent, BlockSize: 4, Medium: "CPU"}
	for i := range n {
		h := first + uint64(i)
		s.Hashes = append(s.Hashes, h)
		for j := range 4 {
			s.Tokens = append(s.Tokens, int32(h)*4+int32(j))
		}
	}
	return s
}

// replayFrom asks c's replay socket for everything from seq on and returns it, the
// end marker checked.
func replayFrom(t testing.TB, c *zmtp.Conn, seq uint64) []message {
	t.Helper()
	start := make([]byte, 8)
	for i := range 8 {
		start[i] = byte(seq >> (56 - 8*i))
	}
	require.NoError(t, c.WriteMsg([][]byte{{}, start}, time.Time{}))
	var out []message
	for {
		m, err := c.ReadMsg()
		require.NoError(t, err)
		require.Len(t, m.Frames, 3, "empty, seq, payload")
		require.Empty(t, m.Frames[0])
		require.Len(t, m.Frames[1], 8)
		if int64(beUint64(m.Frames[1])) == -1 {
			require.Empty(t, m.Frames[2], "the end marker's payload is empty")
			return out
		}
		out = append(out, message{"", beUint64(m.Frames[1]), m.Frames[2]})
	}
}

// readBatches reads sub until its publisher has closed it and returns the events of
// each batch it got, in order.
func readBatches(t testing.TB, sub *zmtp.Conn) [][]any {
	t.Helper()
	var batches [][]any
	for {
		m, err := sub.ReadMsg()
		if err != nil {
			return batches
		}
		v, err := mpDecode(m.Frames[2])
		require.NoError(t, err)
		batches = append(batches, v.([]any)[1].([]any))
	}
}
