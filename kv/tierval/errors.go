package tierval

import "errors"

// Errors of the tier value format. A value that fails any check of Decode is refused
// with an error wrapping ErrValue and exactly one of the more precise kinds below, so
// that the cache can count each kind; all of them are misses to the cache.
var (
	// ErrSize: a value whose size is negative or above what a tier holds (a Store),
	// or a destination that is not Size bytes (Encode). A Tier's Store wraps it when
	// it refuses a size.
	ErrSize = errors.New("tierval: value size out of range")

	// ErrValue: a value read from a tier that is not a block this cache may use.
	ErrValue = errors.New("tierval: value refused")
	// ErrTruncated: the value is shorter (or longer) than its header says.
	ErrTruncated = errors.New("tierval: value truncated")
	// ErrFormat: the value does not start with the format's magic, or is of a format
	// version this build does not read.
	ErrFormat = errors.New("tierval: value of unknown format")
	// ErrChecksum: the value's checksum does not match its bytes.
	ErrChecksum = errors.New("tierval: value checksum mismatch")
	// ErrNamespace: the value was written under another namespace (another model
	// geometry, layout, block size or user prefix).
	ErrNamespace = errors.New("tierval: value of another namespace")
	// ErrLayout: a value of several layer groups (GroupsVersion) written under
	// another layout: another model name, group count, or a group of another kind,
	// shape or unit (Layout). A cache never maps it.
	ErrLayout = errors.New("tierval: value of another group layout")
	// ErrBlock: the value was written for another block: another hash, another token
	// count or payload length, or other tokens.
	ErrBlock = errors.New("tierval: value of another block")
)

// PanicNilFill is the panic value for Encode with a nil fill, named so that a test
// can assert it.
const PanicNilFill = "tierval: Encode with a nil fill"
