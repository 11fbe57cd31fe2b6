package kv

// Prefixes across processes: a Prefix frozen in one process is lent (Prefix.Lend)
// to another process attached to the same node pool, which maps its granules into
// ranges of its own (Cache.BorrowPrefix) with no copy, and starts sequences on it as
// on any Prefix. The backing's backing.Lender does the mapping; this file carries
// the prefix's layout between the two caches and checks that it fits.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
)

// PrefixLoan is what a process passes to another for it to map a Prefix of its own
// with no copy: Prefix.Lend makes it, Cache.BorrowPrefix in the other process takes
// it. It holds the lending cache's model fingerprint (TierNamespace of its Config
// and granule, with no prefix), the number of the process it is lent to, the
// prefix's token count, the first token each
// window group holds, and, per range of the prefix, where its committed granules
// start and their ids on the node pool. It names no memory of the lender's address
// space: its bytes are safe to send over any channel (MarshalBinary), and the owner
// of the node pool checks every id it names against what was lent to the borrower.
//
// Every committed granule of the prefix is lent, the partial one past its whole
// granules (blocks) too: a prefix is never written after Freeze, so its tail granule
// is as immutable as the rest, and the borrower copies the tail into each sequence it
// starts from its own mapping of it, as NewSequenceFrom does on a local prefix.
// Nothing of the tail travels in the loan and nothing is recomputed. Its zero value
// is a loan of nothing, which BorrowPrefix refuses.
type PrefixLoan struct {
	model  uint64
	to     uint64 // the process it is lent to
	tokens int
	held   []int       // per group, the first token a window group holds; nil for one group
	ranges []loanRange // per range of the prefix, in the cache's order
}

// loanRange is one range of a lent prefix: the offset of its first committed byte
// and the ids of its committed granules from there, in order.
type loanRange struct {
	start int
	ids   []uint64
}

// Len returns the tokens of the lent prefix: what a sequence started on the
// borrowed Prefix holds before its own.
func (l PrefixLoan) Len() int { return l.tokens }

// Granules returns the granules the loan names, every range together.
func (l PrefixLoan) Granules() int {
	n := 0
	for _, r := range l.ranges {
		n += len(r.ids)
	}
	return n
}

// loanMagic starts a marshalled PrefixLoan; its last byte is the format's version.
const loanMagic = "vmkvloan\x01"

// MarshalBinary returns the loan as bytes, for the borrowing process to read with
// UnmarshalBinary: a header, then unsigned varints (the fingerprint as 8 bytes).
func (l PrefixLoan) MarshalBinary() ([]byte, error) {
	b := make([]byte, 0, len(loanMagic)+16+len(l.held)*2+len(l.ranges)*4+l.Granules()*3)
	b = append(b, loanMagic...)
	b = binary.LittleEndian.AppendUint64(b, l.model)
	b = binary.AppendUvarint(b, l.to)
	b = binary.AppendUvarint(b, uint64(l.tokens))
	b = binary.AppendUvarint(b, uint64(len(l.held)))
	for _, h := range l.held {
		b = binary.AppendUvarint(b, uint64(h))
	}
	b = binary.AppendUvarint(b, uint64(len(l.ranges)))
	for _, r := range l.ranges {
		b = binary.AppendUvarint(b, uint64(r.start))
		b = binary.AppendUvarint(b, uint64(len(r.ids)))
		for _, id := range r.ids {
			b = binary.AppendUvarint(b, id)
		}
	}
	return b, nil
}

