package filetier

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/kv/tierval"
)

// Errors of opening a tier. Each names the directory and wraps the OS's error where
// there is one (fs.ErrNotExist, fs.ErrPermission, unix.EROFS ...).
var (
	// ErrBadOptions: New was given options it can not honour (no directory, a
	// negative budget or bound, a MaxValueSize above the budget).
	ErrBadOptions = errors.New("filetier: invalid options")
	// ErrDir: the directory is missing, not a directory, or can not be written (a
	// read-only file system, no permission).
	ErrDir = errors.New("filetier: directory unusable")
	// ErrNoSpace: the budget is above what the file system has free, plus what the
	// directory's blocks already hold.
	ErrNoSpace = errors.New("filetier: budget above the file system's free space")
	// ErrLocked: another tier (in this process or another) has the directory open.
	ErrLocked = errors.New("filetier: directory in use by another tier")
	// ErrClosed: Close was called twice.
	ErrClosed = errors.New("filetier: tier already closed")
)

// Errors of storing and loading. A store that fails keeps nothing and changes no
// value the tier held before, except those it evicted to make room; it is counted in
// Stats.Drops.
var (
	// ErrBadSize: Store was given a negative size. It matches tierval.ErrSize.
	ErrBadSize = fmt.Errorf("filetier: negative value size: %w", tierval.ErrSize)
	// ErrTooLarge: the value is larger than MaxValueSize. It matches
	// tierval.ErrSize.
	ErrTooLarge = fmt.Errorf("filetier: value larger than MaxValueSize: %w", tierval.ErrSize)
	// ErrFull: there is no room within the budget and nothing may be evicted (every
	// other byte is being written).
	ErrFull = errors.New("filetier: tier is full")
	// ErrWrite: the file system refused a block (a full disk, a disk gone
	// read-only, an I/O error). It wraps the OS's error.
	ErrWrite = errors.New("filetier: block not written")
	// ErrRead: a block's file could not be read (other than by being gone, which is
	// a miss). It wraps the OS's error.
	ErrRead = errors.New("filetier: block not read")
	// ErrCorrupt: a block's file failed a check (its magic, version, length, key,
	// namespace or CRC-32C): refused, counted in Stats.Corrupt and removed, never
	// handed to use.
	ErrCorrupt = errors.New("filetier: block refused as corrupt")
	// ErrNamespace: Store was given a key of another namespace than
	// Options.Namespace.
	ErrNamespace = errors.New("filetier: key of another namespace")
)

// Misuse panics with these messages.
const (
	// PanicClosed is the panic value for a Store, Load, Contains or Delete after Close.
	PanicClosed = "filetier: tier used after Close"
	// PanicNilFunc is the panic value for a nil fill or use function.
	PanicNilFunc = "filetier: nil fill or use function"
)
