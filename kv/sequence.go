package kv

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Kind selects a layer's K or V tensor.
type Kind uint8

const (
	K Kind = iota // the key tensor
	V             // the value tensor
)

func (k Kind) String() string {
	if k == V {
		return "V"
	}
	return "K"
}

// Sequence is one request's K and V tensors, growing token by token on base addresses
// that never change from creation to Close.
type Sequence struct {
	_ nocopy.NoCopy

	c      *Cache
	id     uint64
	bufs   []buffer // PerLayer: one a tensor, in the order of shape.places; Blocked: one
	n      int      // tokens
	frozen int      // bytes at the start of each range that other holders may map: never written
	prefix *Prefix
	err    error  // set when damaged
	mark   uint64 // the last batch of the cache that named it (see Cache.check)
	grew   bool   // the running batch step resized its ranges (see Cache.grow)
	pre    int    // while grew: the bytes each range committed before the step
	closed bool
	pcl    *pcLive // what it maps of a PrefixCache's granules, or nil
	// guarded: protect made some of its own bytes read-only in its ranges once (a
	// fork, a freeze), so they may not all be writable. (What prefix cache hits
	// protect, pcLive counts.)
	guarded bool
	started backing.MapReport // what the call that made it took on (Started)
	ahead   seqAhead          // its run committed ahead (Config.MapAhead; see ahead.go)

	// Readings for Cache.Stats, which runs on other goroutines.
	tokens    atomic.Int64
	committed atomic.Int64
	sharedIn  atomic.Int64
}

func (s *Sequence) live() {
	if s.closed {
		panic(PanicSequenceClosed)
	}
}

func (s *Sequence) usable() error {
	s.live()
	if s.err != nil {
		return fmt.Errorf("%w: %w", ErrDamaged, s.err)
	}
	return nil
}

// ID returns the sequence's number, unique within its cache.
func (s *Sequence) ID() uint64 {
	s.live()
	return s.id
}

// Len returns the tokens the sequence holds.
func (s *Sequence) Len() int {
	s.live()
	return s.n
}

// Cache returns the sequence's cache.
func (s *Sequence) Cache() *Cache {
	s.live()
	return s.c
}

// publish updates the readings other goroutines see.
func (s *Sequence) publish() {
	var committed, shared int64
	if s.err == nil {
		// NB: the ranges of a sequence that is not damaged are alike (every
		// operation resizes and shares them all the same, or damages it), so one
		// stands for all: a batch step then touches each range once.
		committed = int64(len(s.bufs)) * int64(s.bufs[0].Committed())
		shared = int64(len(s.bufs)) * int64(s.bufs[0].Shared())
	} else {
		for _, b := range s.bufs {
			committed += int64(b.Committed())
			shared += int64(b.Shared())
		}
	}
	s.tokens.Store(int64(s.n))
	s.committed.Store(committed)
	s.sharedIn.Store(shared)
}

// Append grows every K and V tensor of the sequence by n tokens, committing whole
// granules only where a tensor crosses a granule boundary (in the Blocked layout, a
// block's granules when its first token arrives). When the memory can not be
// had now it fails at once with an *accounting.BudgetError (it matches
// accounting.ErrBudgetExceeded; see AppendBatch for what it carries) and changes
// nothing; past MaxTokens it fails with ErrTooLong.
func (s *Sequence) Append(n int) error {
	g := [1]Growth{{s, n}}
	return s.c.appendBatch(g[:], 0)
}

// AppendCtx is Append that, when memory can not be had now, waits for it in the
// governor's FIFO queue of the device until ctx ends (see AppendBatchCtx). A
// cancelled wait changes nothing.
func (s *Sequence) AppendCtx(ctx context.Context, n int) error {
	return s.c.AppendBatchCtx(ctx, []Growth{{s, n}})
}

// need returns the bytes of the granules s must commit to hold tokens.
// The sequence must not be damaged: its ranges are then alike (see publish).
func (s *Sequence) need(tokens int) int64 {
	size, _ := backing.AlignUp(s.c.extent(tokens), s.c.gran)
	return int64(len(s.bufs)) * int64(max(size-s.bufs[0].Committed(), 0))
}

