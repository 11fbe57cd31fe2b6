package kvevents_test

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
)

// TestQueueFull: with the publisher's goroutine held, events beyond QueueEvents are
// dropped and counted, the calls return at once, and what was queued still goes out.
func TestQueueFull(t *testing.T) {
	release := make(chan struct{})
	held := make(chan struct{})
	calls := 0
	p := newPublisher(t, kvevents.Options{
		QueueEvents: 5,
		Now: func() time.Time {
			calls++
			if calls == 1 {
				close(held)
				<-release
			}
			return time.Unix(0, 0)
		},
	})
	sub := subscribe(t, p, "", 1)
	p.AllBlocksCleared()
	<-held
	for i := range 8 {
		p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{uint64(i)}})
	}
	st := p.Stats()
	assert.Equal(t, 5, st.QueueDepth)
	assert.Equal(t, int64(3), st.Dropped)
	assert.Equal(t, int64(6), st.Events)
	close(release)
	require.NoError(t, p.Close())
	var hashes []any
	for _, evs := range readBatches(t, sub) {
		for _, ev := range evs {
			if h, ok := ev.(mpMap).get("block_hashes"); ok {
				hashes = append(hashes, h.([]any)...)
			}
		}
	}
	assert.Equal(t, []any{int64(0), int64(1), int64(2), int64(3), int64(4)}, hashes, "the first five, in order")
	assert.Equal(t, int64(6), p.Stats().Published)
}

// TestEnqueueAllocatesNothing: queueing an event allocates nothing on the cache's
// goroutine (the queue's growth aside, which AllocsPerRun's average rounds off: one
// allocation an event would read as 1), and wakes nothing: the publisher's goroutine,
// polling once an hour here, publishes none of it until Close.
func TestEnqueueAllocatesNothing(t *testing.T) {
	p := newPublisher(t, kvevents.Options{FlushInterval: time.Hour})
	stored := kv.BlocksStored{Hashes: []uint64{1, 2}, Tokens: make([]int32, 32), BlockSize: 16, Medium: "CPU"}
	removed := kv.BlocksRemoved{Hashes: []uint64{1, 2}, Medium: "CPU"}
	allocs := testing.AllocsPerRun(100, func() {
		p.BlocksStored(stored)
		p.BlocksRemoved(removed)
	})
	assert.Zero(t, allocs)
	st := p.Stats()
	assert.Equal(t, int64(202), st.Events)
	assert.Zero(t, st.Batches, "nothing woke the publisher")
	require.NoError(t, p.Close())
	assert.Equal(t, int64(202), p.Stats().Published)
}

// TestClose: Close publishes what is queued; events after it are dropped and
// counted; a second Close is an error.
func TestClose(t *testing.T) {
	p := newPublisher(t, kvevents.Options{})
	sub := subscribe(t, p, "", 1)
	for i := range 100 {
		p.BlocksStored(stored(uint64(i), 1, 0, false))
	}
	require.NoError(t, p.Close())
	n := 0
	for _, evs := range readBatches(t, sub) {
		n += len(evs)
	}
	assert.Equal(t, 100, n, "every event queued before Close reached the subscriber")
	p.AllBlocksCleared()
	p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{1}})
	assert.Equal(t, int64(2), p.Stats().Dropped)
	assert.ErrorIs(t, p.Close(), kvevents.ErrClosed)
	_, err := net.DialTimeout("tcp", p.Endpoint()[len("tcp://"):], time.Second)
	assert.Error(t, err, "the socket is closed")
}

// TestBadEndpoints: each bad endpoint is refused with an error that names it.
func TestBadEndpoints(t *testing.T) {
	for _, tt := range []struct{ name, endpoint string }{
		{"not tcp", "ipc:///tmp/kv.sock"},
		{"no scheme", "127.0.0.1:5557"},
		{"no port", "tcp://127.0.0.1"},
		{"port not a number", "tcp://127.0.0.1:port"},
		{"port past 65535", "tcp://127.0.0.1:65536"},
		{"negative port", "tcp://127.0.0.1:-1"},
		{"port with a sign", "tcp://127.0.0.1:+5557"},
		{"no host", "tcp://:5557"},
		{"a host name", "tcp://replica-1.example:5557"},
		{"IPv6 without brackets", "tcp://::1:5557"},
		{"IPv4 in brackets", "tcp://[127.0.0.1]:5557"},
		{"unclosed bracket", "tcp://[::1:5557"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for _, opts := range []kvevents.Options{
				{Endpoint: tt.endpoint},
				{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: tt.endpoint},
			} {
				p, err := kvevents.New(opts)
				require.ErrorIs(t, err, kvevents.ErrEndpoint)
				assert.Nil(t, p)
				assert.Contains(t, err.Error(), tt.endpoint)
			}
		})
	}
	t.Run("rank past the last port", func(t *testing.T) {
		_, err := kvevents.New(kvevents.Options{Endpoint: "tcp://127.0.0.1:65535", DataParallelRank: 1})
		assert.ErrorIs(t, err, kvevents.ErrEndpoint)
	})
}

