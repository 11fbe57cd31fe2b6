package nodepool

import (
	"errors"
	"fmt"
)

var (
	// ErrProtocol: a message broke the protocol (too short or long, an unknown
	// operation, a count out of bounds, a granule the sender does not hold, a
	// descriptor where none belongs). The side that sees it closes the connection.
	ErrProtocol = errors.New("nodepool: protocol violation")
	// ErrOwnerGone: the owner closed the connection or died. A client's mapped
	// memory stays valid until it decommits it; nothing new can be committed.
	ErrOwnerGone = errors.New("nodepool: the owner is gone")
	// ErrPeerRefused: the peer of a connection is not a user the owner serves.
	ErrPeerRefused = errors.New("nodepool: peer refused")
	// ErrOwnerRunning: another owner listens on the socket path already.
	ErrOwnerRunning = errors.New("nodepool: an owner already listens on this path")
	// ErrClosed: the Owner or Client was closed.
	ErrClosed = errors.New("nodepool: closed")
	// ErrBusy: Client.Close was called while reservations are still live.
	ErrBusy = errors.New("nodepool: client still holds reservations")
	// ErrLoanGone: a Borrow named a granule lent to this process whose lender
	// gave it back (decommitted it, or ended) before the borrow, and nobody else
	// borrowed it: its memory is gone. The borrow maps nothing; the connection
	// stays. It comes with backing.ErrNotLent.
	ErrLoanGone = errors.New("nodepool: the lent granule is gone")
	// ErrBorrowed: a Borrow named a granule this process borrows already (a
	// granule is borrowed once per process: map it again with Share). The borrow
	// maps nothing; the connection stays. It comes with backing.ErrNotLent.
	ErrBorrowed = errors.New("nodepool: the granule is borrowed by this process already")
	// ErrInvalidOption: an option or argument is out of range.
	ErrInvalidOption = errors.New("nodepool: invalid option")
)

func errorf(kind error, format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{kind}, args...)...)
}
