package zmtp

import (
	"bytes"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// PubOptions configure a PUB socket.
type PubOptions struct {
	ServerOptions
	QueueLen         int // messages queued per subscriber; a message that finds it full is dropped for that subscriber
	MaxSubscriptions int // distinct topic prefixes per subscriber; a subscriber that asks for more is closed
}

// Pub is a PUB socket on a listener (or dialling one SUB): every message goes to every subscriber whose
// subscriptions match its first frame, through a bounded queue per subscriber, so a
// subscriber that stalls loses messages (counted in Drops) and holds up no one.
type Pub struct {
	srv  *server
	opts PubOptions

	mu      sync.Mutex
	peers   map[*pubPeer]struct{}
	closing bool

	drops atomic.Int64
	sent  atomic.Int64
}

type pubPeer struct {
	c    *Conn
	q    chan [][]byte
	done chan struct{} // closed when the writer has returned

	smu  sync.Mutex
	subs map[string]int // prefix -> times subscribed
}

// NewPub returns a PUB socket serving ln; it owns ln from now on.
func NewPub(ln net.Listener, opts PubOptions) *Pub {
	if opts.QueueLen <= 0 || opts.MaxSubscriptions <= 0 {
		panic("zmtp: PubOptions must all be positive")
	}
	p := &Pub{opts: opts, peers: make(map[*pubPeer]struct{})}
	p.srv = newServer(ln, TypePub, opts.ServerOptions, p.serve)
	return p
}

// NewPubDialer returns a PUB socket that connects to addr (host:port), where a SUB
// listens, rather than listening itself: it dials, serves the connection as it
// serves an accepted subscriber, and dials again with back-off r when the dial,
// the handshake or the connection fails. Messages sent while it is not connected
// and subscribed reach no one, as with libzmq's PUB.
func NewPubDialer(addr string, opts PubOptions, r Redial) *Pub {
	if opts.QueueLen <= 0 || opts.MaxSubscriptions <= 0 {
		panic("zmtp: PubOptions must all be positive")
	}
	p := &Pub{opts: opts, peers: make(map[*pubPeer]struct{})}
	p.srv = newDialer(addr, TypePub, opts.ServerOptions, r, p.serve)
	return p
}

// Addr returns the address the socket listens on, or nil for one that dials.
func (p *Pub) Addr() net.Addr { return p.srv.Addr() }

// DialFailures returns how many dials, or handshakes after one, failed, in all (a
// socket that dials only).
func (p *Pub) DialFailures() int64 { return p.srv.failed.Load() }

// Subscribers returns how many subscribers are connected now.
func (p *Pub) Subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.peers)
}

// Subscribed returns how many connected subscribers have at least one subscription.
func (p *Pub) Subscribed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for pp := range p.peers {
		pp.smu.Lock()
		if len(pp.subs) > 0 {
			n++
		}
		pp.smu.Unlock()
	}
	return n
}

// Drops returns how many times a message was not queued to a subscriber, its queue
// being full, in all.
func (p *Pub) Drops() int64 { return p.drops.Load() }

// Sent returns how many messages subscribers' queues took, in all.
func (p *Pub) Sent() int64 { return p.sent.Load() }

// Refused returns how many connections were closed for the peer limit or a failed
// handshake, in all.
func (p *Pub) Refused() int64 { return p.srv.refused.Load() }

// Send queues frames to every matching subscriber and returns at once. The frames
// must not be changed afterwards: subscribers' queues share them.
func (p *Pub) Send(frames [][]byte) {
	if len(frames) == 0 {
		panic("zmtp: Send of no frames")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for peer := range p.peers {
		if !peer.subscribed(frames[0]) {
			continue
		}
		select {
		case peer.q <- frames:
			p.sent.Add(1)
		default:
			p.drops.Add(1)
		}
	}
}

func (pp *pubPeer) subscribed(topic []byte) bool {
	pp.smu.Lock()
	defer pp.smu.Unlock()
	for prefix := range pp.subs {
		if bytes.HasPrefix(topic, []byte(prefix)) {
			return true
		}
	}
	return false
}

// subscribe applies one subscription (on) or cancellation; it returns false when
// the subscriber asks for more prefixes than allowed.
func (pp *pubPeer) subscribe(prefix []byte, on bool, max int) bool {
	pp.smu.Lock()
	defer pp.smu.Unlock()
	k := string(prefix)
	switch {
	case on && pp.subs[k] == 0 && len(pp.subs) >= max:
		return false
	case on:
		pp.subs[k]++
	case pp.subs[k] > 1:
		pp.subs[k]--
	default:
		delete(pp.subs, k)
	}
	return true
}

func (p *Pub) serve(c *Conn) {
	pp := &pubPeer{
		c:    c,
		q:    make(chan [][]byte, p.opts.QueueLen),
		done: make(chan struct{}),
		subs: make(map[string]int),
	}
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return
	}
	p.peers[pp] = struct{}{}
	p.mu.Unlock()
	go pp.write()
	defer func() {
		p.drop(pp)
		_ = c.Close() // ends a writer blocked on a peer that does not read
		<-pp.done
	}()
	for {
		m, err := c.ReadMsg()
		if err != nil {
			return
		}
		var prefix []byte
		var on bool
		switch {
		case m.Oversized:
			continue // a topic longer than MaxFrame: no message will match it
		case m.Command == "SUBSCRIBE" || m.Command == "CANCEL": // ZMTP 3.1
			prefix, on = m.Body, m.Command == "SUBSCRIBE"
		case m.Command != "":
			continue // PING (answered by ReadMsg), PONG and unknown commands
		case len(m.Frames) == 1 && len(m.Frames[0]) > 0 && m.Frames[0][0] <= 1: // ZMTP 3.0
			prefix, on = m.Frames[0][1:], m.Frames[0][0] == 1
		default:
			continue // a PUB drops what else a subscriber sends
		}
		if !pp.subscribe(prefix, on, p.opts.MaxSubscriptions) {
			return
		}
	}
}

// drop removes a subscriber; its writer finishes what is queued and returns.
func (p *Pub) drop(pp *pubPeer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.peers[pp]; ok {
		delete(p.peers, pp)
		close(pp.q)
	}
}

func (pp *pubPeer) write() {
	defer close(pp.done)
	for frames := range pp.q {
		if err := pp.c.WriteMsg(frames, time.Time{}); err != nil {
			_ = pp.c.Close()
			for range pp.q { // until drop closes it
			}
			return
		}
	}
}

// Close stops accepting subscribers, gives each connected one up to linger to take
// what is queued for it, then closes every connection and waits for its goroutines.
func (p *Pub) Close(linger time.Duration) {
	p.srv.stopAccepting()
	p.mu.Lock()
	p.closing = true
	peers := make([]*pubPeer, 0, len(p.peers))
	for pp := range p.peers {
		peers = append(peers, pp)
		delete(p.peers, pp)
		close(pp.q)
	}
	p.mu.Unlock()
	deadline := time.NewTimer(linger)
	defer deadline.Stop()
	for _, pp := range peers {
		select {
		case <-pp.done:
		case <-deadline.C:
		}
	}
	p.srv.close()
}
