package kv

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Prefix is the immutable K and V of a sequence's first tokens (a system prompt, a
// few-shot header), shared by mapping its physical granules into every sequence that
// starts on it. It is reference-counted: its creator holds one reference, each
// sequence started on it another; it is freed with the last. A server makes one
// (Sequence.Freeze) for a prefix it knows many requests share; a PrefixCache manages
// its shared prefixes without one.
type Prefix struct {
	_ nocopy.NoCopy

	c      *Cache
	leak   invariants.Tracker // reports it collected unclosed in the invariants build
	bufs   []buffer
	tokens int
	// firstHeld is the first token each group's ranges hold (heldOn; nil in a
	// one-group cache): a sequence started on the prefix holds its tokens from there.
	firstHeld []int
	pcl       *pcLive // what it maps of a PrefixCache's granules, or nil: the prefix cache's slot, which only its files read or write
	// loaned: for a prefix borrowed from another process (Cache.BorrowPrefix), the
	// first granule id of each range that has one; nil for one frozen here.
	loaned []uint64

	// guarded by c.mu
	refs    int
	creator bool // the creator's reference is still held
}

// Len returns the prefix's tokens: a request's tokens from there on are its own, to
// append to a sequence started on the prefix.
func (p *Prefix) Len() int { return p.tokens }

// The accessors below mirror the seed's SharedDevicePrefix (onnx_runtime_memory_api,
// src/allocator.rs: device_ptr, committed_physical_bytes, mapped_bytes,
// requested_bytes). Each panics ("kv: Prefix used after Release") once the creator released p.

// Base returns the first address of layer's K or V tensor in the prefix's own ranges
// (its token 0): where the prefix's K and V lie, written once when it was frozen and
// never again. A kernel that reads the shared prefix once for all the sequences on it
// starts there. It does not change while the prefix lives. On a device it must not be
// dereferenced by the CPU. It panics ("kv: layer or kind out of range") for a layer or
// kind that does not exist.
func (p *Prefix) Base(layer int, kind Kind) uintptr {
	p.held()
	return p.c.tensorBase(p.bufs, layer, kind)
}

// tensorBase returns the first address of layer's K or V tensor in the ranges bufs of
// a sequence or a prefix, panicking with panicLayerRange for one that does not exist.
func (c *Cache) tensorBase(bufs []buffer, layer int, kind Kind) uintptr {
	_, i, off, ok := c.where(layer, kind)
	if !ok {
		panic(panicLayerRange)
	}
	return bufs[i].Base() + uintptr(off)
}

// Committed returns the physical bytes the prefix holds, all ranges together: the
// granules its tokens occupy, counted once however many sequences map them (the
// cache's ledger owns them once). It is the prefix's physical cost, never its
// tokens' bytes: what a server logs or weighs when it decides to keep the prefix.
func (p *Prefix) Committed() int64 {
	p.held()
	var n int64
	for _, b := range p.bufs {
		n += int64(b.Committed())
	}
	return n
}

// Mapped returns the granule-rounded bytes the prefix's tokens span, all ranges
// together: Requested rounded up to whole granules (whole blocks in the Blocked
// layout) in each range: what each sequence on it maps, for logs.
//
// On a Model a window group's ranges span its units from the one that holds its
// FirstLive(Len) on, the ones the prefix holds.
func (p *Prefix) Mapped() int64 {
	p.held()
	if len(p.c.groups) == 1 {
		span, _ := backing.AlignUp(p.c.extent(p.tokens), p.c.gran)
		return int64(len(p.bufs)) * int64(span)
	}
	var n int64
	for gi := range p.c.groups {
		g := &p.c.groups[gi]
		span, _ := backing.AlignUp(g.extent(p.tokens), p.c.gran)
		n += int64(g.nbuf) * int64(span-g.dropOff(p.tokens))
	}
	return n
}

// Requested returns the bytes of the prefix's tokens before any rounding: Len times
// the model's BytesPerToken. On a model with window groups a window group
// counts its live tokens only, from its FirstLive(Len) on: the ones a prefix keeps.
// Against Mapped, it says what rounding to granules costs, for logs.
func (p *Prefix) Requested() int64 {
	p.held()
	if !p.c.windows {
		return int64(p.tokens) * int64(p.c.bpt)
	}
	var n int64
	for gi := range p.c.groups {
		g := &p.c.groups[gi]
		n += int64(p.tokens-g.spec.FirstLive(p.tokens)) * int64(g.bpt)
	}
	return n
}

// held panics with panicPrefixReleased once the creator released p.
func (p *Prefix) held() {
	p.c.mu.Lock()
	ok := p.creator
	p.c.mu.Unlock()
	if !ok {
		panic(panicPrefixReleased)
	}
}