// Truncate shrinks the sequence to n tokens (rollback after speculative decoding),
// giving back the granules wholly past n. Truncating into memory shared with a prefix
// or a fork never writes into it: the partly kept shared granule is replaced by one of
// the sequence's own holding a copy of the kept tokens. That replacement needs a new
// granule per range (cached prefixes are evicted first where the budget can not hold
// them); if it can not be had, the sequence is left holding the whole
// tokens below that granule and the error says how many (or, where a token straddles
// the granule boundary, the sequence is damaged and must be closed).
func (s *Sequence) Truncate(n int) error {
	if err := s.usable(); err != nil {
		return err
	}
	if n < 0 || n > s.n {
		return fmt.Errorf("%w: truncate to %d of %d tokens", ErrRange, n, s.n)
	}
	if err := s.dropAhead(); err != nil {
		return err
	}
	var err error
	if h := s.c.hooks(); h != nil {
		err = h.truncating(s, n, func() (int, error) { return s.truncate(n) })
	} else {
		_, err = s.truncate(n)
	}
	s.publish()
	s.c.notify()
	return err
}

// truncate is Truncate once n is checked, told to the prefix cache (see
// prefixHooks.truncating): it returns the sharing unit that it replaced by a copy of
// the sequence's own, or -1.
func (s *Sequence) truncate(n int) (int, error) {
	// NB: gs is where the last sharing unit (a granule, or a block) that holds the
	// tokens starts; target is where the tokens end.
	target := s.c.extent(n)
	gs := s.c.shareable(n)
	if target == gs || target > s.frozen {
		if err := s.resizeAll(target); err != nil {
			return -1, err
		}
		s.n = n
		s.frozen = min(s.frozen, target)
		return -1, nil
	}
	// The new frontier lies inside a shared granule: copy its kept part out, unmap it,
	// commit an own granule and copy back. Cached prefixes go first where the budget
	// can not hold that granule now, as before any refusal.
	own, _ := backing.AlignUp(target, s.c.gran)
	s.c.budgetOrEvict(int64(len(s.bufs))*int64(own-gs), 0)
	keep := make([][]byte, len(s.bufs))
	for i, b := range s.bufs {
		keep[i] = make([]byte, target-gs)
		if err := b.readAt(gs, keep[i]); err != nil {
			return -1, err
		}
	}
	if err := s.resizeAll(gs); err != nil {
		return -1, err
	}
	s.frozen = gs
	s.n = s.c.tokensWithin(gs)
	replaced := gs / s.c.unit // another granule (block) from here on
	for i, b := range s.bufs {
		if err := b.Resize(target); err != nil {
			if rerr := s.resizeFirst(i, gs); rerr != nil {
				s.err = rerr
			} else if s.c.extent(s.n) != gs {
				// Token s.n would straddle the granule boundary (a PerLayer token
				// whose TokenBytes does not divide the granule, a Q8_0 one say): part
				// of it lies in the shared granule given up, so no token count fits
				// exactly.
				s.err = err
			} else {
				s.resizeAll(s.c.extent(s.n))
			}
			return replaced, fmt.Errorf("kv: truncate to %d tokens left %d: %w", n, s.n, err)
		}
		if err := b.writeAt(gs, keep[i]); err != nil {
			s.err = err
			return replaced, err
		}
	}
	s.n = n
	return replaced, nil
}

