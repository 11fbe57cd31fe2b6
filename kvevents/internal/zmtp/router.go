package zmtp

import (
	"net"
	"time"
)

// Router is a ROUTER socket on a listener, reduced to what a request-reply service
// needs: each peer's messages go to a handler, in that peer's goroutine, with the
// Conn to answer on. (A ROUTER's identity frame never crosses the wire: the
// connection is the identity.)
type Router struct {
	srv *server
}

// NewRouter returns a ROUTER socket serving ln; it owns ln from now on. handle is
// called for each message a peer sends, one at a time per peer; while it runs, that
// peer's further requests wait.
func NewRouter(ln net.Listener, opts ServerOptions, handle func(c *Conn, m Msg)) *Router {
	r := &Router{}
	r.srv = newServer(ln, TypeRouter, opts, func(c *Conn) {
		for {
			m, err := c.ReadMsg()
			if err != nil {
				return
			}
			if m.Command != "" {
				continue // PING (answered by ReadMsg), PONG, unknown commands
			}
			handle(c, m)
		}
	})
	return r
}

// Addr returns the address the socket listens on.
func (r *Router) Addr() net.Addr { return r.srv.Addr() }

// Refused returns how many connections were closed for the peer limit or a failed
// handshake, in all.
func (r *Router) Refused() int64 { return r.srv.refused.Load() }

// Close stops accepting, closes every connection and waits for its goroutine.
func (r *Router) Close() { r.srv.close() }

// Dial connects to a listening socket as a socket of type sockType (SUB or DEALER, in
// tests) and returns the Conn after its handshake.
func Dial(addr string, sockType string, lim Limits, timeout time.Duration) (*Conn, error) {
	nc, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, err
	}
	c, err := Handshake(nc, sockType, lim, time.Now().Add(timeout))
	if err != nil {
		_ = nc.Close()
		return nil, err
	}
	return c, nil
}

// Subscribe sends a ZMTP 3.0 subscription to prefix (a SUB's side).
func (c *Conn) Subscribe(prefix []byte) error {
	return c.WriteMsg([][]byte{append([]byte{1}, prefix...)}, time.Time{})
}
