package kv

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Kind selects a layer's K or V tensor, in every call that reads, writes or views
// one: K or V (an MLA layer's one latent is K).
type Kind uint8

const (
	K Kind = iota // the key tensor (an MLA layer's one latent)
	V             // the value tensor
)

// String returns "K" or "V", as logs and errors print a tensor.
func (k Kind) String() string {
	if k == V {
		return "V"
	}
	return "K"
}

// Sequence is one request's K and V tensors, growing token by token on base addresses
// that never change from creation to Close. A server makes one per request
// (Cache.NewSequence, NewSequenceFrom, PrefixCache.Lookup) and closes it when the
// request ends.
type Sequence struct {
	_ nocopy.NoCopy

	c      *Cache
	leak   invariants.Tracker // reports it collected unclosed in the invariants build
	id     uint64
	bufs   []buffer // PerLayer: one a tensor, in the order of shape.places; Blocked: one
	n      int      // tokens
	frozen int      // bytes at the start of each range that other holders may map: never written
	prefix *Prefix
	err    error  // set when damaged
	mark   uint64 // the last batch of the cache that named it (see Cache.check)
	grew   bool   // the running batch step resized its ranges (see Cache.grow)
	// adopted: the running batch step adopted runs committed ahead into its ranges
	// (see ahead.adopt); pre is then what they committed before that.
	adopted bool
	pre     int // while grew or adopted: the bytes each range committed before the step
	closed  bool
	pcl     *pcLive // what it maps of a PrefixCache's granules, or nil: the prefix cache's slot, which only its files read or write
	// guarded: protect made some of its own bytes read-only in its ranges once (a
	// fork, a freeze), so they may not all be writable. (What prefix cache hits
	// protect, pcLive counts.)
	guarded bool
	started backing.MapReport // what the call that made it took on (Started)
	// ahead is its runs committed ahead, one per layer group (Config.MapAhead; see
	// ahead.go: runs), nil until the first is asked; ahead1 holds a one-group cache's.
	ahead  []seqAhead
	ahead1 [1]seqAhead
	// gs is what it keeps per layer group in a cache on a Model (Cache.multi); nil in
	// a one-group cache, whose group's are frozen and pre (see frozenOf).
	gs []groupState

	// Readings for Cache.Stats, which runs on other goroutines.
	tokens    atomic.Int64
	committed atomic.Int64
	sharedIn  atomic.Int64
	used      atomic.Int64 // on a Model: the bytes of what its groups hold
}

func (s *Sequence) live() {
	if s.closed {
		panic(panicSequenceClosed)
	}
}

func (s *Sequence) usable() error {
	s.live()
	if s.err != nil {
		return fmt.Errorf("%w: %w", ErrDamaged, s.err)
	}
	return nil
}

// ID returns the sequence's number, unique within its cache: the key a server's logs
// and SequenceStats use for it.
func (s *Sequence) ID() uint64 {
	s.live()
	return s.id
}

// Len returns the tokens the sequence holds: the next appended token's position.
func (s *Sequence) Len() int {
	s.live()
	return s.n
}

// Cache returns the sequence's cache, for code handed only the sequence (a kernel
// wrapper that needs LayerStrides or Scales).
func (s *Sequence) Cache() *Cache {
	s.live()
	return s.c
}

