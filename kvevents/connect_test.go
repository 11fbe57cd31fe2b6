package kvevents_test

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
	"github.com/vmarena/vmarena/kvevents/kvsub"
)

// bindSub is a SUB socket that binds on loopback, as llm-d's global socket does,
// for publishers to connect to.
type bindSub struct {
	ln net.Listener
}

func newBindSub(t *testing.T) *bindSub {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	return &bindSub{ln: ln}
}

func (b *bindSub) endpoint() string { return "tcp://" + b.ln.Addr().String() }

// accept takes the next publisher's connection, handshakes as a SUB and subscribes
// to prefix.
func (b *bindSub) accept(t *testing.T, prefix string) *zmtp.Conn {
	t.Helper()
	nc, err := b.ln.Accept()
	require.NoError(t, err)
	c, err := zmtp.Handshake(nc, zmtp.TypeSub, testLimits, time.Now().Add(5*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.Subscribe([]byte(prefix)))
	return c
}

// TestConnect: a publisher with Connect dials a SUB that binds, whose subscription
// it then honours; the batches decode in kvsub, field by field. When the SUB's
// connection is lost, the publisher dials again and the new connection gets what is
// published next.
func TestConnect(t *testing.T) {
	b := newBindSub(t)
	p, err := kvevents.New(kvevents.Options{
		Connect: b.endpoint(), ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv@pod-a@model",
		ReconnectInterval: time.Millisecond, MaxReconnect: 10 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	assert.Equal(t, b.endpoint(), p.Endpoint())
	c := b.accept(t, "kv@")
	require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 5*time.Second, time.Millisecond)

	s := stored(7, 2, 3, true)
	s.Attention, s.Window = kv.SlidingWindow, 64
	p.BlocksStored(s)
	p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{7}, Medium: "CPU", Group: 1})
	var got []kvsub.Event
	for len(got) < 2 {
		m := recv(t, c)
		assert.Equal(t, "kv@pod-a@model", m.topic)
		batch, err := kvsub.Decode(m.payload)
		require.NoError(t, err)
		got = append(got, batch.Events...)
	}
	assert.Equal(t, []kvsub.Event{
		{Kind: kvsub.Stored, Hashes: []uint64{7, 8}, Parent: 3, HasParent: true, Tokens: []int32{28, 29, 30, 31, 32, 33, 34, 35},
			BlockSize: 4, Medium: "CPU", HasGroup: true, SpecKind: "sliding_window", Window: 64},
		{Kind: kvsub.Removed, Hashes: []uint64{7}, Medium: "CPU", Group: 1, HasGroup: true},
	}, got)

	// The SUB goes away; the publisher dials again.
	sent := uint64(p.Stats().Batches)
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return p.Stats().Subscribers == 0 }, 5*time.Second, time.Millisecond)
	c = b.accept(t, "kv@")
	require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 5*time.Second, time.Millisecond)
	p.AllBlocksCleared()
	m := recv(t, c)
	batch, err := kvsub.Decode(m.payload)
	require.NoError(t, err)
	assert.Equal(t, []kvsub.Event{{Kind: kvsub.Cleared}}, batch.Events)
	assert.Equal(t, sent, m.seq, "sequence numbers run on across connections")
}

