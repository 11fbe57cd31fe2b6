package kvsub

import "errors"

var (
	// ErrEndpoint: an endpoint that is not tcp://HOST:PORT.
	ErrEndpoint = errors.New("kvsub: bad endpoint")
	// ErrMessage: a message that is not topic, 8-byte sequence number and payload,
	// or larger than the limits.
	ErrMessage = errors.New("kvsub: malformed message")
	// ErrPayload: a payload that is not an event batch of vLLM's format.
	ErrPayload = errors.New("kvsub: malformed payload")
	// ErrGap: messages were missed and no replay socket (or its buffer) has them.
	ErrGap = errors.New("kvsub: missed messages")
	// ErrClosed: the subscriber was closed.
	ErrClosed = errors.New("kvsub: closed")
)
