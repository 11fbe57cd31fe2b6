package kvevents

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/internal/poll"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

// DefaultEndpoint is where a publisher binds unless Options.Endpoint says otherwise:
// vLLM's port, on loopback only (vLLM's own default, tcp://*:5557, is every interface).
const DefaultEndpoint = "tcp://127.0.0.1:5557"

// Defaults of Options' zero fields.
const (
	DefaultQueueEvents        = 65536
	DefaultMaxBatchEvents     = 1024
	DefaultReplayBatches      = 10000 // vLLM's buffer_steps
	DefaultReplayBytes        = 64 << 20
	DefaultSubscriberQueue    = 4096
	DefaultMaxSubscribers     = 64
	DefaultMaxReplays         = 4
	DefaultHandshakeTimeout   = 5 * time.Second
	DefaultReplayWriteTimeout = 10 * time.Second
	DefaultLinger             = time.Second // vLLM's SHUTDOWN_TIMEOUT
	DefaultFlushInterval      = time.Millisecond
	DefaultReconnectInterval  = 100 * time.Millisecond // libzmq's ZMQ_RECONNECT_IVL
	DefaultMaxReconnect       = 5 * time.Second
)

// maxIdlePolls bounds the publisher's backoff when no events come: it polls its
// queue every FlushInterval while busy, and at most this many intervals apart once
// quiet (64 ms by default).
const maxIdlePolls = 64

// Upper bounds of Options, for what is allocated whole or multiplied: a larger value
// is refused with ErrOptions.
const (
	MaxMaxReplays      = 1 << 10        // MaxReplays: a slot each, allocated by New
	MaxSubscriberQueue = 1 << 20        // SubscriberQueue: allocated whole for each subscriber
	MaxFlushInterval   = time.Hour      // FlushInterval: times maxIdlePolls once quiet
	MaxMaxReconnect    = 24 * time.Hour // MaxReconnect, and so ReconnectInterval
)

// Options configure a Publisher. The zero value publishes on DefaultEndpoint with no
// replay socket, topic "" and rank 0; every zero size, count or duration means its
// Default.
type Options struct {
	// Endpoint is the tcp://HOST:PORT the PUB socket binds, for subscribers that
	// connect to it (llm-d's pod discovery, Dynamo). HOST is an IP address (IPv6 in
	// brackets), localhost, * (every interface) or an interface's name; PORT may be *
	// or 0 for one the system picks (see Publisher.Endpoint). "" means
	// DefaultEndpoint, unless Connect is set.
	Endpoint string
	// Connect is the tcp://HOST:PORT of a SUB socket that binds, which the PUB socket
	// dials instead of binding Endpoint (llm-d's "global socket", which every
	// engine's publisher connects to); Endpoint must then be "". HOST is an IP address
	// (IPv6 in brackets) or a host name, looked up at each dial. The PUB dials again
	// when the dial, its handshake (HandshakeTimeout) or the connection fails, after
	// ReconnectInterval, doubling up to MaxReconnect. Publishing never waits for it:
	// what is published while it is not connected and subscribed reaches no one (as
	// with libzmq's PUB), and is kept for the replay socket, if any.
	Connect string
	// ReplayEndpoint is the ROUTER socket's endpoint, in the same form; "" means none.
	ReplayEndpoint string
	// Topic is every message's first frame.
	Topic string
	// DataParallelRank is sent in every batch, and added to both endpoints' ports
	// (not to an ephemeral one), as vLLM does for a data-parallel rank's publisher.
	DataParallelRank int
	// VLLM023Events writes each event as a positional array led by its type, the form
	// of vLLM v0.23.0 and before, for a router that reads no other; the default is a
	// map led by "type", the form of vLLM v0.26.0. The batch is a positional array in
	// both (see encode.go).
	VLLM023Events bool

	QueueEvents     int // events waiting to be encoded; an event that finds the queue full is dropped
	MaxBatchEvents  int // most events in one message
	ReplayBatches   int // most messages kept for replay (the oldest go first)
	ReplayBytes     int // most payload bytes kept for replay
	SubscriberQueue int // messages queued per subscriber (at most MaxSubscriberQueue); what finds it full is dropped for that subscriber
	MaxSubscribers  int // most connections to each socket at once; more are closed
	MaxReplays      int // most replays streaming at once (at most MaxMaxReplays); a request beyond is dropped (and counted)

	HandshakeTimeout   time.Duration // a connection that has not finished its ZMTP handshake by then is closed
	ReplayWriteTimeout time.Duration // a replay client that takes no message for this long is disconnected
	Linger             time.Duration // how long Close lets subscribers take what is queued for them
	ReconnectInterval  time.Duration // with Connect: the wait before dialling again after a failure or a loss
	MaxReconnect       time.Duration // with Connect: the longest such wait (at most MaxMaxReconnect), the back-off doubling up to it
	// FlushInterval is how often the publisher takes what is queued while events
	// come (at most MaxFlushInterval); after a quiet spell it polls less often, up to
	// 64 intervals apart, so an event then waits up to that long. The cache never wakes it: waking a goroutine would
	// cost the caller microseconds, where queueing an event costs tens of nanoseconds.
	FlushInterval time.Duration

	// Logger receives a line for each malformed or refused replay request (at most
	// one a second; the counts in Stats are exact) and for a replay client dropped.
	// nil means slog.Default().
	Logger *slog.Logger
	// Now is the clock of each batch's ts; nil means time.Now.
	Now func() time.Time
}