// TestPortInUse: a port another socket holds is refused with ErrListen, and the
// replay port too, the publish socket then given back.
func TestPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	taken := "tcp://" + ln.Addr().String()
	_, err = kvevents.New(kvevents.Options{Endpoint: taken})
	require.ErrorIs(t, err, kvevents.ErrListen)
	assert.Contains(t, err.Error(), taken)

	free, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	freeEP := "tcp://" + free.Addr().String()
	require.NoError(t, free.Close())
	_, err = kvevents.New(kvevents.Options{Endpoint: freeEP, ReplayEndpoint: taken})
	require.ErrorIs(t, err, kvevents.ErrListen)
	p, err := kvevents.New(kvevents.Options{Endpoint: freeEP})
	require.NoError(t, err, "the failed New gave its publish port back")
	require.NoError(t, p.Close())

	_, err = kvevents.New(kvevents.Options{Endpoint: freeEP, ReplayEndpoint: freeEP})
	assert.ErrorIs(t, err, kvevents.ErrOptions, "one port for both sockets")
}

// TestBadOptions: negative sizes, counts and durations are refused.
func TestBadOptions(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts kvevents.Options
	}{
		{"QueueEvents", kvevents.Options{QueueEvents: -1}},
		{"MaxBatchEvents", kvevents.Options{MaxBatchEvents: -1}},
		{"ReplayBatches", kvevents.Options{ReplayBatches: -1}},
		{"ReplayBytes", kvevents.Options{ReplayBytes: -1}},
		{"SubscriberQueue", kvevents.Options{SubscriberQueue: -1}},
		{"MaxSubscribers", kvevents.Options{MaxSubscribers: -1}},
		{"MaxReplays", kvevents.Options{MaxReplays: -1}},
		{"HandshakeTimeout", kvevents.Options{HandshakeTimeout: -time.Second}},
		{"ReplayWriteTimeout", kvevents.Options{ReplayWriteTimeout: -time.Second}},
		{"Linger", kvevents.Options{Linger: -time.Second}},
		{"DataParallelRank", kvevents.Options{DataParallelRank: -1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.opts.Endpoint = "tcp://127.0.0.1:0"
			_, err := kvevents.New(tt.opts)
			require.ErrorIs(t, err, kvevents.ErrOptions)
			assert.True(t, strings.Contains(err.Error(), tt.name), "%v names %s", err, tt.name)
		})
	}
}

// TestListenAddresses: what each endpoint binds. Nothing beyond loopback unless the
// wildcard or an address or interface is named.
func TestListenAddresses(t *testing.T) {
	lo := loopbackInterface(t)
	for _, tt := range []struct {
		endpoint string
		rank     int
		want     string
	}{
		{kvevents.DefaultEndpoint, 0, "127.0.0.1:5557"},
		{"tcp://localhost:5557", 0, "127.0.0.1:5557"},
		{"tcp://*:5557", 0, "0.0.0.0:5557"},
		{"tcp://[::1]:5557", 0, "[::1]:5557"},
		{"tcp://10.1.2.3:80", 0, "10.1.2.3:80"},
		{"tcp://127.0.0.1:*", 0, "127.0.0.1:0"},
		{"tcp://127.0.0.1:0", 3, "127.0.0.1:0"},
		{"tcp://127.0.0.1:5557", 3, "127.0.0.1:5560"}, // vLLM's port + data-parallel rank
		{"tcp://" + lo + ":5557", 0, "127.0.0.1:5557"},
	} {
		got, err := kvevents.ListenAddress(tt.endpoint, tt.rank)
		require.NoError(t, err, tt.endpoint)
		assert.Equal(t, tt.want, got, "%s rank %d", tt.endpoint, tt.rank)
	}
}

// loopbackInterface returns the name of the interface that holds 127.0.0.1.
func loopbackInterface(t *testing.T) string {
	ifs, err := net.Interfaces()
	require.NoError(t, err)
	for _, ifi := range ifs {
		addrs, _ := ifi.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.Equal(net.IPv4(127, 0, 0, 1)) {
				return ifi.Name
			}
		}
	}
	t.Fatal("no interface holds 127.0.0.1")
	return ""
}

// TestDefaultBindsLoopbackOnly: a publisher with no endpoint named listens on
// 127.0.0.1 (when port 5557 is free: another process may hold it, which is then the
// error asked for, not a wider bind).
func TestDefaultBindsLoopbackOnly(t *testing.T) {
	p, err := kvevents.New(kvevents.Options{})
	if err != nil {
		require.ErrorIs(t, err, kvevents.ErrListen)
		return
	}
	defer p.Close()
	assert.Equal(t, "tcp://127.0.0.1:5557", p.Endpoint())
	assert.Empty(t, p.ReplayEndpoint(), "no replay socket unless one is named")
}

// TestBadEvent: a BlocksStored that breaks kv's contract is a named panic, not a
// malformed message on the wire.
func TestBadEvent(t *testing.T) {
	p := newPublisher(t, kvevents.Options{})
	good := stored(1, 2, 0, false)
	for _, tt := range []struct {
		name string
		mod  func(*kv.BlocksStored)
	}{
		{"block size 0", func(s *kv.BlocksStored) { s.BlockSize = 0 }},
		{"a token short", func(s *kv.BlocksStored) { s.Tokens = s.Tokens[1:] }},
		{"a hash short", func(s *kv.BlocksStored) { s.Hashes = s.Hashes[1:] }},
		{"extra keys for one block of two", func(s *kv.BlocksStored) { s.ExtraKeys = [][]any{{"x"}} }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := good
			tt.mod(&s)
			assert.PanicsWithValue(t, kvevents.PanicBadEvent, func() { p.BlocksStored(s) })
		})
	}
	assert.Zero(t, p.Stats().Events)
}
