package kvsub

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

// DefaultMaxPublishers bounds the publishers connected to a Listener at once.
const DefaultMaxPublishers = 256

// Message is one batch a Listener read, with the topic it came under (which names
// its publisher, as kv@<pod>@<model> does for llm-d).
type Message struct {
	Topic string
	Batch
}

// Listener is a SUB socket that binds, which publishers connect to (llm-d's
// "global socket"; a kvevents.Publisher with Options.Connect): it reads every
// connected publisher's batches, in the order they come. It keeps the next sequence
// number of each topic and reports a gap, but fills none: a replay socket belongs
// to one publisher (use Replay with its endpoint).
type Listener struct {
	ln    net.Listener
	opts  Options
	msgs  chan listenMsg
	done  chan struct{}
	close sync.Once
	wg    sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{}

	next map[string]uint64 // per topic, the sequence number expected next (Next's goroutine only)

	received, bytes, missed, refused atomic.Int64
}

type listenMsg struct {
	topic string
	m     zmtp.Msg
}

// Listen binds o.Endpoint (tcp://HOST:PORT, an IP address or a host name of this
// machine; PORT 0 for one the system picks) as a SUB subscribed to o.Topic, for
// publishers to connect to; at most o.MaxPublishers at once, each closed unless its
// handshake ends within o.Timeout. It fails with ErrEndpoint for an endpoint it can
// not parse, and with the system's error for one it can not bind. CatchUp and
// ReplayEndpoint do not apply.
func Listen(o Options) (*Listener, error) {
	o.defaults()
	if o.MaxPublishers <= 0 {
		o.MaxPublishers = DefaultMaxPublishers
	}
	addr, err := address(o.Endpoint)
	if err != nil {
		return nil, err
	}
	if o.CatchUp || o.ReplayEndpoint != "" {
		return nil, fmt.Errorf("%w: a Listener reads many publishers and replays none (CatchUp, ReplayEndpoint)", ErrEndpoint)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("kvsub: %s: %w", o.Endpoint, err)
	}
	l := &Listener{ln: ln, opts: o, msgs: make(chan listenMsg, o.QueueSize), done: make(chan struct{}),
		conns: make(map[net.Conn]struct{}), next: make(map[string]uint64)}
	l.wg.Add(1)
	go l.accept()
	return l, nil
}

// Endpoint returns the endpoint bound, with the port the system picked.
func (l *Listener) Endpoint() string { return "tcp://" + l.ln.Addr().String() }

func (l *Listener) accept() {
	defer l.wg.Done()
	for {
		nc, err := l.ln.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // out of descriptors and the like
			continue
		}
		l.mu.Lock()
		if len(l.conns) >= l.opts.MaxPublishers {
			l.mu.Unlock()
			l.refused.Add(1)
			_ = nc.Close()
			continue
		}
		l.conns[nc] = struct{}{}
		l.wg.Add(1)
		l.mu.Unlock()
		go l.read(nc)
	}
}

// read handshakes with one publisher, subscribes, and passes its messages to Next
// until it goes or l closes.
func (l *Listener) read(nc net.Conn) {
	defer l.wg.Done()
	defer func() {
		_ = nc.Close()
		l.mu.Lock()
		delete(l.conns, nc)
		l.mu.Unlock()
	}()
	c, err := zmtp.Handshake(nc, zmtp.TypeSub, l.opts.limits(), time.Now().Add(l.opts.Timeout))
	if err != nil {
		l.refused.Add(1)
		return
	}
	if err := c.Subscribe([]byte(l.opts.Topic)); err != nil {
		return
	}
	for {
		m, err := c.ReadMsg()
		if err != nil {
			return
		}
		if m.Command != "" {
			continue // PING (answered by ReadMsg), PONG, unknown commands
		}
		topic := ""
		if len(m.Frames) > 0 {
			topic = string(m.Frames[0])
		}
		select {
		case l.msgs <- listenMsg{topic, m}: // a full queue holds this publisher back; its own queue then drops
		case <-l.done:
			return
		}
	}
}

// Next returns the next message any publisher sent, waiting for it. A message that
// is not topic, sequence number and payload fails with ErrMessage, a payload that is
// not a batch with ErrPayload; the Listener goes on. A sequence number past the one
// its topic expected is counted in Stats.Missed and reported by an error matching
// ErrGap, returned with the message. It returns ErrClosed once l is closed.
func (l *Listener) Next() (Message, error) {
	select {
	case <-l.done:
		return Message{}, ErrClosed
	case lm := <-l.msgs:
		m := lm.m
		if m.Oversized || len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
			return Message{}, fmt.Errorf("%w: %d frames", ErrMessage, len(m.Frames))
		}
		b, err := Decode(m.Frames[2])
		if err != nil {
			return Message{}, err
		}
		b.Seq = binary.BigEndian.Uint64(m.Frames[1])
		l.received.Add(1)
		l.bytes.Add(int64(len(m.Frames[2])))
		next, seen := l.next[lm.topic]
		l.next[lm.topic] = b.Seq + 1
		if seen && b.Seq > next {
			l.missed.Add(int64(b.Seq - next))
			return Message{lm.topic, b}, fmt.Errorf("%w: %s %d to %d", ErrGap, lm.topic, next, b.Seq-1)
		}
		return Message{lm.topic, b}, nil
	}
}

// ListenStats is what a Listener received.
type ListenStats struct {
	Live       int64 // messages received
	Bytes      int64 // their payload bytes
	Missed     int64 // sequence numbers skipped within a topic
	Publishers int   // connected now
	Refused    int64 // connections closed for MaxPublishers or a failed handshake, in all
}

// Stats returns what l received so far.
func (l *Listener) Stats() ListenStats {
	l.mu.Lock()
	n := len(l.conns)
	l.mu.Unlock()
	return ListenStats{Live: l.received.Load(), Bytes: l.bytes.Load(), Missed: l.missed.Load(), Publishers: n, Refused: l.refused.Load()}
}

// Close stops listening and disconnects every publisher; a Next waiting returns
// ErrClosed. A second Close changes nothing and returns ErrClosed (docs/server.md,
// "A second Close").
func (l *Listener) Close() error {
	err := ErrClosed
	l.close.Do(func() {
		close(l.done)
		err = l.ln.Close()
		l.mu.Lock()
		for nc := range l.conns {
			_ = nc.Close()
		}
		l.mu.Unlock()
		l.wg.Wait()
	})
	return err
}
