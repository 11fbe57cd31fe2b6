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

// privateMapLimitError explains an ENOMEM that came from the process's limit on
// memory mappings (vm.max_map_count) rather than from a shortage of memory: every
// boundary between a committed and a reserved granule splits a mapping in two.
type privateMapLimitError struct {
	count, limit int
	errno        error
}

func (e *privateMapLimitError) Error() string {
	return fmt.Sprintf("host: %v: the process has %d memory mappings and vm.max_map_count is %d; "+
		"each run of committed granules between reserved ones is a mapping: commit contiguous "+
		"ranges, use a larger granule, or raise the limit (sysctl vm.max_map_count)",
		e.errno, e.count, e.limit)
}

// Unwrap returns the errno (ENOMEM), so errors.Is(err, unix.ENOMEM) holds.
func (e *privateMapLimitError) Unwrap() error { return e.errno }

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
)

// PanicSharedClosed is the panic value for using a Shared backing after Close
// (Close again included).
const PanicSharedClosed = "host: shared backing used after Close"

// sharedMapLimitError explains an ENOMEM from mmap that came from the process's
// limit on memory mappings rather than from a shortage of memory.
type sharedMapLimitError struct {
	count, limit int
	errno        error
}

func (e *sharedMapLimitError) Error() string {
	return fmt.Sprintf("host: %v: the process has %d memory mappings and vm.max_map_count is %d; "+
		"memfd granules at scattered offsets need one mapping each: raise the limit with "+
		"`sysctl -w vm.max_map_count=N` (say N=%d) or use a larger granule",
		e.errno, e.count, e.limit, 2*e.limit)
}

// Unwrap returns the errno (ENOMEM), so errors.Is(err, unix.ENOMEM) holds.
func (e *sharedMapLimitError) Unwrap() error { return e.errno }
