package baseline

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
)

// EagerOptions configures an Eager strategy.
type EagerOptions struct {
	// Slots is how many sequence slots NewEager allocates and clears up front, as a
	// server with a fixed number of parallel slots does. More are made on demand.
	Slots int
	// Authority, when set, is charged for every slot and prefix before it is allocated.
	Authority *accounting.Authority
}

// Eager preallocates a slot of MaxTokens tokens per sequence for every (layer, K|V)
// tensor and clears it, so its memory is resident from the start. A closed sequence's
// slot stays resident for the next sequence: Physical never shrinks until Close. Its
// zero value is not usable; call NewEager.
type Eager struct {
	shape     Shape
	slotBytes int

	mu       sync.Mutex
	led      ledger
	free     [][]byte // slots of closed sequences, resident
	seqs     int
	prefixes int
	closed   bool
	tokens   atomic.Int64
}

// NewEager returns an Eager strategy for shape with o.Slots slots allocated and
// cleared. It fails with a budget error, allocating nothing, when o.Authority can
// not cover them.
func NewEager(s Shape, o EagerOptions) (*Eager, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if o.Slots < 0 {
		return nil, fmt.Errorf("%w: %d slots", ErrOptions, o.Slots)
	}
	e := &Eager{shape: s, slotBytes: s.MaxTokens * s.BytesPerToken(), led: ledger{auth: o.Authority}}
	if o.Slots > 0 {
		if o.Slots > int(accounting.Unlimited/int64(e.slotBytes)) {
			return nil, fmt.Errorf("%w: %d slots of %d bytes overflow", ErrOptions, o.Slots, e.slotBytes)
		}
		if err := e.led.take(int64(o.Slots) * int64(e.slotBytes)); err != nil {
			return nil, fmt.Errorf("baseline: eager: %d slots: %w", o.Slots, err)
		}
		for range o.Slots {
			e.free = append(e.free, newCleared(e.slotBytes))
		}
	}
	return e, nil
}

// newCleared returns n bytes that are resident: Go hands out fresh large allocations
// as untouched zero pages, which Linux does not back until written.
func newCleared(n int) []byte {
	b := make([]byte, n)
	// NB: clear really stores zeros (memclr), unlike make, which trusts fresh pages.
	clear(b)
	return b
}

// Name returns "eager".
func (e *Eager) Name() string { return "eager" }

// SlotBytes returns the bytes of one sequence's slot: MaxTokens tokens of every tensor.
func (e *Eager) SlotBytes() int { return e.slotBytes }

// NewSequence returns an empty sequence on a free slot, or on a new slot allocated and
// cleared.
func (e *Eager) NewSequence() (Sequence, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	var slot []byte
	if n := len(e.free); n > 0 {
		slot, e.free = e.free[n-1], e.free[:n-1]
	} else {
		if err := e.led.take(int64(e.slotBytes)); err != nil {
			return nil, fmt.Errorf("baseline: eager: new slot: %w", err)
		}
		slot = newCleared(e.slotBytes)
	}
	e.seqs++
	return &eagerSeq{e: e, slot: slot}, nil
}

// NewSequenceFrom returns a sequence on a slot with p's tokens copied in.
func (e *Eager) NewSequenceFrom(p Prefix) (Sequence, error) {
	cp, err := asCopyPrefix(p, e)
	if err != nil {
		return nil, err
	}
	s, err := e.NewSequence()
	if err != nil {
		return nil, err
	}
	q := s.(*eagerSeq)
	tb := e.shape.TokenBytes
	for t := range e.shape.tensors() {
		copy(q.slot[t*e.shape.MaxTokens*tb:], cp.tensor(t))
	}
	q.n = cp.n
	e.tokens.Add(int64(cp.n))
	return q, nil
}

// Stats returns a snapshot; Saved is always zero (prefixes are copied).
func (e *Eager) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return Stats{
		Sequences:    e.seqs,
		Prefixes:     e.prefixes,
		Tokens:       e.tokens.Load(),
		Physical:     e.led.physical,
		PeakPhysical: e.led.peak,
	}
}

// Close frees every slot. It fails with ErrBusy while sequences or prefixes are live.
func (e *Eager) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if e.seqs > 0 || e.prefixes > 0 {
		return fmt.Errorf("%w: %d sequences, %d prefixes", ErrBusy, e.seqs, e.prefixes)
	}
	e.led.give(int64(len(e.free)) * int64(e.slotBytes))
	e.free = nil
	e.closed = true
	return nil
}

