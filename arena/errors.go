package arena

import "errors"

var (
	// ErrCapacity: a length beyond the buffer's reserved capacity.
	ErrCapacity = errors.New("arena: length exceeds capacity")
	// ErrInvalidSize: a negative or overflowing size.
	ErrInvalidSize = errors.New("arena: invalid size")
	// ErrAuthority: the authority argument does not fit the backing's accounting.
	ErrAuthority = errors.New("arena: authority does not match the backing's accounting")
	// ErrNotEmpty: sharing into a buffer that already has committed memory.
	ErrNotEmpty = errors.New("arena: buffer is not empty")
	// ErrNoSharing: the backing can not share physical memory.
	ErrNoSharing = errors.New("arena: backing does not share memory")
)

// Misuse panics with these messages.
const (
	// PanicClosed is the panic value for any use of a Buffer after Close.
	PanicClosed = "arena: Buffer used after Close"
	// PanicDeviceBytes is the panic value for Bytes on a buffer whose memory the CPU
	// must not touch.
	PanicDeviceBytes = "arena: Bytes of a device buffer"
)
