package zmtp_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

var lim = zmtp.Limits{MaxFrame: 1 << 20, MaxFrames: 8}

func newPub(t *testing.T, opts zmtp.PubOptions) *zmtp.Pub {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	if opts.MaxPeers == 0 {
		opts.ServerOptions = zmtp.ServerOptions{MaxPeers: 4, HandshakeTimeout: 5 * time.Second, Limits: zmtp.Limits{MaxFrame: 256, MaxFrames: 2}}
	}
	if opts.QueueLen == 0 {
		opts.QueueLen = 16
	}
	if opts.MaxSubscriptions == 0 {
		opts.MaxSubscriptions = 4
	}
	p := zmtp.NewPub(ln, opts)
	t.Cleanup(func() { p.Close(0) })
	return p
}

func dial(t *testing.T, addr net.Addr, typ string) *zmtp.Conn {
	t.Helper()
	c, err := zmtp.Dial(addr.String(), typ, lim, 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// closedByPeer says whether nc is closed by the other end within 5 s.
func closedByPeer(t *testing.T, nc net.Conn) bool {
	t.Helper()
	require.NoError(t, nc.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err := io.Copy(io.Discard, nc)
	return err == nil // io.Copy returns nil at EOF
}

// TestHandshakeTimeout: a connection that never finishes its greeting is closed
// after HandshakeTimeout and counted.
func TestHandshakeTimeout(t *testing.T) {
	p := newPub(t, zmtp.PubOptions{ServerOptions: zmtp.ServerOptions{MaxPeers: 4, HandshakeTimeout: 100 * time.Millisecond, Limits: lim}})
	nc, err := net.Dial("tcp", p.Addr().String())
	require.NoError(t, err)
	defer nc.Close()
	assert.True(t, closedByPeer(t, nc))
	assert.Equal(t, int64(1), p.Refused())
	dial(t, p.Addr(), zmtp.TypeSub) // and the socket still takes subscribers
}

// TestMaxPeers: connections beyond MaxPeers are closed at once; one that goes frees
// its place.
func TestMaxPeers(t *testing.T) {
	p := newPub(t, zmtp.PubOptions{ServerOptions: zmtp.ServerOptions{MaxPeers: 2, HandshakeTimeout: 5 * time.Second, Limits: lim}})
	a := dial(t, p.Addr(), zmtp.TypeSub)
	dial(t, p.Addr(), zmtp.TypeSub)
	require.Eventually(t, func() bool { return p.Subscribers() == 2 }, 5*time.Second, time.Millisecond)
	nc, err := net.Dial("tcp", p.Addr().String())
	require.NoError(t, err)
	defer nc.Close()
	assert.True(t, closedByPeer(t, nc), "a third peer is closed")
	assert.Equal(t, int64(1), p.Refused())
	require.NoError(t, a.Close())
	// Its place is free once the server has seen it go (a moment after the PUB has).
	require.Eventually(t, func() bool {
		c, err := zmtp.Dial(p.Addr().String(), zmtp.TypeSub, lim, 5*time.Second)
		if err != nil {
			return false
		}
		_ = c.Close()
		return true
	}, 5*time.Second, 10*time.Millisecond)
}

// TestBadPeers: what is not a ZMTP 3 NULL peer of a compatible type is refused.
func TestBadPeers(t *testing.T) {
	p := newPub(t, zmtp.PubOptions{})
	t.Run("not ZMTP", func(t *testing.T) {
		nc, err := net.Dial("tcp", p.Addr().String())
		require.NoError(t, err)
		defer nc.Close()
		_, err = nc.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n" + string(make([]byte, 64))))
		require.NoError(t, err)
		assert.True(t, closedByPeer(t, nc))
	})
	t.Run("incompatible type", func(t *testing.T) {
		_, err := zmtp.Dial(p.Addr().String(), zmtp.TypeDealer, lim, 5*time.Second)
		assert.ErrorIs(t, err, zmtp.ErrProtocol, "a DEALER can not talk to a PUB")
	})
	assert.Eventually(t, func() bool { return p.Refused() == 2 }, 5*time.Second, time.Millisecond)
	assert.Zero(t, p.Subscribers())
}

// TestSubscriptions: ZMTP 3.0 messages and 3.1 commands subscribe and cancel; a
// prefix matches every topic it begins; a subscription taken twice needs two
// cancels; a PING is answered.
func TestSubscriptions(t *testing.T) {
	p := newPub(t, zmtp.PubOptions{})
	c := dial(t, p.Addr(), zmtp.TypeSub)
	require.NoError(t, c.Subscribe([]byte("kv@")))
	require.NoError(t, c.Subscribe([]byte("kv@")))
	require.NoError(t, c.WriteMsg([][]byte{[]byte("\x09SUBSCRIBE")}, time.Time{})) // not a command: a message, ignored
	require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 5*time.Second, time.Millisecond)
	send := func(topic string) { p.Send([][]byte{[]byte(topic), []byte("x")}) }
	send("kv@a")
	send("other")
	m, err := c.ReadMsg()
	require.NoError(t, err)
	assert.Equal(t, "kv@a", string(m.Frames[0]))

	require.NoError(t, c.WriteMsg([][]byte{[]byte("\x00kv@")}, time.Time{})) // one cancel of two
	ping(t, c)                                                               // the cancel is processed
	send("kv@b")
	m, err = c.ReadMsg()
	require.NoError(t, err)
	assert.Equal(t, "kv@b", string(m.Frames[0]), "still subscribed once")

	require.NoError(t, c.WriteMsg([][]byte{[]byte("\x00kv@")}, time.Time{}))
	ping(t, c)
	assert.Zero(t, p.Subscribed())
	require.NoError(t, writeCommand(c, "SUBSCRIBE", "kv@c")) // ZMTP 3.1
	ping(t, c)
	send("kv@b")
	send("kv@c")
	m, err = c.ReadMsg()
	require.NoError(t, err)
	assert.Equal(t, "kv@c", string(m.Frames[0]), "kv@b went nowhere")
}

// ping sends a PING and reads up to its PONG: every message sent before it has then
// been read by the socket.
func ping(t *testing.T, c *zmtp.Conn) {
	t.Helper()
	require.NoError(t, writeCommand(c, "PING", "\x00\x00ctx"))
	for {
		m, err := c.ReadMsg()
		require.NoError(t, err)
		if m.Command == "PONG" {
			assert.Equal(t, "ctx", string(m.Body))
			return
		}
	}
}

func writeCommand(c *zmtp.Conn, name, data string) error {
	return zmtp.WriteCommand(c, name, []byte(data))
}

// TestTooManySubscriptions: a subscriber asking for more prefixes than allowed is
// closed.
func TestTooManySubscriptions(t *testing.T) {
	p := newPub(t, zmtp.PubOptions{MaxSubscriptions: 2})
	c := dial(t, p.Addr(), zmtp.TypeSub)
	for _, s := range []string{"a", "b", "c"} {
		require.NoError(t, c.Subscribe([]byte(s)))
	}
	_, err := c.ReadMsg()
	assert.Error(t, err, "closed")
}

// TestOversizedFrames: a frame past MaxFrame and frames past MaxFrames are skipped,
// the message marked, and the connection goes on.
func TestOversizedFrames(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	got := make(chan zmtp.Msg, 8)
	r := zmtp.NewRouter(ln, zmtp.ServerOptions{MaxPeers: 2, HandshakeTimeout: 5 * time.Second, Limits: zmtp.Limits{MaxFrame: 16, MaxFrames: 2}},
		func(c *zmtp.Conn, m zmtp.Msg) { got <- m })
	defer r.Close()
	c := dial(t, r.Addr(), zmtp.TypeDealer)
	require.NoError(t, c.WriteMsg([][]byte{make([]byte, 300)}, time.Time{}))      // a long frame
	require.NoError(t, c.WriteMsg([][]byte{{1}, {2}, {3}}, time.Time{}))          // a frame too many
	require.NoError(t, c.WriteMsg([][]byte{{}, []byte("12345678")}, time.Time{})) // fine
	m := <-got
	assert.True(t, m.Oversized)
	assert.Empty(t, m.Frames)
	m = <-got
	assert.True(t, m.Oversized)
	assert.Equal(t, [][]byte{{1}, {2}}, m.Frames)
	m = <-got
	assert.False(t, m.Oversized)
	assert.Equal(t, [][]byte{{}, []byte("12345678")}, m.Frames)
}

// TestCloseLinger: Close lets a subscriber take what is queued for it.
func TestCloseLinger(t *testing.T) {
	p := newPub(t, zmtp.PubOptions{QueueLen: 100})
	c := dial(t, p.Addr(), zmtp.TypeSub)
	require.NoError(t, c.Subscribe(nil))
	require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 5*time.Second, time.Millisecond)
	for range 50 {
		p.Send([][]byte{{}, make([]byte, 1000)})
	}
	p.Close(5 * time.Second)
	n := 0
	for {
		if _, err := c.ReadMsg(); err != nil {
			break
		}
		n++
	}
	assert.Equal(t, 50, n)
	assert.Equal(t, int64(50), p.Sent())
	assert.Zero(t, p.Drops())
}
