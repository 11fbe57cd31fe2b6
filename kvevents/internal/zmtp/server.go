package zmtp

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// ServerOptions bound a listening socket's peers.
type ServerOptions struct {
	MaxPeers         int           // most connections at once, handshaking ones included; more are closed at once
	HandshakeTimeout time.Duration // a peer that has not finished its handshake by then is closed
	Limits           Limits        // what is read from each peer
}

// Redial is how a socket that connects out (rather than listens) waits between
// tries: Min after a failed or lost connection, doubling up to Max.
type Redial struct {
	Min, Max time.Duration
}

// server accepts connections on a listener, handshakes each in its own goroutine and
// hands it to serve, which runs until the peer goes or the server closes. Or,
// without a listener, it dials one address, hands the connection to serve in the
// same way, and dials again, after a bounded back-off, when it fails or is lost.
type server struct {
	ln    net.Listener // nil when dialling
	addr  string       // the address dialled
	typ   string
	opts  ServerOptions
	serve func(*Conn)

	ctx    context.Context // done once stopAccepting is called: a dial under way gives up
	cancel context.CancelFunc

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	refused atomic.Int64 // connections closed for the peer limit or a failed handshake
	failed  atomic.Int64 // dials that failed, or whose handshake did (dialling only)
}

func checkServerOptions(opts ServerOptions) {
	if opts.MaxPeers <= 0 || opts.HandshakeTimeout <= 0 || opts.Limits.MaxFrame <= 0 || opts.Limits.MaxFrames <= 0 {
		panic("zmtp: ServerOptions must all be positive")
	}
}

func newServer(ln net.Listener, typ string, opts ServerOptions, serve func(*Conn)) *server {
	checkServerOptions(opts)
	s := &server{ln: ln, typ: typ, opts: opts, serve: serve, conns: make(map[net.Conn]struct{})}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	return s
}

// newDialer returns a server that dials addr (host:port, a host name looked up at
// each dial) rather than listening: one connection at a time, each dial and
// handshake bounded by opts.HandshakeTimeout, the next try r.Min after a failure
// or a loss, doubling up to r.Max, and r.Min again once a handshake succeeds.
func newDialer(addr string, typ string, opts ServerOptions, r Redial, serve func(*Conn)) *server {
	checkServerOptions(opts)
	if r.Min <= 0 || r.Max < r.Min {
		panic("zmtp: Redial must have 0 < Min <= Max")
	}
	s := &server{addr: addr, typ: typ, opts: opts, serve: serve, conns: make(map[net.Conn]struct{})}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.redial(r)
	return s
}

func (s *server) redial(r Redial) {
	defer s.wg.Done()
	d := net.Dialer{Timeout: s.opts.HandshakeTimeout}
	wait := r.Min
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		nc, err := d.DialContext(s.ctx, "tcp", s.addr)
		if err == nil {
			s.mu.Lock()
			if s.closed {
				s.mu.Unlock()
				_ = nc.Close()
				return
			}
			s.conns[nc] = struct{}{}
			s.mu.Unlock()
			if s.handle(nc) {
				wait = r.Min // it was up: start the back-off over
			}
		} else {
			s.failed.Add(1)
		}
		t.Reset(wait)
		if wait > r.Max/2 { // doubled up to Max, never past it by overflow
			wait = r.Max
		} else {
			wait *= 2
		}
	}
}

func (s *server) accept() {
	defer s.wg.Done()
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors and the like: wait a little rather than spin.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		s.mu.Lock()
		if s.closed || len(s.conns) >= s.opts.MaxPeers {
			s.mu.Unlock()
			s.refused.Add(1)
			_ = nc.Close()
			continue
		}
		s.conns[nc] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.handle(nc)
		}()
	}
}

// handle handshakes nc (registered in s.conns), serves it until it goes, and
// returns whether its handshake succeeded.
func (s *server) handle(nc net.Conn) bool {
	defer func() {
		_ = nc.Close()
		s.mu.Lock()
		delete(s.conns, nc)
		s.mu.Unlock()
	}()
	c, err := Handshake(nc, s.typ, s.opts.Limits, time.Now().Add(s.opts.HandshakeTimeout))
	if err != nil {
		if s.ln == nil {
			s.failed.Add(1)
		} else {
			s.refused.Add(1)
		}
		return false
	}
	s.serve(c)
	return true
}

// stopAccepting closes the listener, or stops dialling: no new peer comes in.
func (s *server) stopAccepting() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	if s.ln != nil {
		_ = s.ln.Close()
	}
}

// close closes the listener and every connection, and waits for their goroutines.
func (s *server) close() {
	s.stopAccepting()
	s.mu.Lock()
	for nc := range s.conns {
		_ = nc.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// Addr returns the listener's address, or nil for a dialling server.
func (s *server) Addr() net.Addr {
	if s.ln == nil {
		return nil
	}
	return s.ln.Addr()
}
