// Package zmtp speaks ZMTP 3.0 (https://rfc.zeromq.org/spec/23/, NULL security) on a
// TCP connection: the greeting, the READY handshake, and framed multipart messages.
// It holds the sockets kvevents needs, PUB (listening, or dialling a SUB that
// listens) and ROUTER, and the two dialling ones its tests and kvsub need, SUB and
// DEALER. It is not a general ZeroMQ.
//
// Every limit a peer could push against is explicit: a handshake deadline, a largest
// frame and a most frames per message read from a peer (larger ones are skipped, not
// buffered), a most peers per socket, and a bounded queue per subscriber whose
// overflow is dropped and counted, so a peer can not make this process grow or stall.
package zmtp

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// Socket types, as their READY command names them.
const (
	TypePub    = "PUB"
	TypeSub    = "SUB"
	TypeXSub   = "XSUB"
	TypeRouter = "ROUTER"
	TypeDealer = "DEALER"
	TypeReq    = "REQ"
)

// Frame flags (RFC 23, section "Framing").
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

const greetingLen = 64

// ErrProtocol is matched by every error a peer's bytes cause: a bad greeting, a
// mechanism other than NULL, a handshake other than READY, an incompatible socket type.
var ErrProtocol = errors.New("zmtp: protocol error")

// Limits bound what is read from a peer.
type Limits struct {
	MaxFrame  int // largest frame body kept; a larger one is skipped and the message marked Oversized
	MaxFrames int // most frames kept per message; further ones are skipped the same way
}

// Msg is one message or command read from a peer.
type Msg struct {
	Command   string   // the command's name, or "" for a message
	Body      []byte   // a command's data
	Frames    [][]byte // a message's frames, at most Limits.MaxFrames of them
	Oversized bool     // a frame or frames were skipped: the message is not whole
}

// Conn is one ZMTP connection after its handshake. Reads must come from one
// goroutine; writes may come from any (they are serialised).
type Conn struct {
	nc       net.Conn
	br       *bufio.Reader
	lim      Limits
	PeerType string            // the peer's Socket-Type
	PeerMeta map[string]string // every property of the peer's READY

	wmu sync.Mutex
	bw  *bufio.Writer
	hdr [9]byte
}

// compatible says which peer socket types may talk to a socket of type t (RFC 23).
func compatible(t, peer string) bool {
	switch t {
	case TypePub:
		return peer == TypeSub || peer == TypeXSub
	case TypeSub:
		return peer == TypePub || peer == "XPUB"
	case TypeRouter:
		return peer == TypeDealer || peer == TypeReq || peer == TypeRouter
	case TypeDealer:
		return peer == TypeRouter || peer == TypeDealer || peer == "REP"
	}
	return false
}