// Stats is a snapshot of a Publisher's counters.
type Stats struct {
	Events          int64  // events queued, in all
	Published       int64  // events sent in a batch, in all
	Batches         int64  // messages published, in all: the next sequence number
	Dropped         int64  // events not queued (queue full, or after Close), in all
	QueueDepth      int    // events waiting to be encoded now
	Subscribers     int    // connected subscribers now
	SubscriberDrops int64  // messages a subscriber's full queue did not take, in all
	ReplayBatches   int    // messages kept for replay now
	ReplayBytes     int64  // their payload bytes
	ReplayFirstSeq  uint64 // the oldest kept message's sequence number (meaningful when ReplayBatches > 0)
	ReplaysActive   int    // replays streaming now
	Replays         int64  // replays served, in all
	ReplaysAborted  int64  // replays cut off, the client gone or taking nothing for ReplayWriteTimeout, in all
	ReplaysRefused  int64  // well-formed replay requests dropped for MaxReplays, in all
	BadRequests     int64  // malformed replay requests dropped, in all
	RefusedConns    int64  // connections closed for MaxSubscribers or a failed handshake, both sockets, in all
	DialFailures    int64  // with Connect: dials, or handshakes after one, that failed, in all
}

// Publisher puts a prefix cache's block events on a ZMQ PUB socket in vLLM's wire
// format. It is a kv.BlockEvents: pass it to the prefix cache's options.
type Publisher struct {
	opts   Options
	log    *slog.Logger
	pub    *zmtp.Pub
	router *zmtp.Router
	topic  []byte
	replay *replayBuffer
	// dialAddr is the host:port dialled with Options.Connect, "" when bound.
	dialAddr string
	slots    chan struct{} // one token per replay streaming now

	mu      sync.Mutex
	pending []event
	closed  bool
	events  int64 // events queued, in all

	stop     chan struct{} // closed by Close
	loopDone chan struct{}

	published, batches, dropped    atomic.Int64
	replays, aborted, refused, bad atomic.Int64
	logLimit                       logLimiter
}

var _ kv.BlockEvents = (*Publisher)(nil)

