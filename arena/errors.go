package arena

import (
	"errors"
	"fmt"
)

var (
	// ErrCapacity: a length beyond the buffer's reserved capacity.
	ErrCapacity = errors.New("arena: length exceeds capacity")
	// ErrInvalidSize: a negative or overflowing size.
	ErrInvalidSize = errors.New("arena: invalid size")
	// ErrAuthority: the authority argument does not fit the backing's accounting.
	ErrAuthority = errors.New("arena: authority does not match the backing's accounting")
	// ErrNotEmpty: sharing into a buffer whose committed bytes do not end where the
	// share starts (ShareFrom: a buffer with any committed bytes).
	ErrNotEmpty = errors.New("arena: buffer is not empty")
	// ErrNoSharing: the backing can not share physical memory.
	ErrNoSharing = errors.New("arena: backing does not share memory")
	// ErrNoProtection: the backing can not change the access of committed memory
	// (it is not a backing.Protector, or answers that it can not). It matches
	// errors.ErrUnsupported.
	ErrNoProtection = fmt.Errorf("arena: backing can not change the access of its memory: %w", errors.ErrUnsupported)
	// ErrNoLending: the backing can not lend its granules to another process nor
	// borrow another's (it is not a backing.Lender). It matches
	// errors.ErrUnsupported.
	ErrNoLending = fmt.Errorf("arena: backing can not lend memory across processes: %w", errors.ErrUnsupported)
	// ErrAhead: a run committed ahead (CommitAhead) in the way of a growth, or none
	// where AdoptAhead needs one at the committed bytes' end.
	ErrAhead = errors.New("arena: run committed ahead")
	// ErrAheadBusy: a call commits or decommits the buffer's run ahead right now (or
	// CommitAhead found one there already).
	ErrAheadBusy = errors.New("arena: run committed ahead is busy")
	// ErrBehind: a growth or share over the run left behind (LeaveBehind) that
	// DecommitBehind has not given back.
	ErrBehind = errors.New("arena: run left behind")
	// ErrBehindBusy: a DecommitBehind gives the buffer's run behind back right now.
	ErrBehindBusy = errors.New("arena: run left behind is busy")
	// ErrClosed: Close was called on a Buffer or Arena closed already.
	ErrClosed = errors.New("arena: closed")
)

// Misuse panics with these messages.
const (
	// PanicClosed is the panic value for any use of a Buffer after Close but a
	// second Close (ErrClosed).
	PanicClosed = "arena: Buffer used after Close"
	// PanicDeviceBytes is the panic value for Bytes on a buffer whose memory the CPU
	// must not touch.
	PanicDeviceBytes = "arena: Bytes of a device buffer"
)

// Errors of the typed views (Tensor) and the Arena. The Buffer's are in errors.go.
var (
	// ErrInvalidShape: a negative dimension or stride, a rank above MaxRank, strides
	// that do not match the shape, or an element count or extent that overflows int.
	ErrInvalidShape = errors.New("arena: invalid tensor shape")
	// ErrOutOfBounds: a view that is not wholly inside [0, Len) of its memory.
	ErrOutOfBounds = errors.New("arena: view outside the memory's length")
	// ErrMisaligned: a view whose first element is not aligned to the element's
	// alignment (its size for a number, 2 for a Q8_0 block).
	ErrMisaligned = errors.New("arena: view not aligned to its element")
	// ErrNotHostAccessible: a host slice asked of memory the CPU must not touch.
	ErrNotHostAccessible = errors.New("arena: memory is not host-accessible")
	// ErrNotContiguous: a flat slice or reshape asked of a view with gaps or overlaps.
	ErrNotContiguous = errors.New("arena: tensor is not contiguous")
	// ErrInvalidAlignment: an alignment that is not a positive power of two.
	ErrInvalidAlignment = errors.New("arena: alignment must be a positive power of two")
	// ErrDType: an element type that is not one of Elem's.
	ErrDType = errors.New("arena: invalid element type")
	// ErrPartialBlock: a count of values of a block-quantized type that is not a whole
	// number of its blocks.
	ErrPartialBlock = errors.New("arena: not a whole number of blocks")
	// ErrQuantize: values a block-quantized type can not hold (a NaN, an infinity, or
	// a block whose scale overflows).
	ErrQuantize = errors.New("arena: values can not be quantized")
	// ErrArenaFull: an Arena allocation past the buffer's capacity. It is always
	// reported together with ErrCapacity.
	ErrArenaFull = errors.New("arena: arena capacity exhausted")
)

// Misuse of views and arenas panics with these messages.
const (
	// PanicIndex is the panic value for an index or sub-view range outside a tensor.
	PanicIndex = "arena: tensor index out of range"
	// PanicDeviceAccess is the panic value for a host read or write of a tensor in
	// memory the CPU must not touch.
	PanicDeviceAccess = "arena: host access to device memory"
	// PanicStaleView is the panic value for a host read or write through a view whose
	// bytes are no longer within its memory's length (the buffer shrank).
	PanicStaleView = "arena: view past its memory's length"
	// PanicBadMark is the panic value for Rewind to a mark that a later Rewind, Reset or
	// Release invalidated, or that another arena made.
	PanicBadMark = "arena: Rewind to an invalid mark"
	// PanicForeignAllocation is the panic value for releasing an Allocation to an
	// allocator that did not make it.
	PanicForeignAllocation = "arena: Release of another allocator's allocation"
	// PanicArenaClosed is the panic value for any use of an Arena after Close but a
	// second Close (ErrClosed).
	PanicArenaClosed = "arena: Arena used after Close"
	// PanicReleased is the panic value for releasing, or asking the bytes of, an Eager
	// allocation that was already given back.
	PanicReleased = "arena: Allocation used after Release"
)
