package baseline

import (
	"fmt"
	"math"

	"github.com/vmarena/vmarena/accounting"
)

// Kind says which of a layer's two tensors a write goes to.
type Kind uint8

const (
	// K is the key tensor.
	K Kind = iota
	// V is the value tensor.
	V
)

func (k Kind) String() string {
	switch k {
	case K:
		return "K"
	case V:
		return "V"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Shape is what a strategy stores per token and how long a sequence may grow.
type Shape struct {
	Layers     int // transformer layers; each has a K and a V tensor
	TokenBytes int // bytes of one token of one layer's K (or V)
	MaxTokens  int // the most tokens one sequence may hold
}

// Validate reports a shape with a non-positive dimension, or one whose largest
// allocation (a whole sequence at MaxTokens) overflows int.
func (s Shape) Validate() error {
	if s.Layers <= 0 || s.TokenBytes <= 0 || s.MaxTokens <= 0 {
		return fmt.Errorf("%w: layers %d, token bytes %d, max tokens %d must be positive", ErrShape, s.Layers, s.TokenBytes, s.MaxTokens)
	}
	if s.TokenBytes > math.MaxInt/2/s.Layers || s.MaxTokens > math.MaxInt/(2*s.Layers*s.TokenBytes) {
		return fmt.Errorf("%w: %d tokens × %d layers × 2 × %d bytes overflow", ErrShape, s.MaxTokens, s.Layers, s.TokenBytes)
	}
	return nil
}

// BytesPerToken returns the bytes of one token across all layers, K and V.
func (s Shape) BytesPerToken() int { return 2 * s.Layers * s.TokenBytes }

// tensors returns how many (layer, K|V) tensors a sequence has.
func (s Shape) tensors() int { return 2 * s.Layers }

// tensor returns the index of (layer, v) among a sequence's tensors.
func tensor(layer int, v Kind) int { return 2*layer + int(v) }

// Strategy is a way to hold the K and V tensors of many sequences.
type Strategy interface {
	// Name returns a short name for tables ("eager", "paged", ...).
	Name() string
	// NewSequence returns an empty sequence. It fails with an error matching
	// accounting.ErrBudgetExceeded when the strategy's budget can not cover what a new
	// sequence takes; nothing changed then.
	NewSequence() (Sequence, error)
	// NewSequenceFrom returns a sequence that starts with p's tokens. p must come from
	// this strategy and must not be released.
	NewSequenceFrom(p Prefix) (Sequence, error)
	// Stats returns a snapshot of what the strategy holds.
	Stats() Stats
	// Close gives back everything the strategy holds. It fails with ErrBusy, changing
	// nothing, while sequences or prefixes are live. A second Close changes nothing
	// and returns ErrClosed (docs/server.md, "A second Close").
	Close() error
}

// Sequence is one sequence's K and V tensors. It is used by one goroutine at a time
// and MUST be closed.
type Sequence interface {
	// Append grows every tensor of the sequence by n tokens. On error nothing
	// changed: budget refusals match accounting.ErrBudgetExceeded, growth past
	// MaxTokens ErrTooLong, a negative n ErrRange.
	Append(n int) error
	// Len returns the tokens the sequence holds.
	Len() int
	// WriteToken copies src, TokenBytes long, into token of (layer, v). token must be
	// below Len; a token shared with a prefix is read-only (ErrReadOnly).
	WriteToken(layer int, v Kind, token int, src []byte) error
	// Freeze returns an immutable prefix of the sequence's first n tokens, which new
	// sequences can start from. The prefix MUST be released.
	Freeze(n int) (Prefix, error)
	// Close gives back what the sequence holds (to the strategy's pool, where it has
	// one). Using the sequence afterwards panics with PanicSequenceClosed, but for a
	// second Close, which changes nothing and returns ErrClosed.
	Close() error
}

// Prefix is an immutable run of tokens that sequences can start from.
type Prefix interface {
	// Len returns the prefix's tokens.
	Len() int
	// Release drops the creator's reference; the memory goes back with the last user.
	// A second Release panics with PanicPrefixReleased.
	Release()
}

// Stats is a snapshot of what a strategy holds.
type Stats struct {
	Sequences int   // live sequences
	Prefixes  int   // live prefixes (not yet released)
	Tokens    int64 // tokens of live sequences; a shared prefix counts in each
	// Physical is the bytes allocated and touched now: live sequences' memory, live
	// prefixes', and memory kept for reuse (free slots, pooled blocks).
	Physical     int64
	PeakPhysical int64 // highest Physical since the strategy was made
	// Saved is the bytes live sequences and prefixes address that sharing spared:
	// each physical byte addressed k times counts k-1 times.
	Saved int64
}

// ledger counts a strategy's physical bytes and charges them to an optional authority.
// Its owner's mutex guards it.
type ledger struct {
	auth           *accounting.Authority
	physical, peak int64
}

// take charges n bytes before they are allocated; on error nothing was charged.
func (l *ledger) take(n int64) error {
	if l.auth != nil {
		if err := l.auth.TryAcquire(n); err != nil {
			return err
		}
	}
	l.physical += n
	l.peak = max(l.peak, l.physical)
	return nil
}

// give returns the charge for n bytes that were dropped.
func (l *ledger) give(n int64) {
	l.physical -= n
	if l.auth != nil {
		l.auth.Release(n)
	}
}

// checkAppend validates growing a sequence of length from by n tokens.
func checkAppend(s Shape, from, n int) error {
	switch {
	case n < 0:
		return fmt.Errorf("%w: append of %d tokens", ErrRange, n)
	case n > s.MaxTokens-from:
		return fmt.Errorf("%w: %d + %d tokens > %d", ErrTooLong, from, n, s.MaxTokens)
	}
	return nil
}

// checkWrite validates a WriteToken call on a sequence of length n.
func checkWrite(s Shape, n, layer int, v Kind, token int, src []byte) error {
	switch {
	case layer < 0 || layer >= s.Layers:
		return fmt.Errorf("%w: layer %d of %d", ErrRange, layer, s.Layers)
	case v != K && v != V:
		return fmt.Errorf("%w: %v", ErrRange, v)
	case token < 0 || token >= n:
		return fmt.Errorf("%w: token %d of %d", ErrRange, token, n)
	case len(src) != s.TokenBytes:
		return fmt.Errorf("%w: %d source bytes for a %d-byte token", ErrRange, len(src), s.TokenBytes)
	}
	return nil
}

// checkFreeze validates freezing n tokens of a sequence of length l.
func checkFreeze(n, l int) error {
	if n < 0 || n > l {
		return fmt.Errorf("%w: freeze %d tokens of %d", ErrRange, n, l)
	}
	return nil
}

// Reader is implemented by sequences whose tokens the CPU can read back (all of this
// package's); tests use it to check that what was written is what is read.
type Reader interface {
	// ReadToken copies token of (layer, v) into dst, TokenBytes long. token must be
	// below Len.
	ReadToken(layer int, v Kind, token int, dst []byte) error
}
