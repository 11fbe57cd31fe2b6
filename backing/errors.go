package backing

import (
	"errors"
	"fmt"
)

// Argument errors: the call was wrong and changed nothing.
var (
	// ErrInvalidRange: a negative, misaligned or overflowing offset or size.
	ErrInvalidRange = errors.New("backing: invalid range")
	// ErrOutOfRange: the range does not lie inside the reservation.
	ErrOutOfRange = errors.New("backing: range outside the reservation")
	// ErrCommitted: a granule of the range is already committed (double commit or
	// overlap).
	ErrCommitted = errors.New("backing: range already committed")
	// ErrNotCommitted: a granule of the range is not committed.
	ErrNotCommitted = errors.New("backing: range not committed")
	// ErrForeignReservation: the reservation was made by another backing.
	ErrForeignReservation = errors.New("backing: reservation from another backing")
	// ErrReadOnly: the call would write, or grant write access to, a granule mapped
	// read-only (by Share with ReadOnly, or by Protect).
	ErrReadOnly = errors.New("backing: range is read-only")
)

// Resource errors: the system could not do what was asked.
var (
	// ErrOutOfMemory: the OS or driver has no memory (or address space) to give.
	ErrOutOfMemory = errors.New("backing: out of memory")
	// ErrMapLimit: the process reached its limit of memory mappings
	// (vm.max_map_count on Linux).
	ErrMapLimit = errors.New("backing: memory mapping limit reached")
	// ErrUnsupported: this system or device can not do it.
	ErrUnsupported = errors.ErrUnsupported
)

// Reservation misuse panics with these messages.
const (
	// PanicUseAfterUnreserve is the panic value for any use of a reservation after
	// Unreserve returned Complete or Quarantined.
	PanicUseAfterUnreserve = "backing: reservation used after Unreserve"
)

// OpError records a failed backing operation on a range. It unwraps to its cause: a
// sentinel of this package, an errno, or a driver result, so that both
// errors.Is(err, backing.ErrOutOfMemory) and errors.Is(err, unix.ENOMEM) hold where the
// backing wraps both (see Kind).
type OpError struct {
	Op     string // "reserve", "commit", "decommit", "unreserve", "share", ...
	Offset int
	Size   int
	Kind   error // a sentinel of this package classifying the failure, or nil
	Err    error // the underlying cause (errno, driver result), or nil
}

func (e *OpError) Error() string {
	msg := fmt.Sprintf("backing: %s [%#x, +%#x)", e.Op, e.Offset, e.Size)
	switch {
	case e.Kind != nil && e.Err != nil:
		return msg + ": " + trim(e.Kind) + ": " + e.Err.Error()
	case e.Kind != nil:
		return msg + ": " + trim(e.Kind)
	case e.Err != nil:
		return msg + ": " + e.Err.Error()
	}
	return msg
}

func trim(err error) string {
	s := err.Error()
	const p = "backing: "
	if len(s) > len(p) && s[:len(p)] == p {
		return s[len(p):]
	}
	return s
}

// Unwrap returns the classifying sentinel and the cause.
func (e *OpError) Unwrap() []error {
	var out []error
	if e.Kind != nil {
		out = append(out, e.Kind)
	}
	if e.Err != nil {
		out = append(out, e.Err)
	}
	return out
}

// Errorf returns an *OpError of kind with a formatted cause.
func Errorf(op string, off, size int, kind error, format string, args ...any) error {
	return &OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: fmt.Errorf(format, args...)}
}