// Truncate shrinks the sequence to n tokens (rollback after speculative decoding),
// giving back the granules wholly past n. Truncating into memory shared with a prefix
// or a fork never writes into it: the partly kept shared granule is replaced by one of
// the sequence's own holding a copy of the kept tokens. That replacement needs a new
// granule per range (cached prefixes are evicted first where the budget can not hold
// them); if it can not be had, the sequence is left holding the whole
// tokens below that granule and the error says how many (or, where a token straddles
// the granule boundary, the sequence is damaged and must be closed).
//
// On a Model, every group is cut to n tokens. A window group can not bring back the
// tokens it gave back: a truncate to n whose step at n would read one of them (the
// window rule: see the package doc) is refused with ErrDropped and changes nothing
// (recomputing them is the caller's); one that reads none of a window group's (n = 0,
// a chunk boundary) always works, and the group then holds no token below n. A
// recurrent state is kept as it is (restoring an earlier one is the caller's) but for
// n = 0, which gives it back. A failure of the backing midway through the groups
// damages the sequence.
func (s *Sequence) Truncate(n int) error {
	if err := s.usable(); err != nil {
		return err
	}
	if n < 0 || n > s.n {
		return fmt.Errorf("%w: truncate to %d of %d tokens", ErrRange, n, s.n)
	}
	if err := s.windowCheck("truncate", n); err != nil {
		return err
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
	s.refreshStats()
	return err
}

// truncate is Truncate once n is checked, told to the prefix cache (see
// prefixHooks.truncating): it returns the sharing unit that it replaced by a copy of
// the sequence's own, or -1.
func (s *Sequence) truncate(n int) (int, error) {
	if !s.c.multi {
		replaced, kept, err := s.truncateGroup(0, n)
		s.n = kept
		return replaced, err
	}
	for gi := range s.c.groups {
		if g := &s.c.groups[gi]; g.windowed() && n > 0 && s.gs[gi].held > n {
			if err := s.restartGroup(gi, n); err != nil {
				return -1, err
			}
			continue
		}
		if _, kept, err := s.truncateGroup(gi, n); err != nil {
			if (gi > 0 || kept != s.n) && s.err == nil {
				s.err = err // the groups no longer agree on the tokens
			}
			return -1, err
		}
	}
	s.n = n
	if n == 0 {
		for gi := range s.gs {
			s.gs[gi].held = 0 // emptied: every group starts over from 0
		}
	}
	return -1, nil
}

// restartGroup cuts window group gi, which holds no token below n (the step at n
// reads none: windowCheck), to n tokens: its ranges are emptied and start over at the
// unit that holds token n, as a fork's at n would, committing that unit where n lies
// inside it (its tokens below n are no holder's). A failure damages s: the group no
// longer agrees with the others on the tokens.
func (s *Sequence) restartGroup(gi, n int) error {
	g := &s.c.groups[gi]
	rs := g.ranges(s.bufs)
	lo := g.dropOff(n)
	for _, b := range rs {
		if err := b.Resize(0); err != nil {
			s.err = err
			return fmt.Errorf("%w: restarting a window at %d tokens: %w", ErrDamaged, n, err)
		}
		if err := b.StartAt(lo); err != nil {
			s.err = err
			return fmt.Errorf("%w: restarting a window at %d tokens: %w", ErrDamaged, n, err)
		}
	}
	// The granules just given back cover the unit of token n (the group held at
	// least one unit per range), so this asks the budget for no more than it had.
	if err := s.resizeList(rs, g.extent(n)); err != nil {
		s.err = err
		return fmt.Errorf("%w: restarting a window at %d tokens: %w", ErrDamaged, n, err)
	}
	f := s.frozenOf(gi)
	*f = min(*f, lo)
	s.gs[gi].held = n
	return nil
}

// truncateGroup cuts group gi's ranges to n tokens (see truncate) and returns the
// sharing unit it replaced by a copy of the sequence's own (or -1) and the tokens the
// group holds afterwards: n, or, where it could not commit the copy, the whole
// tokens below the shared unit (s.n when nothing changed).
func (s *Sequence) truncateGroup(gi, n int) (replaced, kept int, err error) {
	g := &s.c.groups[gi]
	rs := g.ranges(s.bufs)
	frozen := s.frozenOf(gi)
	// NB: gs is where the last sharing unit (a granule, or a block) that holds the
	// tokens starts; target is where the tokens end.
	target := g.extent(n)
	gs := g.shareable(n)
	if target == gs || target > *frozen {
		if err := s.resizeList(rs, target); err != nil {
			return -1, s.n, err
		}
		*frozen = min(*frozen, target)
		return -1, n, nil
	}
	// The new frontier lies inside a shared granule: copy its kept part out, unmap it,
	// commit an own granule and copy back. Cached prefixes go first where the budget
	// can not hold that granule now, as before any refusal, and the runs committed
	// ahead are kept from it as from a step's (see ahead.go: hold).
	own, _ := backing.AlignUp(target, s.c.gran)
	need := int64(len(rs)) * int64(own-gs)
	if s.c.ahead != nil {
		defer s.c.ahead.hold(need, 0)()
	}
	s.c.budgetOrEvict(need, 0)
	keep := make([][]byte, len(rs))
	for i, b := range rs {
		keep[i] = make([]byte, target-gs)
		if err := b.readAt(gs, keep[i]); err != nil {
			return -1, s.n, err
		}
	}
	if err := s.resizeList(rs, gs); err != nil {
		return -1, s.n, err
	}
	*frozen = gs
	kept = g.tokensWithin(gs)
	replaced = gs / g.unit // another granule (block) from here on
	for i, b := range rs {
		if err := b.Resize(target); err != nil {
			if rerr := resizeEach(rs[:i], gs); rerr != nil {
				s.err = rerr
			} else if g.extent(kept) != gs {
				// Token kept would straddle the granule boundary (a PerLayer token
				// whose TokenBytes does not divide the granule, a Q8_0 one say): part
				// of it lies in the shared granule given up, so no token count fits
				// exactly.
				s.err = err
			} else {
				s.resizeList(rs, g.extent(kept))
			}
			return replaced, kept, fmt.Errorf("kv: truncate to %d tokens left %d: %w", n, kept, err)
		}
		if err := b.writeAt(gs, keep[i]); err != nil {
			s.err = err
			return replaced, kept, err
		}
	}
	return replaced, n, nil
}

// resizeEach resizes the ranges rs to size bytes.
func resizeEach(rs []buffer, size int) error {
	var errs []error
	for _, b := range rs {
		if err := b.Resize(size); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// resizeAll resizes every range to size bytes; a failure damages the sequence unless
// it failed on the first range (nothing changed then).
func (s *Sequence) resizeAll(size int) error { return s.resizeList(s.bufs, size) }

// resizeList resizes the ranges rs of s to size bytes; a failure damages the
// sequence unless it failed on the first of them.
func (s *Sequence) resizeList(rs []buffer, size int) error {
	for i, b := range rs {
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

// Fork returns a new sequence holding the same tokens: ForkAt(Len()). A server calls
// it for each further sample of a request that asks for several (parallel sampling,
// beam search).
func (s *Sequence) Fork() (*Sequence, error) {
	s.live()
	return s.ForkAt(s.n)
}

// ForkAt returns a new sequence holding the first n tokens of s (a checkpoint: beam
// search, speculative decoding): the full granules that hold them (in the Blocked
// layout, the full blocks) are mapped, not copied, read-only in the new sequence; the
// tokens past them are copied into the new sequence's own granule (block). From then on
// the tokens of s below the new sequence's Writable are shared by both: WriteToken
// refuses them (ErrReadOnly), and on a backing that can protect memory in place
// (backing.Protector) s's own mapping of them becomes read-only too, so that a stray
// write through Bytes or a View faults in either rather than reach the other. The new
// sequence MUST be closed. It fails with ErrRange for n outside [0, Len] and changes
// nothing on any error; when the copied tail's granules can not be had (ForkNeed says
// how many bytes they take), it evicts cached prefixes before it refuses with an
// *accounting.BudgetError.
//
// On a Model each group forks on its own: a window group's new sequence starts at the
// unit that holds its FirstLive(n) and maps the parent's whole units from there (a
// fork whose step at n would read a token the parent's window dropped is refused with
// ErrDropped: the window rule, see the package doc); a recurrent state is copied,
// never shared.
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
	if err := s.windowCheck("fork", n); err != nil {
		return nil, err
	}
	if err := s.dropAhead(); err != nil {
		return nil, err
	}
	if err := s.c.shareBudget(n); err != nil {
		return nil, err
	}
	var one, none [1]int
	fulls, held := one[:], none[:]
	if len(s.c.groups) > 1 {
		fulls, held = make([]int, len(s.c.groups)), make([]int, len(s.c.groups))
	}
	child, err := evicting(s.c, func() (*Sequence, error) {
		child, err := s.c.newSequence()
		if err != nil {
			return nil, err
		}
		err = s.c.shareGroups(child.bufs, s.bufs, s.helds(), n, fulls, held)
		if err == nil {
			err = s.protectGroups(fulls)
		}
		if err != nil {
			return nil, errors.Join(err, s.c.abandon(child))
		}
		return child, nil
	})
	if err != nil {
		return nil, err
	}
	child.startShared(n, fulls, held)
	if h := s.c.hooks(); h != nil {
		h.forked(s, n, fulls, child, nil)
	}
	child.refreshStats()
	s.c.register(child)
	return child, nil
}

// Freeze makes the first p tokens of the sequence an immutable, reference-counted
// Prefix that new sequences can start on (NewSequenceFrom): for a prefix a server
// knows of in advance (a system prompt); a PrefixCache finds shared prefixes itself.
// The full granules (in the
// Blocked layout, the full blocks) are shared, not copied; the prefix copies the
// tokens past them into a granule (block) of its own. The sequence's tokens below
// Writable are shared from then on: they MUST NOT be written through Bytes or a View
// (WriteToken refuses them with ErrReadOnly; on a backing.Protector the sequence's own
// mapping of them becomes read-only, so a stray write faults). The caller holds one
// reference and MUST Release it; the prefix's memory is freed with its last user. On error nothing
// changed, except that what could not be given back is reported in the error and in
// Stats.Unreleased. Its budget is ForkNeed(p)'s, and it evicts cached prefixes before
// it refuses for budget, as ForkAt does.
//
// On a Model each group freezes on its own, as ForkAt forks it: a full or MLA group
// keeps the first p tokens, a window group only its units from the one that holds
// its FirstLive(p) (a freeze whose step at p would read a token the window dropped is
// refused with ErrDropped: the window rule, see the package doc). A Model with a
// Recurrent group has no prefixes (a state is a function of every token, which a
// prefix of fewer tokens can not restore): Freeze fails there with ErrConfig.
func (s *Sequence) Freeze(p int) (*Prefix, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	if err := s.c.prefixable("Freeze"); err != nil {
		return nil, err
	}
	if !s.c.sharer {
		return nil, ErrNoSharing
	}
	if p < 0 || p > s.n {
		return nil, fmt.Errorf("%w: freeze %d of %d tokens", ErrRange, p, s.n)
	}
	if err := s.windowCheck("freeze", p); err != nil {
		return nil, err
	}
	if err := s.dropAhead(); err != nil {
		return nil, err
	}
	if err := s.c.shareBudget(p); err != nil {
		return nil, err
	}
	fulls, held := make([]int, len(s.c.groups)), make([]int, len(s.c.groups))
	bufs, err := evicting(s.c, func() ([]buffer, error) {
		bufs, err := s.c.prefixRanges(p)
		if err != nil {
			return nil, err
		}
		err = s.c.shareGroups(bufs, s.bufs, s.helds(), p, fulls, held)
		if err == nil {
			err = s.protectGroups(fulls)
		}
		if err != nil {
			err = errors.Join(err, releaseError(s.c.release(bufs)))
			return nil, err
		}
		return bufs, nil
	})
	if err != nil {
		return nil, err
	}
	pr := &Prefix{c: s.c, bufs: bufs, tokens: p, refs: 1, creator: true}
	invariants.Track(&pr.leak, pr, "kv.Prefix")
	if s.gs != nil {
		pr.firstHeld = held
	}
	if h := s.c.hooks(); h != nil {
		h.forked(s, p, fulls, nil, pr)
	}
	s.c.mu.Lock()
	s.c.prefixes[pr] = struct{}{}
	s.c.mu.Unlock()
	return pr, nil
}

// Close gives back every granule the sequence holds (to the pool, or the OS) and its
// address space, and drops its reference to the prefix it started on: a server calls
// it when the request ends (or is preempted), after its last step. The outcome is
// honest: see accounting.ReleaseOutcome. A sequence is unusable after Close whatever
// the outcome; ranges whose release failed are kept by the cache, reported as
// residual, and retried by Cache.Close. A second Close changes nothing and returns a
// Failed outcome whose error matches ErrClosed, so that a deferred Close may follow
// an explicit one (docs/server.md, "A second Close").
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
	s.leak.Close()
	if s.prefix != nil {
		s.prefix.unref()
	}
	if h != nil {
		h.closed(s)
	}
	return out
}

// Prefix returns the prefix the sequence started on (NewSequenceFrom), or nil: to
// tell which requests share a prefix, for logs or for a scheduler that groups them.
func (s *Sequence) Prefix() *Prefix {
	s.live()
	return s.prefix
}

// Damaged reports whether a failed backing call left the sequence unusable; it must
// then be closed. A scheduler that keeps sequences across steps asks it after an
// operation's error, to tell a sequence it must close (ErrDamaged) from one that may
// go on.
func (s *Sequence) Damaged() bool {
	s.live()
	return s.err != nil
}

// reuse returns a new, empty sequence on the ranges of es, a prefix cache entry's
// sequence that left the index (see PrefixCache.spareLocked), with the granules they
// commit: its first growths need no new granules. es is spent.
func (c *Cache) reuse(es *Sequence) *Sequence {
	c.mu.Lock()
	c.nextID++
	s := &Sequence{c: c, id: c.nextID, bufs: es.bufs}
	c.entries--
	c.seqs[s] = struct{}{}
	c.mu.Unlock()
	es.bufs, es.closed = nil, true
	invariants.Track(&s.leak, s, "kv.Sequence")
	s.refreshStats()
	return s
}

// ownEntry moves s from the cache's sequences to its prefix cache's entries: it no
// longer counts in Stats or SequenceStats, and Close still waits for it.
func (c *Cache) ownEntry(s *Sequence) {
	c.mu.Lock()
	delete(c.seqs, s)
	c.entries++
	c.mu.Unlock()
	s.leak.Close() // the prefix cache owns it now
}

// closeEntry closes a sequence the prefix cache owned (adopted or not) and returns
// the outcome.
func (s *Sequence) closeEntry() accounting.ReleaseOutcome {
	c := s.c
	c.mu.Lock()
	if _, ok := c.seqs[s]; !ok {
		c.entries--
	}
	if invariants.Enabled {
		c.checkCountsLocked()
	}
	c.mu.Unlock()
	return s.Close()
}

// ForkNeed returns the bytes of budget that ForkAt(n) (and Freeze(n), which copies
// the same tail) would take now: the granules that hold the tokens past the last
// whole sharing unit below n (a granule, or a block in the Blocked layout), which are
// copied, less those the backing's pool holds idle. The whole units are mapped and
// take no net memory, so a fork, a freeze or a prefix-cache hit is refused for their
// sake only where not one granule is free: on host.Shared a granule the sequence made
// private first moves into the shared memfd (a copy, once), one granule at a time. It
// fails as ForkAt would for a bad n (ErrRange, ErrNoSharing). A scheduler compares
// it with Headroom before a ForkAt or Freeze.
func (s *Sequence) ForkNeed(n int) (int64, error) {
	if err := s.usable(); err != nil {
		return 0, err
	}
	if !s.c.sharer {
		return 0, ErrNoSharing
	}
	if n < 0 || n > s.n {
		return 0, fmt.Errorf("%w: fork at %d of %d tokens", ErrRange, n, s.n)
	}
	return max(s.c.shareNeed(n)-s.c.own(), 0), nil
}

// Started returns what the call that made s newly took on (a [backing.MapReport]):
// the bytes of the granules it committed as s's own (the copied tail of a prefix or
// a fork), the bytes it mapped, own and shared, and how many granules. A prefix's or
// a parent's shared granules add to Mapped only: they are owned once, already. It is
// the seed's per-call SharedPrefixCommitInfo (onnx_runtime_memory_api,
// src/allocator.rs) for NewSequenceFrom, Fork, ForkAt and a PrefixCache Lookup that
// hits. A new empty sequence (NewSequence, a Lookup that misses) took on nothing,
// also where a miss took over an evicted entry's granules: those were owned already
// and change hands. Under ByBacking the ledger's Owned minus the pool's idle
// granules moves by Owned (the pool may serve the new granules from idle ones it
// holds), its Mapped by Mapped. A server reads it to log what a request's start
// cost and what sharing saved it.
func (s *Sequence) Started() backing.MapReport {
	s.live()
	return s.started
}