// New returns a publisher bound to opts.Endpoint, or dialling opts.Connect (and
// bound to opts.ReplayEndpoint, if any), publishing from a goroutine of its own
// until Close. It returns an error matching ErrEndpoint for an endpoint it can not
// parse, ErrListen (and the system's error) for one it can not bind, and ErrOptions
// for bad Options. It does not wait for Connect's peer: a peer that is not there
// yet is dialled until it is.
func New(opts Options) (*Publisher, error) {
	if err := opts.fill(); err != nil {
		return nil, err
	}
	var pubAddr, dialAddr string
	var err error
	if opts.Connect != "" {
		if dialAddr, err = dialAddress(opts.Connect, opts.DataParallelRank); err != nil {
			return nil, err
		}
	} else if pubAddr, err = listenAddress(opts.Endpoint, opts.DataParallelRank); err != nil {
		return nil, err
	}
	replayAddr := ""
	if opts.ReplayEndpoint != "" {
		if replayAddr, err = listenAddress(opts.ReplayEndpoint, opts.DataParallelRank); err != nil {
			return nil, err
		}
		if replayAddr == pubAddr && !hasEphemeralPort(pubAddr) {
			return nil, fmt.Errorf("%w: publish and replay endpoints are both %s", ErrOptions, pubAddr)
		}
	}
	p := &Publisher{
		opts:     opts,
		log:      opts.Logger,
		topic:    []byte(opts.Topic),
		replay:   newReplayBuffer(opts.ReplayBatches, opts.ReplayBytes),
		slots:    make(chan struct{}, opts.MaxReplays),
		stop:     make(chan struct{}),
		loopDone: make(chan struct{}),
	}
	var pubLn, replayLn net.Listener
	if dialAddr == "" {
		if pubLn, err = net.Listen("tcp", pubAddr); err != nil {
			return nil, fmt.Errorf("%w on %s: %w", ErrListen, opts.Endpoint, err)
		}
	}
	if replayAddr != "" {
		if replayLn, err = net.Listen("tcp", replayAddr); err != nil {
			if pubLn != nil {
				_ = pubLn.Close()
			}
			return nil, fmt.Errorf("%w on %s: %w", ErrListen, opts.ReplayEndpoint, err)
		}
	}
	server := zmtp.ServerOptions{
		MaxPeers:         opts.MaxSubscribers,
		HandshakeTimeout: opts.HandshakeTimeout,
		// A subscriber sends subscriptions only; a topic is far below 4 KiB.
		Limits: zmtp.Limits{MaxFrame: 4096, MaxFrames: 4},
	}
	pubOpts := zmtp.PubOptions{
		ServerOptions:    server,
		QueueLen:         opts.SubscriberQueue,
		MaxSubscriptions: 64,
	}
	if dialAddr != "" {
		p.dialAddr = dialAddr
		p.pub = zmtp.NewPubDialer(dialAddr, pubOpts, zmtp.Redial{Min: opts.ReconnectInterval, Max: opts.MaxReconnect})
	} else {
		p.pub = zmtp.NewPub(pubLn, pubOpts)
	}
	if replayLn != nil {
		// A request is [empty, 8 bytes]: anything longer is malformed, and skipped.
		server.Limits = zmtp.Limits{MaxFrame: 64, MaxFrames: 4}
		p.router = zmtp.NewRouter(replayLn, server, p.serveReplay)
	}
	go p.loop()
	return p, nil
}

func hasEphemeralPort(hostport string) bool {
	_, port, _ := net.SplitHostPort(hostport)
	return port == "0"
}

