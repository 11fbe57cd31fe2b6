package kv

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
)

var (
	// ErrModel: a model whose shape is not valid (see Model.Validate): a group with
	// a non-positive dimension, an unknown element type, a head dim that is not a
	// whole number of its type's blocks, or scales its type can not have; layers in
	// no group or in two. A server sees it at start-up, from New or Validate.
	ErrModel = errors.New("kv: invalid model")
	// ErrConfig: a configuration the cache can not be built from. A server sees it at
	// start-up, from New, NewPrefixCache or a Size; the error says which field.
	ErrConfig = errors.New("kv: invalid configuration")
	// ErrUnknownModel: Preset was asked for a name it does not know; the error lists
	// the names it does, for a command-line flag's message.
	ErrUnknownModel = errors.New("kv: unknown model preset")
	// ErrTooLong: a sequence would grow past the cache's MaxTokens. A server ends
	// that request (or truncates it); waiting for memory does not help.
	ErrTooLong = errors.New("kv: sequence exceeds MaxTokens")
	// ErrRange: a token, layer or length outside what the sequence holds: a bug in
	// the caller's indices, not a shortage.
	ErrRange = errors.New("kv: out of range")
	// ErrElemType: a typed view whose element type is not its layer group's: View or
	// Run was instantiated with the wrong T.
	ErrElemType = errors.New("kv: element type does not match the geometry")
	// ErrLayout: an operation the cache's layout or memory can not serve (a contiguous
	// per-layer slice of a blocked layout, a CPU slice of device memory): use
	// ReadTokens and WriteTokens, which serve every layout and backing.
	ErrLayout = errors.New("kv: not available in this layout")
	// ErrNoSharing: prefixes and forks need a backing that shares physical memory
	// (host.Shared, cuda); a server on a private backing serves without them.
	ErrNoSharing = errors.New("kv: backing does not share memory")
	// ErrDamaged: a backing call failed midway through an operation that could not
	// be undone; the sequence must be closed (Close still gives back everything it
	// holds). A scheduler closes that sequence and ends its request (Sequence.Damaged).
	ErrDamaged = errors.New("kv: sequence damaged by a failed backing call")
	// ErrClosed: the cache or prefix cache is closed, or a sequence was closed a
	// second time: a server sees it during shutdown, or from a double Close.
	ErrClosed = errors.New("kv: closed")
	// ErrBusy: the cache still has live sequences or prefixes (or an open
	// PrefixCache) and can not close: close those first, then the cache.
	ErrBusy = errors.New("kv: cache has live sequences or prefixes")
	// ErrReadOnly: a write to a token below Writable, which lies in memory shared
	// with a prefix or a fork: write from Writable on.
	ErrReadOnly = errors.New("kv: token is read-only (shared)")
	// ErrDropped: a token a sliding-window or chunked-local group gave back (below
	// Sequence.FirstHeld): it can not be read, written or viewed, and a Truncate,
	// ForkAt, Freeze or PrefixCache.Insert whose holder the window rule says needs it
	// (see the package doc) is refused. It is no shortage: waiting does not help.
	ErrDropped = errors.New("kv: token dropped by its group's window")
	// ErrScale: scales asked of a cache that keeps none, the wrong number of them, or
	// a scale that is not finite and positive: a bug in how the server calls
	// SetScales, Scales or GroupScales.
	ErrScale = errors.New("kv: invalid FP8 scales")
	// ErrBatch: a batch that names a sequence twice, a nil sequence, or a sequence of
	// another cache: a scheduler bug; the step changed nothing.
	ErrBatch = errors.New("kv: invalid batch")
	// ErrNoLending: Prefix.Lend and Cache.BorrowPrefix need a backing whose granules
	// another process can map (a backing.Lender: a node pool client); a server on
	// another backing shares prefixes within its process only. It matches
	// errors.ErrUnsupported.
	ErrNoLending = fmt.Errorf("kv: backing does not lend memory across processes: %w", errors.ErrUnsupported)
	// ErrLoan: a PrefixLoan this cache can not borrow: lent by a cache of another
	// model, layout or granule, of a layout that does not fit its tokens, borrowed
	// already, or bytes that are not a loan. Nothing was mapped.
	ErrLoan = errors.New("kv: prefix loan does not fit the cache")
)

// Misuse panics with these messages.
const (
	// panicSequenceClosed is the panic value for any use of a Sequence after Close.
	panicSequenceClosed = "kv: Sequence used after Close"
	// panicPrefixReleased is the panic value for using or releasing a Prefix whose
	// creator's reference was already released.
	panicPrefixReleased = "kv: Prefix used after Release"
	// panicNilContext is the panic value for AppendCtx or AppendBatchCtx with a nil
	// context.
	panicNilContext = "kv: nil context"
	// panicNilPrefix is the panic value for NewSequenceFrom(nil).
	panicNilPrefix = "kv: NewSequenceFrom with a nil prefix"
	// panicNilSequence is the panic value for PrefixCache.Insert(nil, ...).
	panicNilSequence = "kv: PrefixCache.Insert with a nil sequence"
	// panicPinReleased is the panic value for releasing a PrefixPin twice.
	panicPinReleased = "kv: PrefixPin released twice"
	// panicLayerRange is the panic value for Base of a layer or kind that does not
	// exist.
	panicLayerRange = "kv: layer or kind out of range"
	// panicRefCount is the panic value when a prefix cache's count of the entries
	// that hold a granule, or of the live sequences that map it, would go below zero:
	// its books went wrong, and going on would free memory something still maps.
	panicRefCount = "kv: prefix cache granule count below zero"
)

// releaseError returns nil for a complete release, else an error that says how many
// bytes stay held and why.
func releaseError(out accounting.ReleaseOutcome) error {
	if out.OK() {
		return nil
	}
	return fmt.Errorf("kv: %d bytes could not be given back (%v): %w", out.Residual, out.Status, out.Err)
}

// joinNonNil returns err joined with more, or err itself (its type kept) where more
// is nil.
func joinNonNil(err, more error) error {
	if more == nil {
		return err
	}
	return errors.Join(err, more)
}