// resizeFirst resizes the first k ranges to size bytes.
func (s *Sequence) resizeFirst(k, size int) error {
	var errs []error
	for _, b := range s.bufs[:k] {
		if err := b.Resize(size); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// resizeAll resizes every range to size bytes; a failure damages the sequence unless
// it failed on the first range (nothing changed then).
func (s *Sequence) resizeAll(size int) error {
	for i, b := range s.bufs {
		if err := b.Resize(size); err != nil {
			if i > 0 {
				s.err = err
				return fmt.Errorf("%w: %w", ErrDamaged, err)
			}
			return err
		}
	}
	return nil
}

// Fork returns a new sequence holding the same tokens (parallel sampling, beam
// search): ForkAt(Len()).
func (s *Sequence) Fork() (*Sequence, error) {
	s.live()
	return s.ForkAt(s.n)
}

// ForkAt returns a new sequence holding the first n tokens of s (a checkpoint: beam
// search, speculative decoding): the full granules that hold them (in the Blocked
// layout, the full blocks) are mapped, not copied, read-only in the new sequence; the
// tokens past them are copied into the new sequence's own granule (block). From then on the tokens of s below the
// new sequence's Writable are shared by both: WriteToken refuses them (ErrReadOnly),
// and on a backing that can protect memory in place (backing.Protector) s's own
// mapping of them becomes read-only too, so that a stray write through Bytes or a
// View faults in either rather than reach the other. The new sequence MUST be closed.
// It fails with ErrRange for n outside [0, Len] and changes nothing on any error;
// when the copied tail's granules can not be had (ForkNeed says how many bytes they
// take), it evicts cached prefixes before it refuses with an *accounting.BudgetError.
func (s *Sequence) ForkAt(n int) (*Sequence, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	if !s.c.sharer {
		return nil, ErrNoSharing
	}
	if n < 0 || n > s.n {
		return nil, fmt.Errorf("%w: fork at %d of %d tokens", ErrRange, n, s.n)
	}
	if err := s.dropAhead(); err != nil {
		return nil, err
	}
	if err := s.c.shareBudget(n); err != nil {
		return nil, err
	}
	var full int
	child, err := evicting(s.c, func() (*Sequence, error) {
		child, err := s.c.newSequence()
		if err != nil {
			return nil, err
		}
		full, err = s.c.shareInto(child.bufs, s.bufs, n)
		if err == nil {
			err = s.protect(full)
		}
		if err != nil {
			return nil, errors.Join(err, s.c.abandon(child))
		}
		return child, nil
	})
	if err != nil {
		return nil, err
	}
	child.n = n
	child.frozen = full
	if h := s.c.hooks(); h != nil {
		h.forked(s, full/s.c.unit, child, nil)
	}
	child.publish()
	s.c.register(child)
	return child, nil
}

// readOnly makes [off, off+n) of each range read-only, in order. When one fails it
// gives write access back to those it protected, and returns the failure and what
// failed to give write access back (nil when each range is as it was).
func readOnly(bufs []buffer, off, n int) (err, restore error) {
	for i, b := range bufs {
		if err := b.protect(off, n, backing.ReadOnly); err != nil {
			var errs []error
			for _, q := range bufs[:i] {
				if rerr := q.protect(off, n, backing.ReadWrite); rerr != nil {
					errs = append(errs, rerr)
				}
			}
			return err, errors.Join(errs...)
		}
	}
	return nil, nil
}

// protect makes the first full bytes of each of s's ranges shared: never written
// from now on, and read-only in s's own mapping where the backing can protect memory
// in place. On error s is as it was.
func (s *Sequence) protect(full int) error {
	if full <= s.frozen {
		return nil
	}
	s.lockRanges()
	defer s.unlockRanges()
	if s.c.protector {
		if err, rerr := readOnly(s.bufs, s.frozen, full-s.frozen); rerr != nil {
			s.err = rerr
			return errors.Join(err, fmt.Errorf("%w: restoring write access: %w", ErrDamaged, rerr))
		} else if err != nil {
			return err
		}
	}
	s.frozen = full
	s.guarded = s.guarded || s.c.protector
	return nil
}

// shareInto makes each dst range hold the first n tokens of its src range: the whole
// sharing units (granules, or blocks) mapped read-only, the tokens past them copied.
// dst ranges must be empty. It returns the shared bytes per range; on error the dst
// ranges are left for the caller to close.
func (c *Cache) shareInto(dst, src []buffer, n int) (int, error) {
	full, size := c.shareable(n), c.extent(n)
	for i := range dst {
		if err := dst[i].shareFrom(src[i], full, backing.ReadOnly); err != nil {
			return 0, err
		}
		if err := dst[i].Resize(size); err != nil {
			return 0, err
		}
		if err := c.copyTail(dst[i], src[i], n); err != nil {
			return 0, err
		}
	}
	return full, nil
}

// Freeze makes the first p tokens of the sequence an immutable, reference-counted
// Prefix that new sequences can start on (NewSequenceFrom). The full granules (in the
// Blocked layout, the full blocks) are shared, not copied; the prefix copies the
// tokens past them into a granule (block) of its own. The sequence's tokens below Writable are shared from then on:
// they MUST NOT be written through Bytes or a View (WriteToken refuses them with
// ErrReadOnly; on a backing.Protector the sequence's own mapping of them becomes
// read-only, so a stray write faults). The caller holds one reference and MUST
// Release it; the prefix's memory is freed with its last user. On error nothing
// changed, except that what could not be given back is reported in the error and in
// Stats.Unreleased. Its budget is ForkNeed(p)'s, and it evicts cached prefixes before
// it refuses for budget, as ForkAt does.
func (s *Sequence) Freeze(p int) (*Prefix, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	if !s.c.sharer {
		return nil, ErrNoSharing
	}
	if p < 0 || p > s.n {
		return nil, fmt.Errorf("%w: freeze %d of %d tokens", ErrRange, p, s.n)
	}
	if err := s.dropAhead(); err != nil {
		return nil, err
	}
	if err := s.c.shareBudget(p); err != nil {
		return nil, err
	}
	capacity, _ := backing.AlignUp(s.c.extent(p), s.c.gran)
	var full int
	bufs, err := evicting(s.c, func() ([]buffer, error) {
		bufs, err := s.c.newBuffers(max(capacity, s.c.gran))
		if err != nil {
			return nil, err
		}
		full, err = s.c.shareInto(bufs, s.bufs, p)
		if err == nil {
			err = s.protect(full)
		}
		if err != nil {
			err = errors.Join(err, releaseError(s.c.release(bufs)))
			s.c.notify()
			return nil, err
		}
		return bufs, nil
	})
	if err != nil {
		return nil, err
	}
	pr := &Prefix{c: s.c, bufs: bufs, tokens: p, refs: 1, creator: true}
	if h := s.c.hooks(); h != nil {
		h.forked(s, full/s.c.unit, nil, pr)
	}
	s.c.mu.Lock()
	s.c.prefixes[pr] = struct{}{}
	s.c.mu.Unlock()
	return pr, nil
}

// Close gives back every granule the sequence holds (to the pool, or the OS) and its
// address space, and drops its reference to the prefix it started on. The outcome is
// honest: see accounting.ReleaseOutcome. A sequence is unusable after Close whatever
// the outcome; ranges whose release failed are kept by the cache, reported as
// residual, and retried by Cache.Close. A second Close changes nothing and returns a
// Failed outcome whose error matches ErrClosed, so that a deferred Close may follow
// an explicit one.
func (s *Sequence) Close() accounting.ReleaseOutcome {
	if s.closed {
		return accounting.FailedRelease(0, fmt.Errorf("%w: sequence %d closed twice", ErrClosed, s.id))
	}
	// NB: a run ahead that can not be given back now stays in the ranges, whose
	// Close tries again.
	_ = s.dropAhead()
	bufs := s.bufs
	h := s.c.hooks()
	if h != nil {
		// A prefix cache entry made from s may take over s's ranges.
		if old, ok := h.closing(s); ok {
			bufs = old
		}
	}
	out := s.c.release(bufs)
	s.closed = true
	s.n = 0
	s.tokens.Store(0)
	s.committed.Store(0)
	s.sharedIn.Store(0)
	c := s.c
	c.mu.Lock()
	delete(c.seqs, s)
	c.mu.Unlock()
	if s.prefix != nil {
		s.prefix.unref()
	}
	if h != nil {
		h.closed(s)
	}
	c.notify()
	return out
}

// Prefix returns the prefix the sequence started on, or nil.
func (s *Sequence) Prefix() *Prefix {
	s.live()
	return s.prefix
}

// Damaged reports whether a failed backing call left the sequence unusable; it must
// then be closed.
func (s *Sequence) Damaged() bool {
	s.live()
	return s.err != nil
}
