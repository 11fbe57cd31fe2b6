package baseline

import "errors"

var (
	// ErrShape: a shape with a non-positive dimension or one whose sizes overflow.
	ErrShape = errors.New("baseline: invalid shape")
	// ErrOptions: options a strategy can not be built from.
	ErrOptions = errors.New("baseline: invalid options")
	// ErrRange: a token count, layer, token index or source length outside what the
	// sequence holds.
	ErrRange = errors.New("baseline: out of range")
	// ErrTooLong: a sequence would grow past the shape's MaxTokens.
	ErrTooLong = errors.New("baseline: sequence exceeds MaxTokens")
	// ErrReadOnly: a write into memory shared with a prefix or another sequence.
	ErrReadOnly = errors.New("baseline: token is shared and read-only")
	// ErrDropped: a token of a sliding-window layer whose block the window gave back
	// (see PagedOptions.Windows), or a Freeze that would need such a token.
	ErrDropped = errors.New("baseline: token dropped by its layer's sliding window")
	// ErrForeign: a prefix or sequence made by another strategy.
	ErrForeign = errors.New("baseline: prefix from another strategy")
	// ErrBusy: Close while sequences or prefixes are still live.
	ErrBusy = errors.New("baseline: strategy still has live sequences or prefixes")
	// ErrClosed: the strategy is closed, or a strategy or sequence was closed a
	// second time.
	ErrClosed = errors.New("baseline: closed")
)

// Misuse panics with these messages.
const (
	// PanicSequenceClosed is the panic value for any use of a Sequence after Close.
	PanicSequenceClosed = "baseline: Sequence used after Close"
	// PanicPrefixReleased is the panic value for using or releasing a Prefix after
	// Release.
	PanicPrefixReleased = "baseline: Prefix used after Release"
)