func (o *Options) fill() error {
	for _, f := range []struct {
		name string
		v    *int
		def  int
	}{
		{"QueueEvents", &o.QueueEvents, DefaultQueueEvents},
		{"MaxBatchEvents", &o.MaxBatchEvents, DefaultMaxBatchEvents},
		{"ReplayBatches", &o.ReplayBatches, DefaultReplayBatches},
		{"ReplayBytes", &o.ReplayBytes, DefaultReplayBytes},
		{"SubscriberQueue", &o.SubscriberQueue, DefaultSubscriberQueue},
		{"MaxSubscribers", &o.MaxSubscribers, DefaultMaxSubscribers},
		{"MaxReplays", &o.MaxReplays, DefaultMaxReplays},
	} {
		switch {
		case *f.v < 0:
			return fmt.Errorf("%w: %s is %d", ErrOptions, f.name, *f.v)
		case *f.v == 0:
			*f.v = f.def
		}
	}
	for _, f := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"HandshakeTimeout", &o.HandshakeTimeout, DefaultHandshakeTimeout},
		{"ReplayWriteTimeout", &o.ReplayWriteTimeout, DefaultReplayWriteTimeout},
		{"Linger", &o.Linger, DefaultLinger},
		{"FlushInterval", &o.FlushInterval, DefaultFlushInterval},
		{"ReconnectInterval", &o.ReconnectInterval, DefaultReconnectInterval},
		{"MaxReconnect", &o.MaxReconnect, DefaultMaxReconnect},
	} {
		switch {
		case *f.v < 0:
			return fmt.Errorf("%w: %s is %v", ErrOptions, f.name, *f.v)
		case *f.v == 0:
			*f.v = f.def
		}
	}
	for _, f := range []struct {
		name     string
		v, limit int64
	}{
		{"MaxReplays", int64(o.MaxReplays), MaxMaxReplays},
		{"SubscriberQueue", int64(o.SubscriberQueue), MaxSubscriberQueue},
		{"FlushInterval", int64(o.FlushInterval), int64(MaxFlushInterval)},
		{"MaxReconnect", int64(o.MaxReconnect), int64(MaxMaxReconnect)},
	} {
		if f.v > f.limit {
			return fmt.Errorf("%w: %s is %d, past its bound %d", ErrOptions, f.name, f.v, f.limit)
		}
	}
	if o.DataParallelRank < 0 {
		return fmt.Errorf("%w: DataParallelRank is %d", ErrOptions, o.DataParallelRank)
	}
	if o.MaxReconnect < o.ReconnectInterval {
		return fmt.Errorf("%w: MaxReconnect %v is below ReconnectInterval %v", ErrOptions, o.MaxReconnect, o.ReconnectInterval)
	}
	switch {
	case o.Connect != "" && o.Endpoint != "":
		return fmt.Errorf("%w: Endpoint %q and Connect %q: the PUB socket binds or dials, not both", ErrOptions, o.Endpoint, o.Connect)
	case o.Endpoint == "" && o.Connect == "":
		o.Endpoint = DefaultEndpoint
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return nil
}

// Endpoint returns the PUB socket's endpoint as bound, with the port the system
// picked for an ephemeral one; or, with Options.Connect, the endpoint it dials
// (its port moved up by the data-parallel rank).
func (p *Publisher) Endpoint() string {
	if p.dialAddr != "" {
		return "tcp://" + p.dialAddr
	}
	return "tcp://" + p.pub.Addr().String()
}

// ReplayEndpoint returns the ROUTER socket's endpoint as bound, or "" without one.
func (p *Publisher) ReplayEndpoint() string {
	if p.router == nil {
		return ""
	}
	return "tcp://" + p.router.Addr().String()
}

// PanicBadEvent is the panic value of BlocksStored for an event that breaks
// kv.BlocksStored's contract: a block size below 1, len(Tokens) not len(Hashes) *
// BlockSize, or ExtraKeys neither nil nor one entry per block.
const PanicBadEvent = "kvevents: BlocksStored breaks kv.BlocksStored's contract"

// BlocksStored queues a BlockStored event. It never blocks: with the queue full, or
// the publisher closed, the event is dropped and counted in Stats.Dropped. It panics
// with PanicBadEvent for an event that breaks kv.BlocksStored's contract.
func (p *Publisher) BlocksStored(s kv.BlocksStored) {
	if s.BlockSize < 1 || len(s.Tokens) != len(s.Hashes)*s.BlockSize || s.ExtraKeys != nil && len(s.ExtraKeys) != len(s.Hashes) {
		panic(PanicBadEvent)
	}
	p.enqueue(event{kind: kindStored, stored: s})
}

// BlocksRemoved queues a BlockRemoved event, as BlocksStored does.
func (p *Publisher) BlocksRemoved(r kv.BlocksRemoved) {
	p.enqueue(event{kind: kindRemoved, stored: kv.BlocksStored{Hashes: r.Hashes, Group: r.Group, Medium: r.Medium}})
}

// AllBlocksCleared queues an AllBlocksCleared event, as BlocksStored does.
func (p *Publisher) AllBlocksCleared() { p.enqueue(event{kind: kindCleared}) }

