package zmtp

import (
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

// server accepts connections on a listener, handshakes each in its own goroutine and
// hands it to serve, which runs until the peer goes or the server closes.
type server struct {
	ln    net.Listener
	typ   string
	opts  ServerOptions
	serve func(*Conn)

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	refused atomic.Int64 // connections closed for the peer limit or a failed handshake
}

func newServer(ln net.Listener, typ string, opts ServerOptions, serve func(*Conn)) *server {
	if opts.MaxPeers <= 0 || opts.HandshakeTimeout <= 0 || opts.Limits.MaxFrame <= 0 || opts.Limits.MaxFrames <= 0 {
		panic("zmtp: ServerOptions must all be positive")
	}
	s := &server{ln: ln, typ: typ, opts: opts, serve: serve, conns: make(map[net.Conn]struct{})}
	s.wg.Add(1)
	go s.accept()
	return s
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
		go s.handle(nc)
	}
}

func (s *server) handle(nc net.Conn) {
	defer s.wg.Done()
	defer func() {
		_ = nc.Close()
		s.mu.Lock()
		delete(s.conns, nc)
		s.mu.Unlock()
	}()
	c, err := Handshake(nc, s.typ, s.opts.Limits, time.Now().Add(s.opts.HandshakeTimeout))
	if err != nil {
		s.refused.Add(1)
		return
	}
	s.serve(c)
}

// stopAccepting closes the listener: no new peer comes in.
func (s *server) stopAccepting() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	_ = s.ln.Close()
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

// Addr returns the listener's address.
func (s *server) Addr() net.Addr { return s.ln.Addr() }
