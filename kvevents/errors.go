package kvevents

import "errors"

// Errors of New.
var (
	// ErrEndpoint is matched by the error for an endpoint New can not serve: not
	// tcp://HOST:PORT, a HOST that is not an IP address, "*", "localhost" or an
	// interface's name (for Connect: not an IP address or a host name), or a PORT
	// out of range.
	ErrEndpoint = errors.New("kvevents: bad endpoint")
	// ErrListen is matched by the error for an endpoint that could not be bound (a
	// port in use, an address not of this host); it also matches the system's error,
	// such as syscall.EADDRINUSE.
	ErrListen = errors.New("kvevents: can not listen")
	// ErrOptions is matched by the error for a negative size, count or duration in
	// Options, one past its bound (MaxMaxReplays and the like), a publish and
	// replay endpoint that are the same, both Endpoint and Connect set, or a
	// MaxReconnect below ReconnectInterval.
	ErrOptions = errors.New("kvevents: bad options")
)

// Errors of Close.
var (
	// ErrClosed is returned by a second Close.
	ErrClosed = errors.New("kvevents: publisher already closed")
)