// Handshake returns a Conn once nc has exchanged greetings and READY commands as a
// socket of type sockType, all before deadline. On an error nc is left open for the
// caller to close.
func Handshake(nc net.Conn, sockType string, lim Limits, deadline time.Time) (*Conn, error) {
	if err := nc.SetDeadline(deadline); err != nil {
		return nil, err
	}
	c := &Conn{
		nc:  nc,
		br:  bufio.NewReaderSize(nc, 4096),
		bw:  bufio.NewWriterSize(nc, 64<<10),
		lim: lim,
	}
	// NB: libzmq sends its greeting in two parts (signature, then the rest once it has
	// seen ours); sending all 64 bytes at once is allowed and what it then reads.
	var g [greetingLen]byte
	g[0] = 0xff
	g[8] = 1 // padding: libzmq writes identity length + 1 here for ZMTP 1.0 peers
	g[9] = 0x7f
	g[10], g[11] = 3, 0
	copy(g[12:32], "NULL")
	if _, err := c.bw.Write(g[:]); err != nil {
		return nil, err
	}
	if err := c.bw.Flush(); err != nil {
		return nil, err
	}
	var pg [greetingLen]byte
	if _, err := io.ReadFull(c.br, pg[:]); err != nil {
		return nil, fmt.Errorf("zmtp: reading the greeting: %w", err)
	}
	if pg[0] != 0xff || pg[9]&1 != 1 {
		return nil, fmt.Errorf("%w: not a ZMTP 3 greeting", ErrProtocol)
	}
	if pg[10] < 3 {
		return nil, fmt.Errorf("%w: peer speaks ZMTP %d.%d, not 3", ErrProtocol, pg[10], pg[11])
	}
	if mech := string(bytes.TrimRight(pg[12:32], "\x00")); mech != "NULL" {
		return nil, fmt.Errorf("%w: mechanism %q, not NULL", ErrProtocol, mech)
	}
	props := [][2]string{{"Socket-Type", sockType}}
	if sockType == TypeRouter || sockType == TypeDealer || sockType == TypeReq {
		props = append(props, [2]string{"Identity", ""})
	}
	if err := c.writeCommand("READY", encodeProps(props)); err != nil {
		return nil, err
	}
	m, err := c.readCommandOnly()
	if err != nil {
		return nil, err
	}
	if m.Command != "READY" {
		return nil, fmt.Errorf("%w: %s instead of READY", ErrProtocol, m.Command)
	}
	if c.PeerMeta, err = decodeProps(m.Body); err != nil {
		return nil, err
	}
	c.PeerType = c.PeerMeta["Socket-Type"]
	if !compatible(sockType, c.PeerType) {
		_ = c.writeCommand("ERROR", append([]byte{byte(len("invalid socket type"))}, "invalid socket type"...))
		return nil, fmt.Errorf("%w: a %s peer can not talk to %s", ErrProtocol, c.PeerType, sockType)
	}
	if err := nc.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	return c, nil
}

// handshakeMaxFrame bounds the peer's READY, whatever the Limits on what follows.
const handshakeMaxFrame = 4096

// readCommandOnly reads the handshake's command, refusing a message in its place.
func (c *Conn) readCommandOnly() (Msg, error) {
	lim := c.lim
	c.lim = Limits{MaxFrame: handshakeMaxFrame, MaxFrames: 1}
	m, err := c.ReadMsg()
	c.lim = lim
	if err != nil {
		return m, err
	}
	if m.Command == "" {
		return m, fmt.Errorf("%w: a message before READY", ErrProtocol)
	}
	return m, nil
}

func encodeProps(props [][2]string) []byte {
	var b []byte
	for _, p := range props {
		b = append(b, byte(len(p[0])))
		b = append(b, p[0]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(p[1])))
		b = append(b, p[1]...)
	}
	return b
}

func decodeProps(b []byte) (map[string]string, error) {
	meta := make(map[string]string)
	for len(b) > 0 {
		n := int(b[0])
		if len(b) < 1+n+4 {
			return nil, fmt.Errorf("%w: truncated property", ErrProtocol)
		}
		name := string(b[1 : 1+n])
		b = b[1+n:]
		vn := binary.BigEndian.Uint32(b)
		b = b[4:]
		if uint64(vn) > uint64(len(b)) {
			return nil, fmt.Errorf("%w: truncated property %q", ErrProtocol, name)
		}
		meta[name] = string(b[:vn])
		b = b[vn:]
	}
	return meta, nil
}

