package kvsub

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

// Defaults of Options.
const (
	DefaultTimeout   = 5 * time.Second
	DefaultProbe     = 100 * time.Millisecond
	DefaultMaxFrame  = 64 << 20
	DefaultQueueSize = 1024
)

// Options configure a Subscriber. Zero sizes and durations mean their defaults.
type Options struct {
	Endpoint       string // the PUB socket, tcp://HOST:PORT
	ReplayEndpoint string // the ROUTER replay socket, or "" for none
	Topic          string // the topic prefix subscribed to ("" for every message)
	// CatchUp asks the replay socket, once subscribed, for every message it keeps
	// from sequence number From on: a subscriber that connects late starts from the
	// publisher's first message (From 0) rather than from the next one.
	CatchUp bool
	From    uint64
	// Timeout bounds a connection's handshake and a replay.
	Timeout time.Duration
	// Probe is how long Next waits for a live message before it asks the replay
	// socket for what may have been published meanwhile (a message sent before the
	// subscription took effect is seen by no other way).
	Probe     time.Duration
	MaxFrame  int // largest frame read; a larger message is skipped (ErrMessage)
	QueueSize int // live messages read ahead of Next
	// MaxPublishers bounds the publishers connected to a Listener at once
	// (DefaultMaxPublishers); Dial ignores it.
	MaxPublishers int
}

// Stats is what a Subscriber received.
type Stats struct {
	Live, Replayed int64 // messages received from each socket
	Bytes          int64 // their payload bytes
	Duplicates     int64 // messages seen twice (live and replayed), the second dropped
	Missed         int64 // sequence numbers neither socket delivered
	Replays        int64 // replay requests made
}

// Subscriber reads one publisher's messages in sequence order. Its zero value is not
// usable; call Dial.
type Subscriber struct {
	opts   Options
	sub    *zmtp.Conn
	live   chan liveMsg
	done   chan struct{}
	closed sync.Once
	wg     sync.WaitGroup

	next    uint64 // the sequence number expected next
	started bool
	pending []Batch // replayed, not delivered yet, in order

	live64, replayed, bytes, dups, missed, replays atomic.Int64
}

type liveMsg struct {
	m   zmtp.Msg
	err error
}

// address returns the host:port of a tcp:// endpoint.
// defaults gives the options a Subscriber and a Listener share their defaults where
// they are unset.
func (o *Options) defaults() {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.MaxFrame <= 0 {
		o.MaxFrame = DefaultMaxFrame
	}
	if o.QueueSize <= 0 {
		o.QueueSize = DefaultQueueSize
	}
}

func address(endpoint string) (string, error) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("%w %q: want tcp://HOST:PORT", ErrEndpoint, endpoint)
	}
	if _, _, err := net.SplitHostPort(rest); err != nil {
		return "", fmt.Errorf("%w %q: %w", ErrEndpoint, endpoint, err)
	}
	return rest, nil
}

// Dial connects to o.Endpoint as a SUB, subscribed to o.Topic, and, with o.CatchUp,
// fetches what the replay socket keeps from o.From on. It fails with ErrEndpoint for
// an endpoint it can not parse, and with the network's error for one it can not
// reach.
func Dial(o Options) (*Subscriber, error) {
	o.defaults()
	if o.Probe <= 0 {
		o.Probe = DefaultProbe
	}
	addr, err := address(o.Endpoint)
	if err != nil {
		return nil, err
	}
	if o.ReplayEndpoint != "" {
		if _, err := address(o.ReplayEndpoint); err != nil {
			return nil, err
		}
	} else if o.CatchUp {
		return nil, fmt.Errorf("%w: CatchUp needs a ReplayEndpoint", ErrEndpoint)
	}
	c, err := zmtp.Dial(addr, zmtp.TypeSub, o.limits(), o.Timeout)
	if err != nil {
		return nil, fmt.Errorf("kvsub: %s: %w", o.Endpoint, err)
	}
	if err := c.Subscribe([]byte(o.Topic)); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("kvsub: subscribe: %w", err)
	}
	s := &Subscriber{opts: o, sub: c, live: make(chan liveMsg, o.QueueSize), done: make(chan struct{})}
	s.wg.Add(1)
	go s.read()
	if o.CatchUp {
		s.next, s.started = o.From, true
		if err := s.fill(); err != nil {
			_ = s.Close()
			return nil, err
		}
	}
	return s, nil
}

func (o Options) limits() zmtp.Limits { return zmtp.Limits{MaxFrame: o.MaxFrame, MaxFrames: 4} }

// read moves live messages to s.live until the connection fails or s closes.
func (s *Subscriber) read() {
	defer s.wg.Done()
	for {
		m, err := s.sub.ReadMsg()
		select {
		case s.live <- liveMsg{m, err}:
		case <-s.done:
			return
		}
		if err != nil {
			return
		}
	}
}