// TestConnectDeadPeers: a Connect endpoint where nobody listens, or where a peer
// accepts and never answers, costs the cache's calls nothing: they return, every
// event is published (to no one) or, past QueueEvents, dropped and counted; the
// publisher keeps dialling, and Close returns.
func TestConnectDeadPeers(t *testing.T) {
	closedPort := func(t *testing.T) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ep := "tcp://" + ln.Addr().String()
		require.NoError(t, ln.Close())
		return ep
	}
	silent := func(t *testing.T) string { // accepts (the kernel does) and never answers
		b := newBindSub(t)
		return b.endpoint()
	}
	for _, tt := range []struct {
		name     string
		endpoint func(*testing.T) string
	}{{"nobody listens", closedPort}, {"the peer never answers", silent}} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := kvevents.New(kvevents.Options{
				Connect: tt.endpoint(t), HandshakeTimeout: 20 * time.Millisecond,
				ReconnectInterval: time.Millisecond, MaxReconnect: 5 * time.Millisecond,
			})
			require.NoError(t, err)
			for i := range 1000 {
				p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{uint64(i)}})
			}
			require.Eventually(t, func() bool { return p.Stats().DialFailures >= 3 }, 10*time.Second, time.Millisecond,
				"it dials again and again")
			require.NoError(t, p.Close())
			st := p.Stats()
			assert.Equal(t, int64(1000), st.Events+st.Dropped)
			assert.Equal(t, st.Events, st.Published, "every queued event went out, to no one")
			assert.Zero(t, st.Subscribers)
		})
	}
}

// TestConnectOptions: Connect's endpoint and its companions are checked.
func TestConnectOptions(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts kvevents.Options
		want error
	}{
		{"Endpoint and Connect", kvevents.Options{Endpoint: "tcp://127.0.0.1:0", Connect: "tcp://127.0.0.1:5557"}, kvevents.ErrOptions},
		{"MaxReconnect below ReconnectInterval", kvevents.Options{Connect: "tcp://127.0.0.1:5557", ReconnectInterval: time.Second, MaxReconnect: time.Millisecond}, kvevents.ErrOptions},
		{"negative ReconnectInterval", kvevents.Options{Connect: "tcp://127.0.0.1:5557", ReconnectInterval: -1}, kvevents.ErrOptions},
		{"negative MaxReconnect", kvevents.Options{Connect: "tcp://127.0.0.1:5557", MaxReconnect: -1}, kvevents.ErrOptions},
		{"not tcp", kvevents.Options{Connect: "ipc:///tmp/kv"}, kvevents.ErrEndpoint},
		{"port 0", kvevents.Options{Connect: "tcp://127.0.0.1:0"}, kvevents.ErrEndpoint},
		{"port *", kvevents.Options{Connect: "tcp://127.0.0.1:*"}, kvevents.ErrEndpoint},
		{"no host", kvevents.Options{Connect: "tcp://:5557"}, kvevents.ErrEndpoint},
		{"wildcard host", kvevents.Options{Connect: "tcp://*:5557"}, kvevents.ErrEndpoint},
		{"IPv6 without brackets", kvevents.Options{Connect: "tcp://::1:5557"}, kvevents.ErrEndpoint},
		{"IPv4 in brackets", kvevents.Options{Connect: "tcp://[127.0.0.1]:5557"}, kvevents.ErrEndpoint},
		{"rank past the last port", kvevents.Options{Connect: "tcp://127.0.0.1:65535", DataParallelRank: 1}, kvevents.ErrEndpoint},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := kvevents.New(tt.opts)
			require.ErrorIs(t, err, tt.want)
			assert.Nil(t, p)
		})
	}
}

// TestDialAddresses: what each Connect endpoint dials.
func TestDialAddresses(t *testing.T) {
	for _, tt := range []struct {
		endpoint string
		rank     int
		want     string
	}{
		{"tcp://127.0.0.1:5557", 0, "127.0.0.1:5557"},
		{"tcp://127.0.0.1:5557", 2, "127.0.0.1:5559"}, // vLLM's port + data-parallel rank
		{"tcp://[::1]:5557", 0, "[::1]:5557"},
		{"tcp://kv-indexer.llm-d.svc.cluster.local:5557", 0, "kv-indexer.llm-d.svc.cluster.local:5557"},
		{"tcp://localhost:1", 0, "localhost:1"},
	} {
		got, err := kvevents.DialAddress(tt.endpoint, tt.rank)
		require.NoError(t, err, tt.endpoint)
		assert.Equal(t, tt.want, got)
	}
}