// copyPrefixFrom returns a prefix holding a copy of tokens [0, n) of each tensor that
// at returns, charged to led (the caller holds its owner's lock).
func copyPrefixFrom(owner any, s Shape, led *ledger, n int, at func(t int) []byte) (*copyPrefix, error) {
	size := s.tensors() * n * s.TokenBytes
	if err := led.take(int64(size)); err != nil {
		return nil, fmt.Errorf("baseline: prefix of %d tokens: %w", n, err)
	}
	p := &copyPrefix{owner: owner, buf: newCleared(size), n: n, tb: s.TokenBytes}
	for t := range s.tensors() {
		copy(p.tensor(t), at(t)[:n*s.TokenBytes])
	}
	return p, nil
}

// copyPrefix is a prefix shared by copying: it holds its own copy of the tokens,
// tensor after tensor, and every sequence started from it copies them again.
type copyPrefix struct {
	owner    any
	buf      []byte
	n, tb    int
	released bool
	release  func(p *copyPrefix) // gives the bytes back to the owner
}

func (p *copyPrefix) tensor(t int) []byte { return p.buf[t*p.n*p.tb : (t+1)*p.n*p.tb] }

// Len returns the prefix's tokens.
func (p *copyPrefix) Len() int { return p.n }

// Release frees the prefix's copy: no sequence maps it.
func (p *copyPrefix) Release() {
	if p.released {
		panic(PanicPrefixReleased)
	}
	p.released = true
	p.release(p)
}

func asCopyPrefix(p Prefix, owner any) (*copyPrefix, error) {
	cp, ok := p.(*copyPrefix)
	if !ok || cp.owner != owner {
		return nil, fmt.Errorf("%w: %T", ErrForeign, p)
	}
	if cp.released {
		panic(PanicPrefixReleased)
	}
	return cp, nil
}

type eagerSeq struct {
	e      *Eager
	slot   []byte
	n      int
	closed bool
}

func (q *eagerSeq) live() {
	if q.closed {
		panic(PanicSequenceClosed)
	}
}

// off returns the offset of token of tensor t in the slot.
func (q *eagerSeq) off(t, token int) int {
	return (t*q.e.shape.MaxTokens + token) * q.e.shape.TokenBytes
}

func (q *eagerSeq) Append(n int) error {
	q.live()
	if err := checkAppend(q.e.shape, q.n, n); err != nil {
		return err
	}
	q.n += n
	q.e.tokens.Add(int64(n))
	return nil
}

func (q *eagerSeq) Len() int { q.live(); return q.n }

func (q *eagerSeq) WriteToken(layer int, v Kind, token int, src []byte) error {
	q.live()
	if err := checkWrite(q.e.shape, q.n, layer, v, token, src); err != nil {
		return err
	}
	copy(q.slot[q.off(tensor(layer, v), token):], src)
	return nil
}

func (q *eagerSeq) ReadToken(layer int, v Kind, token int, dst []byte) error {
	q.live()
	if err := checkWrite(q.e.shape, q.n, layer, v, token, dst); err != nil {
		return err
	}
	copy(dst, q.slot[q.off(tensor(layer, v), token):])
	return nil
}

func (q *eagerSeq) Freeze(n int) (Prefix, error) {
	q.live()
	if err := checkFreeze(n, q.n); err != nil {
		return nil, err
	}
	e := q.e
	e.mu.Lock()
	defer e.mu.Unlock()
	stride := e.shape.MaxTokens * e.shape.TokenBytes
	p, err := copyPrefixFrom(e, e.shape, &e.led, n, func(t int) []byte { return q.slot[t*stride:] })
	if err != nil {
		return nil, err
	}
	p.release = func(p *copyPrefix) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.led.give(int64(cap(p.buf)))
		p.buf = nil
		e.prefixes--
	}
	e.prefixes++
	return p, nil
}

// Close puts the slot back for the next sequence; it stays resident.
func (q *eagerSeq) Close() error {
	if q.closed {
		return fmt.Errorf("%w: sequence closed twice", ErrClosed)
	}
	q.closed = true
	e := q.e
	e.mu.Lock()
	defer e.mu.Unlock()
	e.free = append(e.free, q.slot)
	q.slot = nil
	e.seqs--
	e.tokens.Add(-int64(q.n))
	return nil
}