// Next returns the next batch in sequence order, waiting for it: a live message, or
// one the replay socket had when the live ones skipped it. A sequence number neither
// socket has is counted in Stats.Missed and reported by an error matching ErrGap,
// returned with the batch after the gap. It returns ErrClosed once s is closed, and
// the connection's error once it fails.
func (s *Subscriber) Next() (Batch, error) {
	timer := time.NewTimer(s.opts.Probe)
	defer timer.Stop()
	for {
		select {
		case <-s.done:
			return Batch{}, ErrClosed
		default:
		}
		if len(s.pending) > 0 {
			b := s.pending[0]
			s.pending = s.pending[1:]
			if b.Seq < s.next {
				s.dups.Add(1)
				continue
			}
			return s.deliver(b)
		}
		select {
		case <-s.done:
			return Batch{}, ErrClosed
		case lm := <-s.live:
			if lm.err != nil {
				return Batch{}, fmt.Errorf("kvsub: %w", lm.err)
			}
			b, err := s.message(lm.m)
			if err != nil {
				return Batch{}, err
			}
			switch {
			case s.started && b.Seq < s.next:
				s.dups.Add(1)
				continue
			case s.started && b.Seq > s.next && s.opts.ReplayEndpoint != "":
				// Missed messages: the replay socket may keep them.
				if err := s.fill(); err != nil {
					return Batch{}, err
				}
				s.pending = append(s.pending, b)
				slices.SortStableFunc(s.pending, func(x, y Batch) int { return cmp.Compare(x.Seq, y.Seq) })
				continue
			}
			s.live64.Add(1)
			return s.deliver(b)
		case <-timer.C:
			timer.Reset(s.opts.Probe)
			if s.started && s.opts.ReplayEndpoint != "" {
				if err := s.fill(); err != nil {
					return Batch{}, err
				}
			}
		}
	}
}

// deliver returns b, counting a gap before it.
func (s *Subscriber) deliver(b Batch) (Batch, error) {
	var err error
	if s.started && b.Seq > s.next {
		s.missed.Add(int64(b.Seq - s.next))
		err = fmt.Errorf("%w: %d to %d", ErrGap, s.next, b.Seq-1)
	}
	s.started, s.next = true, b.Seq+1
	return b, err
}

// message decodes a live message: topic, sequence number, payload.
func (s *Subscriber) message(m zmtp.Msg) (Batch, error) {
	if m.Oversized || len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		return Batch{}, fmt.Errorf("%w: %d frames", ErrMessage, len(m.Frames))
	}
	b, err := Decode(m.Frames[2])
	if err != nil {
		return Batch{}, err
	}
	b.Seq = binary.BigEndian.Uint64(m.Frames[1])
	s.bytes.Add(int64(len(m.Frames[2])))
	return b, nil
}

// fill asks the replay socket for every message from s.next on and queues those
// not queued yet.
func (s *Subscriber) fill() error {
	from := s.next
	if n := len(s.pending); n > 0 {
		from = max(from, s.pending[n-1].Seq+1)
	}
	got, size, err := Replay(s.opts.ReplayEndpoint, from, s.opts)
	if err != nil {
		return err
	}
	s.replays.Add(1)
	s.bytes.Add(size)
	s.replayed.Add(int64(len(got)))
	s.pending = append(s.pending, got...)
	return nil
}

// Replay asks the replay socket at endpoint for every message it keeps from
// sequence number from on, and returns them in order, with their payloads' bytes,
// once its end marker came. A reply of another shape fails with ErrMessage; no end
// marker within o.Timeout fails (the connection is closed under the read).
func Replay(endpoint string, from uint64, o Options) ([]Batch, int64, error) {
	addr, err := address(endpoint)
	if err != nil {
		return nil, 0, err
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.MaxFrame <= 0 {
		o.MaxFrame = DefaultMaxFrame
	}
	c, err := zmtp.Dial(addr, zmtp.TypeDealer, o.limits(), o.Timeout)
	if err != nil {
		return nil, 0, fmt.Errorf("kvsub: replay %s: %w", endpoint, err)
	}
	timer := time.AfterFunc(o.Timeout, func() { _ = c.Close() })
	defer timer.Stop()
	defer c.Close()
	if err := c.WriteMsg([][]byte{{}, binary.BigEndian.AppendUint64(nil, from)}, time.Now().Add(o.Timeout)); err != nil {
		return nil, 0, fmt.Errorf("kvsub: replay request: %w", err)
	}
	var out []Batch
	var size int64
	for {
		m, err := c.ReadMsg()
		if err != nil {
			return nil, 0, fmt.Errorf("kvsub: replay: %w", err)
		}
		if m.Command != "" {
			continue
		}
		if m.Oversized || len(m.Frames) != 3 || len(m.Frames[0]) != 0 || len(m.Frames[1]) != 8 {
			return nil, 0, fmt.Errorf("%w: a replay reply of %d frames", ErrMessage, len(m.Frames))
		}
		seq := binary.BigEndian.Uint64(m.Frames[1])
		if int64(seq) == -1 {
			return out, size, nil
		}
		b, err := Decode(m.Frames[2])
		if err != nil {
			return nil, 0, err
		}
		b.Seq = seq
		out = append(out, b)
		size += int64(len(m.Frames[2]))
	}
}

// Stats returns what s received so far.
func (s *Subscriber) Stats() Stats {
	return Stats{Live: s.live64.Load(), Replayed: s.replayed.Load(), Bytes: s.bytes.Load(),
		Duplicates: s.dups.Load(), Missed: s.missed.Load(), Replays: s.replays.Load()}
}

// Close disconnects s; a Next waiting returns ErrClosed. A second Close changes
// nothing and returns ErrClosed (docs/server.md, "A second Close").
func (s *Subscriber) Close() error {
	err := ErrClosed
	s.closed.Do(func() {
		close(s.done)
		err = s.sub.Close()
		s.wg.Wait()
		if errors.Is(err, net.ErrClosed) {
			err = nil
		}
	})
	return err
}