// readFrame reads one frame: its flags, and its body if it is at most max bytes
// (a larger body is skipped and body is nil with skipped true).
func (c *Conn) readFrame(max int) (flags byte, body []byte, skipped bool, err error) {
	if flags, err = c.br.ReadByte(); err != nil {
		return 0, nil, false, err
	}
	var size uint64
	if flags&flagLong != 0 {
		var b [8]byte
		if _, err = io.ReadFull(c.br, b[:]); err != nil {
			return 0, nil, false, err
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		s, err := c.br.ReadByte()
		if err != nil {
			return 0, nil, false, err
		}
		size = uint64(s)
	}
	if size > uint64(max) {
		// NB: a peer may send a frame as long as it likes; it costs it the bandwidth,
		// and this process no memory.
		if size > 1<<62 {
			return 0, nil, false, fmt.Errorf("%w: frame of %d bytes", ErrProtocol, size)
		}
		if _, err = io.CopyN(io.Discard, c.br, int64(size)); err != nil {
			return 0, nil, false, err
		}
		return flags, nil, true, nil
	}
	body = make([]byte, size)
	if _, err = io.ReadFull(c.br, body); err != nil {
		return 0, nil, false, err
	}
	return flags, body, false, nil
}

// ReadMsg returns the next message or command from the peer. A command's body, like
// a message's frames, is kept only within the Limits; a PING is answered with a PONG
// here and also returned.
func (c *Conn) ReadMsg() (Msg, error) {
	var m Msg
	for {
		flags, body, skipped, err := c.readFrame(c.lim.MaxFrame)
		if err != nil {
			return Msg{}, err
		}
		if flags&flagCommand != 0 {
			if len(m.Frames) > 0 || m.Oversized {
				return Msg{}, fmt.Errorf("%w: a command inside a message", ErrProtocol)
			}
			if skipped {
				return Msg{Command: "?", Oversized: true}, nil
			}
			if len(body) < 1 || len(body) < 1+int(body[0]) {
				return Msg{}, fmt.Errorf("%w: truncated command", ErrProtocol)
			}
			n := int(body[0])
			m.Command, m.Body = string(body[1:1+n]), body[1+n:]
			if m.Command == "PING" {
				if err := c.pong(m.Body); err != nil {
					return Msg{}, err
				}
			}
			return m, nil
		}
		switch {
		case skipped || len(m.Frames) >= c.lim.MaxFrames:
			m.Oversized = true
		default:
			m.Frames = append(m.Frames, body)
		}
		if flags&flagMore == 0 {
			return m, nil
		}
	}
}

// pong answers a PING (ZMTP 3.1) with its context.
func (c *Conn) pong(ping []byte) error {
	if len(ping) < 2 {
		return fmt.Errorf("%w: truncated PING", ErrProtocol)
	}
	ctx := ping[2:]
	if len(ctx) > 16 {
		ctx = ctx[:16]
	}
	return c.writeCommand("PONG", ctx)
}

func (c *Conn) writeCommand(name string, data []byte) error {
	body := make([]byte, 0, 1+len(name)+len(data))
	body = append(body, byte(len(name)))
	body = append(body, name...)
	body = append(body, data...)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.writeFrameLocked(flagCommand, body); err != nil {
		return err
	}
	return c.bw.Flush()
}

func (c *Conn) writeFrameLocked(flags byte, body []byte) error {
	h := c.hdr[:0]
	if len(body) > 255 {
		h = append(h, flags|flagLong)
		h = binary.BigEndian.AppendUint64(h, uint64(len(body)))
	} else {
		h = append(h, flags, byte(len(body)))
	}
	if _, err := c.bw.Write(h); err != nil {
		return err
	}
	_, err := c.bw.Write(body)
	return err
}

// WriteMsg sends frames as one message. With a non-zero deadline, a write that has not
// finished by then fails (and the connection is then unusable).
func (c *Conn) WriteMsg(frames [][]byte, deadline time.Time) error {
	if len(frames) == 0 {
		panic("zmtp: WriteMsg of no frames")
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if !deadline.IsZero() {
		if err := c.nc.SetWriteDeadline(deadline); err != nil {
			return err
		}
	}
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		if err := c.writeFrameLocked(flags, f); err != nil {
			return err
		}
	}
	return c.bw.Flush()
}

// Close closes the connection; a blocked read or write returns.
func (c *Conn) Close() error { return c.nc.Close() }

// RemoteAddr returns the peer's address.
func (c *Conn) RemoteAddr() net.Addr { return c.nc.RemoteAddr() }