// UnmarshalBinary sets l to the loan MarshalBinary wrote. Bytes that are not one
// (another format, truncated, trailing bytes, a count past what the bytes could
// hold) are refused with an error matching ErrLoan, and l is left as it was. It
// checks the form only: BorrowPrefix checks that the loan fits its cache.
func (l *PrefixLoan) UnmarshalBinary(data []byte) error {
	bad := func(what string) error { return fmt.Errorf("%w: %s", ErrLoan, what) }
	if len(data) < len(loanMagic)+8 || string(data[:len(loanMagic)]) != loanMagic {
		return bad("not a marshalled prefix loan of this version")
	}
	d := data[len(loanMagic):]
	var out PrefixLoan
	out.model = binary.LittleEndian.Uint64(d)
	d = d[8:]
	var err error
	// next reads one varint of at most limit.
	next := func(what string, limit uint64) uint64 {
		if err != nil {
			return 0
		}
		v, n := binary.Uvarint(d)
		switch {
		case n <= 0:
			err = bad("truncated at its " + what)
			return 0
		case v > limit:
			err = bad(fmt.Sprintf("%s %d past %d", what, v, limit))
			return 0
		}
		d = d[n:]
		return v
	}
	const maxInt = uint64(^uint(0) >> 1)
	out.to = next("borrower", ^uint64(0))
	out.tokens = int(next("token count", maxInt))
	// NB: each item takes at least one byte, so no count past the bytes left is
	// honest, and none makes a slice larger than the input.
	if nh := next("group count", uint64(len(d))); nh > 0 {
		out.held = make([]int, nh)
		for i := range out.held {
			out.held[i] = int(next("first held token", maxInt))
		}
	}
	if nr := next("range count", uint64(len(d))); nr > 0 {
		out.ranges = make([]loanRange, nr)
	}
	for i := range out.ranges {
		out.ranges[i].start = int(next("range start", maxInt))
		if n := next("granule count", uint64(len(d))); n > 0 {
			out.ranges[i].ids = make([]uint64, n)
			for j := range out.ranges[i].ids {
				out.ranges[i].ids[j] = next("granule id", ^uint64(0))
			}
		}
	}
	if err != nil {
		return err
	}
	if len(d) != 0 {
		return bad(fmt.Sprintf("%d bytes past its end", len(d)))
	}
	*l = out
	return nil
}

// Lend lets the process numbered to (its node pool client's Number) map every
// granule of p with no copy, and returns the loan to pass to that process, whose
// Cache.BorrowPrefix takes it: a prefill process lends what it computed to decode
// processes, or a replica its system prompt to the others. p stays the caller's:
// the granules stay charged to this process (owned once, mapped by many) until the
// last process that borrowed them gives them back, also after p is released. The
// borrower maps them read-only; this process keeps writing nothing of them (p is
// immutable).
//
// The loan is good while p's granules live: this process MUST keep p (or a sequence
// that maps them) until the borrower has borrowed it, since the node pool refuses a
// borrow of a granule its lender gave back. p must be one this cache froze (one it
// borrowed can not be lent onward: backing.ErrReadOnly). It fails with an error
// matching ErrNoLending on a backing that is not a backing.Lender (a node pool
// client is one), and changes nothing then; a failure of the backing midway leaves
// the ranges lent before it lendable to to, which costs nothing until it borrows.
// It panics ("kv: Prefix used after Release") once the creator released p.
func (p *Prefix) Lend(to uint64) (PrefixLoan, error) {
	p.held()
	c := p.c
	if !c.lends() {
		return PrefixLoan{}, fmt.Errorf("%w: %v", ErrNoLending, c.st)
	}
	model, err := TierNamespace(c.cfg, c.gran, "")
	if err != nil {
		return PrefixLoan{}, err
	}
	l := PrefixLoan{model: model, to: to, tokens: p.tokens, held: slices.Clone(p.firstHeld), ranges: make([]loanRange, len(p.bufs))}
	for i, b := range p.bufs {
		ids, err := b.(lendingBuffer).lend(b.Start(), b.Committed(), to)
		if err != nil {
			return PrefixLoan{}, fmt.Errorf("kv: lending range %d of a prefix: %w", i, err)
		}
		l.ranges[i] = loanRange{start: b.Start(), ids: ids}
	}
	return l, nil
}

