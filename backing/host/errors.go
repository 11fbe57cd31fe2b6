package host

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/backing"
)

// Errors of the private backing. Range and state errors are the backing package's
// sentinels ([backing.ErrInvalidRange], [backing.ErrCommitted], ...) inside a
// [*backing.OpError]; the shared backing's own errors follow.
var (
	// ErrPrivateOptions: NewPrivate was given options it can not honour (a granule
	// that is not a power of two or not a multiple of the page, a name the kernel
	// would refuse).
	ErrPrivateOptions = errors.New("host: invalid private backing options")
)

// privateError wraps an OS error from op on [off, off+size) in an *backing.OpError
// whose Kind classifies it (ErrOutOfMemory, ErrMapLimit) and whose Err is the errno,
// so that errors.Is works for both.
func privateError(op string, off, size int, err error) error {
	kind, cause := privateClassifyOS(err)
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: kind, Err: cause}
}

// mapLimitError explains an ENOMEM that came from the process's limit on memory
// mappings (vm.max_map_count) rather than from a shortage of memory. Both backings
// return it; cost says what takes the backing's mappings, and fix, when not empty,
// what the caller can do about that first.
type mapLimitError struct {
	count, limit int
	cost, fix    string
	errno        error
}

func (e *mapLimitError) Error() string {
	fix := ""
	if e.fix != "" {
		fix = e.fix + ", "
	}
	return fmt.Sprintf("host: %v: the process has %d memory mappings and vm.max_map_count is %d; "+
		"%s: %suse a larger granule, or raise the limit with `sysctl -w vm.max_map_count=N` (say N=%d)",
		e.errno, e.count, e.limit, e.cost, fix, 2*e.limit)
}

// Unwrap returns the errno (ENOMEM), so errors.Is(err, unix.ENOMEM) holds.
func (e *mapLimitError) Unwrap() error { return e.errno }

// Errors of the shared backing. Range and state errors are the backing package's
// sentinels ([backing.ErrInvalidRange], [backing.ErrCommitted], ...) inside a
// [*backing.OpError]; these are the ones only a shared backing can return.
var (
	// ErrSharedOptions: NewShared was given options it can not honour.
	ErrSharedOptions = errors.New("host: invalid shared backing options")
	// ErrSharedArgument: a count or protection passed to a shared backing method is
	// out of its domain (a negative Prefill, an unknown Protection).
	ErrSharedArgument = errors.New("host: invalid argument")
	// ErrSharedReadOnly: the call would write through a read-only mapping (shared
	// read-only, or protected), or make writable a granule shared read-only. It
	// matches [backing.ErrReadOnly].
	ErrSharedReadOnly = fmt.Errorf("host: write to a read-only mapping: %w", backing.ErrReadOnly)
	// ErrSharedInUse: Close was called while reservations are still live.
	ErrSharedInUse = errors.New("host: shared backing still has live reservations")
	// ErrSharedClosed: Close was called on a Shared backing closed already.
	ErrSharedClosed = errors.New("host: shared backing closed")
)

// errSharedGone says that a reservation was unreserved while a call on it had
// released s.mu (to wait for the budget, or to allocate): the call panics with
// backing.PanicUseAfterUnreserve once it released s.mu itself. It never reaches a
// caller.
var errSharedGone = errors.New("host: reservation unreserved during the call")

// PanicSharedClosed is the panic value for using a Shared backing after Close (but
// for a second Close: ErrSharedClosed).
const PanicSharedClosed = "host: shared backing used after Close"
