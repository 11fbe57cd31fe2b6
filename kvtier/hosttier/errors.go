package hosttier

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/kv/tierval"
)

// Errors of making a tier.
var (
	// ErrBadOptions: New was given options it can not honour (no budget, a budget
	// below one granule, an authority on another kind of device, a pin chunk out of
	// range).
	ErrBadOptions = errors.New("hosttier: invalid options")
	// ErrCgroup: the budget is above what the process's memory cgroup leaves free
	// (memory.max less memory.current, or cgroup v1's limit_in_bytes less
	// usage_in_bytes, at the tightest level). Filling such a tier would get the
	// process killed by the kernel's OOM killer instead of refused.
	ErrCgroup = errors.New("hosttier: budget above the memory the cgroup leaves free")
	// ErrClosed: Close was called twice.
	ErrClosed = errors.New("hosttier: tier already closed")
)

// Errors of storing a value. A store that fails keeps nothing and changes no value
// the tier held before, except those it evicted to make room.
var (
	// ErrBadSize: Store was given a negative size. It matches tierval.ErrSize.
	ErrBadSize = fmt.Errorf("hosttier: negative value size: %w", tierval.ErrSize)
	// ErrTooLarge: the value is larger than the whole tier (MaxValueSize). It matches
	// tierval.ErrSize.
	ErrTooLarge = fmt.Errorf("hosttier: value larger than the tier: %w", tierval.ErrSize)
	// ErrFull: there is no room and nothing may be evicted (Options.NoEvict, or every
	// value is being read).
	ErrFull = errors.New("hosttier: tier is full")
)

// Misuse panics with these messages.
const (
	// PanicClosed is the panic value for a Store, Load, Contains or Delete after Close.
	PanicClosed = "hosttier: tier used after Close"
	// PanicNilFunc is the panic value for a nil fill or use function.
	PanicNilFunc = "hosttier: nil fill or use function"
	// PanicReaders is the panic value when a value's reader count would go below zero.
	PanicReaders = "hosttier: value released by more readers than read it"
)