// BorrowPrefix maps the granules of a prefix another process lent to this one
// (Prefix.Lend) into ranges of this cache, read-only and with no copy, and returns
// it as a Prefix that NewSequenceFrom takes as any other: a sequence started on it
// maps its whole granules (blocks) and copies the tokens past them into a granule of
// its own, its only commit. The borrowed Prefix commits nothing: its granules stay
// charged to the lender, and this process's ledger counts them as mapped, never as
// owned (its Committed counts the bytes it maps, which the lender owns). Its
// creator's reference is the caller's; Release (and the last sequence on it) gives
// the granules back to the lender's count. It can not be lent onward.
//
// The loan must be lent to this process (the backing's Number) by a cache of the
// same model, layout and granule: one lent to another process, one whose
// fingerprint (TierNamespace with no prefix) differs, or one whose layout does not
// fit its token count, is refused with an error matching ErrLoan, before the node
// pool is asked (whose owner would end the connection of a client that borrows
// what was not lent to it). The fingerprint is of the shape only: that both
// processes run the same weights is the caller's to know (it is what it would pass
// as a TierPrefix). A loan may be borrowed once per
// process: a second BorrowPrefix of a loan whose granules this cache still maps is
// refused with ErrLoan (start more sequences on the Prefix the first returned),
// and so is a borrow of it by another cache on the same node pool client while the
// first maps it, by the node (backing.ErrNotLent). A stale loan, whose lender gave
// its granules back (released the prefix, or ended) before the borrow, is refused
// with ErrLoan and backing.ErrNotLent too, and the client serves on. It fails with
// ErrNoLending on a backing that is not a backing.Lender and ErrNoSharing on one
// that does not share, with ErrConfig on a model with a recurrent group, and with
// the node pool's error when its owner refuses the borrow otherwise; on error
// nothing is mapped.
func (c *Cache) BorrowPrefix(l PrefixLoan) (*Prefix, error) {
	if err := c.prefixable("BorrowPrefix"); err != nil {
		return nil, err
	}
	if !c.sharer {
		return nil, ErrNoSharing
	}
	if !c.lends() {
		return nil, fmt.Errorf("%w: %v", ErrNoLending, c.st)
	}
	if err := c.fits(l); err != nil {
		return nil, err
	}
	if n := c.number(); l.to != n {
		return nil, fmt.Errorf("%w: lent to process %d; this cache's backing is process %d", ErrLoan, l.to, n)
	}
	p := &Prefix{c: c, tokens: l.tokens, refs: 1, creator: true, loaned: l.firstIDs()}
	if c.multi {
		p.firstHeld = slices.Clone(l.held)
	}
	c.mu.Lock()
	closed, again := c.closed, c.borrowedAlready(l)
	if !closed && !again {
		// NB: registered before it maps anything, so that a concurrent borrow of the
		// same loan sees its ids and Close waits (ErrBusy) until it is released.
		c.prefixes[p] = struct{}{}
	}
	c.mu.Unlock()
	switch {
	case closed:
		return nil, ErrClosed
	case again:
		return nil, fmt.Errorf("%w: this cache maps the loan's granules already: start sequences on the Prefix it borrowed first", ErrLoan)
	}
	fail := func(err error) (*Prefix, error) {
		c.mu.Lock()
		delete(c.prefixes, p)
		c.mu.Unlock()
		return nil, err
	}
	bufs, err := c.prefixRanges(l.tokens)
	if err != nil {
		return fail(err)
	}
	for i, b := range bufs {
		r := l.ranges[i]
		if len(r.ids) == 0 {
			continue
		}
		if r.start > 0 {
			err = b.StartAt(r.start)
		}
		if err == nil {
			err = b.(lendingBuffer).borrow(r.start, r.ids)
		}
		if err != nil {
			return fail(errors.Join(fmt.Errorf("kv: borrowing range %d of a prefix: %w", i, err), releaseError(c.release(bufs))))
		}
	}
	p.bufs = bufs
	invariants.Track(&p.leak, p, "kv.Prefix")
	return p, nil
}

// firstIDs returns the first granule id of each range that has one: what tells a
// loan's granules apart from those of any other loan on the same node.
func (l PrefixLoan) firstIDs() []uint64 {
	ids := make([]uint64, 0, len(l.ranges))
	for _, r := range l.ranges {
		if len(r.ids) > 0 {
			ids = append(ids, r.ids[0])
		}
	}
	return ids
}

// borrowedAlready reports whether a prefix this cache borrowed, and whose granules
// it still maps, names one of l's granules. c.mu is held.
func (c *Cache) borrowedAlready(l PrefixLoan) bool {
	ids := l.firstIDs()
	for p := range c.prefixes {
		for _, id := range p.loaned {
			if slices.Contains(ids, id) {
				return true
			}
		}
	}
	return false
}

