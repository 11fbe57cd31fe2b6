package kv

import "errors"

var (
	// ErrGeometry: a geometry with a non-positive dimension or an unknown element type.
	ErrGeometry = errors.New("kv: invalid geometry")
	// ErrConfig: a configuration the cache can not be built from.
	ErrConfig = errors.New("kv: invalid configuration")
	// ErrUnknownModel: Preset was asked for a name it does not know.
	ErrUnknownModel = errors.New("kv: unknown model preset")
	// ErrTooLong: a sequence would grow past the cache's MaxTokens.
	ErrTooLong = errors.New("kv: sequence exceeds MaxTokens")
	// ErrRange: a token, layer or length outside what the sequence holds.
	ErrRange = errors.New("kv: out of range")
	// ErrElemType: a typed view whose element type is not the geometry's.
	ErrElemType = errors.New("kv: element type does not match the geometry")
	// ErrLayout: an operation the cache's layout can not serve (a contiguous per-layer
	// slice of a per-sequence layout, say).
	ErrLayout = errors.New("kv: not available in this layout")
	// ErrNoSharing: prefixes and forks need a backing that shares physical memory.
	ErrNoSharing = errors.New("kv: backing does not share memory")
	// ErrClosed: the cache is closed.
	ErrClosed = errors.New("kv: cache is closed")
)

// Misuse panics with these messages.
const (
	// PanicSequenceClosed is the panic value for any use of a Sequence after Close.
	PanicSequenceClosed = "kv: Sequence used after Close"
	// PanicPrefixReleased is the panic value for using or releasing a Prefix whose
	// creator's reference was already released.
	PanicPrefixReleased = "kv: Prefix used after Release"
	// PanicNilContext is the panic value for AppendCtx with a nil context.
	PanicNilContext = "kv: AppendCtx with a nil context"
	// PanicNilPrefix is the panic value for NewSequenceFrom(nil).
	PanicNilPrefix = "kv: NewSequenceFrom with a nil prefix"
	// PanicNilSequence is the panic value for PrefixCache.Insert(nil, ...).
	PanicNilSequence = "kv: PrefixCache.Insert with a nil sequence"
	// PanicPinReleased is the panic value for releasing a PrefixPin twice.
	PanicPinReleased = "kv: PrefixPin released twice"
	// PanicLayerRange is the panic value for Base of a layer or kind that does not
	// exist.
	PanicLayerRange = "kv: layer or kind out of range"
)