func (p *Publisher) enqueue(ev event) {
	p.mu.Lock()
	if p.closed || len(p.pending) >= p.opts.QueueEvents {
		p.mu.Unlock()
		p.dropped.Add(1)
		return
	}
	p.pending = append(p.pending, ev)
	p.events++
	p.mu.Unlock()
}

// loop encodes and publishes what is queued, in batches of MaxBatchEvents at most,
// every FlushInterval (backing off to maxIdlePolls intervals while nothing comes)
// until Close; then it publishes what is left and returns.
func (p *Publisher) loop() {
	defer close(p.loopDone)
	enc := newEncoder(p.opts.VLLM023Events)
	var spare []event
	t := time.NewTimer(p.opts.FlushInterval)
	defer t.Stop()
	backoff := poll.Backoff{Interval: p.opts.FlushInterval, MaxPolls: maxIdlePolls}
	for {
		select {
		case <-t.C:
		case <-p.stop:
		}
		p.mu.Lock()
		taken, closed := p.pending, p.closed
		p.pending = spare
		p.mu.Unlock()
		for rest := taken; len(rest) > 0; {
			n := min(len(rest), p.opts.MaxBatchEvents)
			p.publish(enc, rest[:n])
			rest = rest[n:]
		}
		clear(taken) // let the cache's slices go
		spare = taken[:0]
		if closed {
			return
		}
		t.Reset(backoff.Next(len(taken) > 0))
	}
}

// publish sends one batch under the next sequence number and keeps it for replay.
func (p *Publisher) publish(enc *encoder, events []event) {
	now := p.opts.Now()
	ts := float64(now.Unix()) + float64(now.Nanosecond())/1e9 // as exact as a float64 holds
	payload, err := enc.batch(ts, events, p.opts.DataParallelRank)
	if err != nil {
		// Only an extra key of a type msgpack can not encode gets here.
		p.dropped.Add(int64(len(events)))
		p.logLimit.warn(p.log, "kvevents: batch not encodable, its events dropped", "events", len(events), "err", err)
		return
	}
	seq := uint64(p.batches.Load())
	seqBytes := binary.BigEndian.AppendUint64(nil, seq)
	if p.router != nil { // without a replay socket nothing is kept
		p.replay.add(seq, payload)
	}
	// Counted before the send, so that a subscriber that has the message sees it
	// counted in Stats.
	p.batches.Add(1)
	p.published.Add(int64(len(events)))
	p.pub.Send([][]byte{p.topic, seqBytes, payload})
}

// Stats returns a snapshot of the publisher's counters.
func (p *Publisher) Stats() Stats {
	p.mu.Lock()
	depth, events := len(p.pending), p.events
	p.mu.Unlock()
	n, b, first := p.replay.size()
	refused := p.pub.Refused()
	if p.router != nil {
		refused += p.router.Refused()
	}
	return Stats{
		Events:          events,
		Published:       p.published.Load(),
		Batches:         p.batches.Load(),
		Dropped:         p.dropped.Load(),
		QueueDepth:      depth,
		Subscribers:     p.pub.Subscribers(),
		SubscriberDrops: p.pub.Drops(),
		ReplayBatches:   n,
		ReplayBytes:     b,
		ReplayFirstSeq:  first,
		ReplaysActive:   len(p.slots),
		Replays:         p.replays.Load(),
		ReplaysAborted:  p.aborted.Load(),
		ReplaysRefused:  p.refused.Load(),
		BadRequests:     p.bad.Load(),
		RefusedConns:    refused,
		DialFailures:    p.pub.DialFailures(),
	}
}

// Close publishes what is queued, gives subscribers up to Options.Linger to take it,
// and closes both sockets. Events after Close are dropped (and counted). A second
// Close changes nothing and returns ErrClosed (docs/server.md, "A second Close").
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.closed = true
	p.mu.Unlock()
	close(p.stop)
	<-p.loopDone
	if p.router != nil {
		p.router.Close()
	}
	p.pub.Close(p.opts.Linger)
	return nil
}