// fits returns an error matching ErrLoan unless l is a loan of a prefix this cache
// could have frozen: the same fingerprint, and per group ranges alike whose
// committed granules run from the group's dropOff to its extent rounded up to the
// granule, as Freeze leaves a prefix of l's tokens.
func (c *Cache) fits(l PrefixLoan) error {
	model, err := TierNamespace(c.cfg, c.gran, "")
	if err != nil {
		return err
	}
	if l.model != model {
		return fmt.Errorf("%w: lent by a cache of another model, layout or granule (fingerprint %016x; this cache's %016x, model %q)", ErrLoan, l.model, model, c.cfg.Model.Name)
	}
	last := &c.groups[len(c.groups)-1]
	switch {
	case l.tokens > c.cfg.MaxTokens:
		return fmt.Errorf("%w: a prefix of %d tokens, past MaxTokens %d", ErrLoan, l.tokens, c.cfg.MaxTokens)
	case len(l.ranges) != last.first+last.nbuf:
		return fmt.Errorf("%w: %d ranges; a prefix of this cache has %d", ErrLoan, len(l.ranges), last.first+last.nbuf)
	case c.multi && len(l.held) != len(c.groups), !c.multi && l.held != nil:
		return fmt.Errorf("%w: the first held tokens of %d groups; the cache has %d", ErrLoan, len(l.held), len(c.groups))
	}
	for gi := range c.groups {
		g := &c.groups[gi]
		start, end := g.dropOff(l.tokens), 0
		if e, _ := backing.AlignUp(g.extent(l.tokens), c.gran); e > start {
			end = e
		} else {
			start = 0 // nothing committed
		}
		for i, r := range l.ranges[g.first : g.first+g.nbuf] {
			if n := len(r.ids); n == 0 && end != 0 || n > 0 && (r.start != start || r.start+n*c.gran != end) {
				return fmt.Errorf("%w: range %d of group %d lends %d granules from %d; a prefix of %d tokens commits [%d, %d) there",
					ErrLoan, g.first+i, gi, n, r.start, l.tokens, start, end)
			}
		}
		if c.multi {
			if h := l.held[gi]; g.windowed() && (h < g.heldFrom(start) || h > l.tokens) || !g.windowed() && h != 0 {
				return fmt.Errorf("%w: group %d holds its tokens from %d on, in a prefix of %d tokens", ErrLoan, gi, h, l.tokens)
			}
		}
	}
	return nil
}

// lends reports whether the cache's backing is a backing.Lender.
func (c *Cache) lends() bool {
	st, ok := c.st.(lendingStore)
	return ok && st.lends()
}

// number returns the process number of the cache's backing, a backing.Lender.
func (c *Cache) number() uint64 { return c.st.(lendingStore).number() }

// lendingStore is what Lend and BorrowPrefix use of a store.
type lendingStore interface {
	lends() bool
	number() uint64
}

func (st storeOf[R, B]) lends() bool {
	_, ok := any(st.b).(backing.Lender[R])
	return ok
}

func (st storeOf[R, B]) number() uint64 { return any(st.b).(backing.Lender[R]).Number() }

func (st storeOf[R, B]) String() string { return fmt.Sprintf("%T", st.b) }

// lendingBuffer is what Lend and BorrowPrefix use of a range on a backing.Lender.
type lendingBuffer interface {
	lend(off, size int, to uint64) ([]uint64, error)
	borrow(off int, ids []uint64) error
}

func (b bufferOf[R, B]) lend(off, size int, to uint64) ([]uint64, error) {
	ids, err := b.Lend(off, size, to)
	if errors.Is(err, arena.ErrNoLending) {
		err = fmt.Errorf("%w: %w", ErrNoLending, err)
	}
	return ids, err
}

func (b bufferOf[R, B]) borrow(off int, ids []uint64) error {
	err := b.BorrowRange(off, ids)
	if errors.Is(err, backing.ErrNotLent) {
		err = fmt.Errorf("%w: its lender gave it back before this borrow, or this process borrows it already: %w", ErrLoan, err)
	}
	return err
}