// Release drops the creator's reference. The prefix's memory is freed now if no
// sequence started on it is still live, else with the last of them: a server
// releases it when no new request will start on it (the system prompt changed, or
// shutdown). Releasing twice panics ("kv: Prefix used after Release").
func (p *Prefix) Release() {
	p.c.mu.Lock()
	if !p.creator {
		p.c.mu.Unlock()
		panic(panicPrefixReleased)
	}
	p.creator = false
	p.c.mu.Unlock()
	p.leak.Close()
	p.unref()
}

// ref takes a reference for a new sequence; it fails once the creator released it
// and so no new sequence may start on it.
func (p *Prefix) ref() bool {
	p.c.mu.Lock()
	defer p.c.mu.Unlock()
	if !p.creator {
		return false
	}
	p.refs++
	return true
}

func (p *Prefix) unref() {
	p.c.mu.Lock()
	p.refs--
	if invariants.Enabled {
		p.checkRefs()
	}
	last := p.refs == 0
	p.c.mu.Unlock()
	if last {
		// NB: what can not be given back now is kept by the cache and retried by
		// Cache.Close. The prefix leaves the cache only after, so Close can not slip
		// in between.
		p.c.release(p.bufs)
		if h := p.c.hooks(); h != nil {
			h.released(p)
		}
		p.c.mu.Lock()
		delete(p.c.prefixes, p)
		p.c.mu.Unlock()
	}
}

// NewSequenceFrom returns a sequence that starts on prefix p, for a request whose
// prompt starts with p's tokens: p's full granules (full
// blocks in the Blocked layout) are mapped read-only into it (owned once, whatever
// maps them), and the tokens past them are copied into the sequence's own granule
// (block). The sequence holds a reference to p until it is closed. It MUST be closed.
// When the copied tail's granules can not be had, it evicts cached prefixes before it
// refuses with an *accounting.BudgetError, as ForkAt does.
func (c *Cache) NewSequenceFrom(p *Prefix) (*Sequence, error) {
	if p == nil {
		panic(panicNilPrefix)
	}
	if p.c != c {
		return nil, fmt.Errorf("%w: the prefix belongs to another cache", ErrConfig)
	}
	if !p.ref() {
		panic(panicPrefixReleased)
	}
	if err := c.shareBudget(p.tokens); err != nil {
		p.unref()
		return nil, err
	}
	fulls, held := make([]int, len(c.groups)), make([]int, len(c.groups))
	s, err := evicting(c, func() (*Sequence, error) {
		s, err := c.newSequence()
		if err != nil {
			return nil, err
		}
		if err := c.shareGroups(s.bufs, p.bufs, p.firstHeld, p.tokens, fulls, held); err != nil {
			return nil, errors.Join(err, c.abandon(s))
		}
		return s, nil
	})
	if err != nil {
		p.unref()
		return nil, err
	}
	s.startShared(p.tokens, fulls, held)
	s.prefix = p
	if h := c.hooks(); h != nil {
		h.startedOn(s, p, fulls)
	}
	s.refreshStats()
	c.register(s)
	return s, nil
}

// sequenceOn returns a new sequence holding src's first n tokens: the whole granules
// mapped read-only, the rest copied, as ForkAt does. Unlike ForkAt it leaves src as it
// is (an entry is never written, and many lookups read it at once). With held, a
// window group's new ranges start where src's do (every unit src still holds below
// n) rather than at the unit that holds FirstLive(n): what a prefix cache entry
// keeps of an inserted sequence; and below, when not nil, gives the whole units
// under those that another holder of the same tokens holds (shareGroupsFrom); st says
// where its recurrent states come from.
func (c *Cache) sequenceOn(src *Sequence, n int, held bool, below *Sequence, st stateSrc) (*Sequence, error) {
	s, err := c.newSequence()
	if err != nil {
		return nil, err
	}
	fulls, firstHeld := make([]int, len(c.groups)), make([]int, len(c.groups))
	if err := c.shareGroupsFrom(s.bufs, src.bufs, src.helds(), n, fulls, firstHeld, held, below, st); err != nil {
		return nil, errors.Join(err, c.abandon(s))
	}
	s.startShared(n, fulls, firstHeld)
	s.refreshStats()
	c.register(s)
	return s, nil
}

// prefixable returns an error matching ErrConfig when c is on a Model that has a
// Recurrent group: a prefix of it (Freeze) would need the state after its own
// tokens, which the cache does not keep.
func (c *Cache) prefixable(op string) error {
	for i := range c.groups {
		if c.groups[i].spec.Kind == Recurrent {
			return fmt.Errorf("%w: %s needs a model without recurrent groups (a state is a function of every token, which a prefix can not restore); model %q has %s", ErrConfig, op, c.cfg.Model.Name, groupKinds(c.cfg.Model))
		}
	}
	return nil
}
