package baseline

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
)

// AppendOptions configures an Append strategy.
type AppendOptions struct {
	// Authority, when set, is charged for every slice's capacity before it is kept.
	Authority *accounting.Authority
}

// Append grows one Go slice per (layer, K|V) tensor with the built-in append: what a
// Go programmer writes first. Growth copies the tensor to a new array (the base
// moves) and keeps spare capacity, which counts as Physical. Its zero value is not
// usable; call NewAppend.
type Append struct {
	shape Shape

	mu       sync.Mutex
	led      ledger
	seqs     int
	prefixes int
	closed   bool
	tokens   atomic.Int64
}

// NewAppend returns an Append strategy for shape.
func NewAppend(s Shape, o AppendOptions) (*Append, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &Append{shape: s, led: ledger{auth: o.Authority}}, nil
}

// Name returns "append".
func (a *Append) Name() string { return "append" }

// NewSequence returns an empty sequence; it holds nothing until it grows.
func (a *Append) NewSequence() (Sequence, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, ErrClosed
	}
	a.seqs++
	return &appendSeq{a: a, tensors: make([][]byte, a.shape.tensors())}, nil
}

// NewSequenceFrom returns a sequence whose tensors start as copies of p's, appended
// to empty slices.
func (a *Append) NewSequenceFrom(p Prefix) (Sequence, error) {
	cp, err := asCopyPrefix(p, a)
	if err != nil {
		return nil, err
	}
	s, err := a.NewSequence()
	if err != nil {
		return nil, err
	}
	q := s.(*appendSeq)
	if err := q.grow(cp.n, cp.tensor); err != nil {
		_ = q.Close()
		return nil, err
	}
	return q, nil
}

// Stats returns a snapshot; Saved is always zero (prefixes are copied).
func (a *Append) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return Stats{
		Sequences:    a.seqs,
		Prefixes:     a.prefixes,
		Tokens:       a.tokens.Load(),
		Physical:     a.led.physical,
		PeakPhysical: a.led.peak,
	}
}

// Close marks the strategy closed. It fails with ErrBusy while sequences or prefixes
// are live (they hold its memory).
func (a *Append) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	if a.seqs > 0 || a.prefixes > 0 {
		return fmt.Errorf("%w: %d sequences, %d prefixes", ErrBusy, a.seqs, a.prefixes)
	}
	a.closed = true
	return nil
}

type appendSeq struct {
	a       *Append
	tensors [][]byte
	n       int
	closed  bool
}

func (q *appendSeq) live() {
	if q.closed {
		panic(PanicSequenceClosed)
	}
}

// grow appends n tokens to every tensor: src(t) gives tensor t's new bytes, or nil
// for zeros. The new slices are charged before they replace the old ones, so on
// error nothing changed.
func (q *appendSeq) grow(n int, src func(t int) []byte) error {
	if n == 0 {
		return nil
	}
	a := q.a
	add := n * a.shape.TokenBytes
	next := make([][]byte, len(q.tensors))
	var delta int64
	for t, old := range q.tensors {
		var b []byte
		if src != nil {
			b = append(old, src(t)[:add]...)
		} else {
			// NB: appending zeros writes them, so the grown length is resident; the
			// spare capacity past it may not be until a later append writes it.
			b = append(old, make([]byte, add)...)
		}
		next[t] = b
		delta += int64(cap(b) - cap(old))
	}
	a.mu.Lock()
	err := a.led.take(delta)
	a.mu.Unlock()
	if err != nil {
		// NB: the slices that grew in place wrote past the old length into spare
		// capacity, which no reader sees (len is unchanged); those that moved are
		// garbage.
		return fmt.Errorf("baseline: append: grow by %d tokens: %w", n, err)
	}
	q.tensors = next
	q.n += n
	a.tokens.Add(int64(n))
	return nil
}

func (q *appendSeq) Append(n int) error {
	q.live()
	if err := checkAppend(q.a.shape, q.n, n); err != nil {
		return err
	}
	return q.grow(n, nil)
}

func (q *appendSeq) Len() int { q.live(); return q.n }

func (q *appendSeq) WriteToken(layer int, v Kind, token int, src []byte) error {
	q.live()
	if err := checkWrite(q.a.shape, q.n, layer, v, token, src); err != nil {
		return err
	}
	copy(q.tensors[tensor(layer, v)][token*q.a.shape.TokenBytes:], src)
	return nil
}

func (q *appendSeq) ReadToken(layer int, v Kind, token int, dst []byte) error {
	q.live()
	if err := checkWrite(q.a.shape, q.n, layer, v, token, dst); err != nil {
		return err
	}
	copy(dst, q.tensors[tensor(layer, v)][token*q.a.shape.TokenBytes:])
	return nil
}

func (q *appendSeq) Freeze(n int) (Prefix, error) {
	q.live()
	if err := checkFreeze(n, q.n); err != nil {
		return nil, err
	}
	a := q.a
	a.mu.Lock()
	defer a.mu.Unlock()
	p, err := copyPrefixFrom(a, a.shape, &a.led, n, func(t int) []byte { return q.tensors[t] })
	if err != nil {
		return nil, err
	}
	p.release = func(p *copyPrefix) {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.led.give(int64(cap(p.buf)))
		p.buf = nil
		a.prefixes--
	}
	a.prefixes++
	return p, nil
}

// Close drops the sequence's slices (the garbage collector frees them).
func (q *appendSeq) Close() error {
	if q.closed {
		return fmt.Errorf("%w: sequence closed twice", ErrClosed)
	}
	q.closed = true
	a := q.a
	var held int64
	for _, b := range q.tensors {
		held += int64(cap(b))
	}
	q.tensors = nil
	a.mu.Lock()
	defer a.mu.Unlock()
	a.led.give(held)
	a.seqs--
	a.tokens.Add(-int64(q.n))
	return nil
}
