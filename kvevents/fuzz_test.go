package kvevents_test

import (
	"errors"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

// loopbackOnly returns endpoint rewritten to bind, or dial, loopback on a port the
// system picks (or, dialled, one nobody listens on), once the package has parsed
// it as given (the parse is what is fuzzed; what is bound or dialled must stay on
// this host and off other processes' ports). ok is false when the parse failed.
func loopbackOnly(endpoint string, rank int, dial bool, deadPort string) (string, bool) {
	if dial {
		if _, err := kvevents.DialAddress(endpoint, rank); err != nil {
			return endpoint, false
		}
		return "tcp://127.0.0.1:" + deadPort, true
	}
	if _, err := kvevents.ListenAddress(endpoint, rank); err != nil {
		return endpoint, false
	}
	return "tcp://127.0.0.1:0", true
}

// FuzzOptions: whatever the Options, New either fails with an error matching one
// of the package's sentinels, or returns a publisher that works: a subscriber gets
// in (when it binds), every event queued is published by Close, and a second
// Close says ErrClosed. Never a panic.
func FuzzOptions(f *testing.F) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(f, err)
	_, deadPort, _ := net.SplitHostPort(ln.Addr().String())
	require.NoError(f, ln.Close())

	type seed struct {
		endpoint, replay, connect, topic                                              string
		queue, batch, replayBatches, replayBytes, subQueue, maxSubs, maxReplays, rank int64
		handshake, replayWrite, linger, flush, reconnect, maxReconnect                int64
		flags                                                                         uint8
	}
	for _, s := range []seed{
		{},
		{endpoint: "tcp://127.0.0.1:0", replay: "tcp://127.0.0.1:0", topic: "kv@pod@model", flags: 7},
		{connect: "tcp://127.0.0.1:5557", topic: "kv@", reconnect: 1e6, maxReconnect: 1e7, handshake: 1e6},
		{connect: "tcp://indexer.llm-d.svc:5557", rank: 3},
		{endpoint: "tcp://127.0.0.1:65535", rank: 1},
		{endpoint: "tcp://[::1]:*", replay: "tcp://localhost:0", flags: 1},
		{endpoint: "ipc:///tmp/x", replay: "tcp://:1"},
		{endpoint: "tcp://127.0.0.1:0", connect: "tcp://127.0.0.1:1"},
		{queue: -1, batch: -1, replayBatches: -1, replayBytes: -1, subQueue: -1, maxSubs: -1, maxReplays: -1, rank: -1},
		{handshake: -1, replayWrite: -1, linger: -1, flush: -1, reconnect: -1, maxReconnect: -1},
		{queue: math.MaxInt64, batch: math.MaxInt64, replayBatches: math.MaxInt64, replayBytes: math.MaxInt64,
			subQueue: math.MaxInt64, maxSubs: math.MaxInt64, maxReplays: math.MaxInt64, rank: math.MaxInt64},
		{handshake: math.MaxInt64, replayWrite: math.MaxInt64, linger: 1, flush: math.MaxInt64, reconnect: math.MaxInt64, maxReconnect: math.MaxInt64},
		{queue: 1, batch: 1, replayBatches: 1, replayBytes: 1, subQueue: 1, maxSubs: 1, maxReplays: 1, handshake: 1, flush: 1, flags: 2},
	} {
		f.Add(s.endpoint, s.replay, s.connect, s.topic, s.queue, s.batch, s.replayBatches, s.replayBytes, s.subQueue, s.maxSubs,
			s.maxReplays, s.rank, s.handshake, s.replayWrite, s.linger, s.flush, s.reconnect, s.maxReconnect, s.flags)
	}
	quietClock := func() time.Time { return time.Unix(1, 0) }
	f.Fuzz(func(t *testing.T, endpoint, replay, connect, topic string,
		queue, batch, replayBatches, replayBytes, subQueue, maxSubs, maxReplays, rank int64,
		handshake, replayWrite, linger, flush, reconnect, maxReconnect int64, flags uint8) {
		if int64(int(rank)) != rank { // a 32-bit int: as the caller's int would be
			rank = int64(int32(rank))
		}
		opts := kvevents.Options{
			Endpoint: endpoint, ReplayEndpoint: replay, Connect: connect, Topic: topic,
			DataParallelRank: int(rank), VLLM023Events: flags&1 != 0,
			QueueEvents: int(queue), MaxBatchEvents: int(batch), ReplayBatches: int(replayBatches), ReplayBytes: int(replayBytes),
			SubscriberQueue: int(subQueue), MaxSubscribers: int(maxSubs), MaxReplays: int(maxReplays),
			HandshakeTimeout: time.Duration(handshake), ReplayWriteTimeout: time.Duration(replayWrite),
			Linger:        min(time.Duration(linger), 10*time.Millisecond), // a subscriber that is gone is waited for this long at Close
			FlushInterval: time.Duration(flush), ReconnectInterval: time.Duration(reconnect), MaxReconnect: time.Duration(maxReconnect),
		}
		if flags&2 != 0 {
			opts.Logger = quiet
		}
		if flags&4 != 0 {
			opts.Now = quietClock
		}
		if opts.Endpoint != "" {
			opts.Endpoint, _ = loopbackOnly(opts.Endpoint, opts.DataParallelRank, false, "")
		}
		if opts.ReplayEndpoint != "" {
			opts.ReplayEndpoint, _ = loopbackOnly(opts.ReplayEndpoint, opts.DataParallelRank, false, "")
		}
		if opts.Connect != "" {
			var ok bool
			if opts.Connect, ok = loopbackOnly(opts.Connect, opts.DataParallelRank, true, deadPort); ok {
				opts.DataParallelRank = 0 // the rank would move the dead port onto another's
			}
		}
		if opts.Endpoint == "" && opts.Connect == "" {
			opts.Endpoint = "tcp://127.0.0.1:0" // not the default's fixed port, which another may hold
		}

		p, err := kvevents.New(opts)
		if err != nil {
			require.Nil(t, p)
			require.True(t, errors.Is(err, kvevents.ErrEndpoint) || errors.Is(err, kvevents.ErrListen) || errors.Is(err, kvevents.ErrOptions),
				"an error of no sentinel: %v", err)
			return
		}
		if opts.Connect == "" {
			require.True(t, strings.HasPrefix(p.Endpoint(), "tcp://127.0.0.1:"), p.Endpoint())
			// A subscriber gets in, unless the handshake timeout is too short for it.
			if c, err := zmtp.Dial(p.Endpoint()[len("tcp://"):], zmtp.TypeSub, testLimits, time.Second); err == nil {
				_ = c.Subscribe([]byte(topic))
				defer c.Close()
			}
		}
		p.BlocksStored(stored(1, 2, 0, false))
		p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{1}})
		p.AllBlocksCleared()
		require.NoError(t, p.Close())
		st := p.Stats()
		require.Equal(t, int64(3), st.Events+st.Dropped)
		require.Equal(t, st.Events, st.Published, "Close publishes every queued event")
		require.ErrorIs(t, p.Close(), kvevents.ErrClosed)
	})
}
