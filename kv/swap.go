package kv

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/kv/tierval"
)

// Swap on preemption: a scheduler short of memory moves a live sequence's bytes into a
// Tier and frees its granules (Cache.SwapOut), then brings them back into a new
// sequence when memory allows (Cache.SwapIn), instead of recomputing its prefill.
//
// What moves: in each range of each group, the committed bytes from the range's
// Start to the group's extent of the sequence's tokens: every token a full or MLA
// group holds, what a window group still holds (its live window: the units below it
// were given back already and are not kept), a recurrent group's states. The swapped
// copy is cut into values of at most swapChunk bytes, each written with tierval's
// format (Encode, or EncodeInProcess into an InProcessTier) under a key of the swap's
// own namespace: SHA-256 over a header of its own, the cache's TierNamespace and 16
// random bytes drawn for the swap, so that no swap's value is another's or a prefix
// cache's block. A value read back is checked (Decode, DecodeInProcess) before any of
// its bytes is written, and one that fails is an error of SwapIn, never served.
//
// The states of a Swapped:
//
//  1. Held: its values are in the tier. SwapOut makes it so, and a SwapIn that
//     fails leaves it so (nothing of the failed swap-in is left committed).
//  2. Busy: a SwapIn of it runs.
//  3. In: a SwapIn brought it back into a new sequence and deleted its values.
//  4. Dropped: Drop deleted its values.
//
// The budget sees both ways: SwapOut closes the sequence (its granules go back as
// Close gives them back), SwapIn charges the new sequence's granules before it
// loads, waiting for them in the governor's FIFO queue as AppendCtx does.

// swapChunk is the most bytes of one value of a swap, its header included: large enough that a tier's
// per-value work is lost in the copy, small enough for any tier's value (Redis takes
// 512 MiB). A variable only so that tests can cut a small sequence into several.
var swapChunk = 8 << 20

// ErrSwap: a swap asked of what can not be swapped: a nil sequence or tier, a
// sequence or handle of another cache, a handle swapped in already, being swapped in
// or dropped.
var ErrSwap = errors.New("kv: invalid swap")

// ErrSwapLost: a swapped copy's value could not be read back whole from its tier: a
// tier that no longer holds it (it evicted it: give swaps a tier with room, or one
// that refuses rather than evicts, hosttier's NoEvict), or one that fails its check
// (the error wraps tierval.ErrValue and its kind then). The copy is not served.
var ErrSwapLost = errors.New("kv: swapped copy lost")

// Swapped is a sequence that Cache.SwapOut moved into a tier: its tokens' bytes, held
// by the tier, and what the cache needs to lay them out again. A server keeps it with
// the preempted request and passes it to Cache.SwapIn to resume the request, or MUST
// Drop it when the request is abandoned (its values stay in the tier until then). A
// Swapped is safe for concurrent use; only one SwapIn of it succeeds.
type Swapped struct {
	c      *Cache
	tier   Tier
	inProc bool
	ns     uint64
	n      int
	bytes  int64
	parts  []swapPart
	// starts and ends are each range's Start and the end of its tokens' bytes, as
	// the swapped sequence had them; helds the first token each group held (nil in
	// a one-group cache).
	starts, ends []int
	helds        []int

	leak invariants.Tracker // reports it collected neither swapped in nor dropped, in the invariants build

	mu    sync.Mutex
	state swapState
}

type swapState uint8

const (
	swapHeld swapState = iota
	swapBusy
	swapIn
	swapDropped
)

// swapPart is one value of a swap: bytes [off, off+size) of the sequence's range buf.
type swapPart struct {
	buf, off, size int
}

// Len returns the tokens of the swapped sequence.
func (h *Swapped) Len() int { return h.n }

// Bytes returns the bytes of K/V (and states) the swapped copy holds, without the
// values' headers: what SwapOut copied out and SwapIn copies back.
func (h *Swapped) Bytes() int64 { return h.bytes }

// Tier returns the tier that holds the swapped copy.
func (h *Swapped) Tier() Tier { return h.tier }

// key returns the key of value i of the swap.
func (h *Swapped) key(i int) tierval.Key { return tierval.Key{Namespace: h.ns, Hash: uint64(i)} }

// SwapOut moves s into tier and closes it: every byte s holds (what a window group
// still holds; a recurrent group's states) is copied into values of tier, and once all
// are stored s is closed as Close closes it, its granules given back. It returns the
// handle that SwapIn takes to bring the tokens back; a server calls it to preempt a
// request when memory runs short, rather than recompute it later. s MUST be owned by
// the calling goroutine; other sequences read and write on meanwhile. A sequence
// started on a Prefix or a prefix cache's hit is copied whole: the new sequence of
// SwapIn owns every byte and maps nothing.
//
// On an error nothing changed: s is as it was, and no value of the swap is left in the
// tier (but one whose Delete failed, which the tier then holds under a key no one
// asks). It fails with an error matching ErrSwap for a nil s or tier or an s of another
// cache, ErrClosed for an s closed already, ErrDamaged for a damaged one, and with the
// tier's error (ctx's among them) when a store fails. Where s's release was not
// complete (Close's outcome; Stats.Unreleased counts it) the swap is made and the
// error says so beside the handle.
func (c *Cache) SwapOut(ctx context.Context, s *Sequence, tier Tier) (*Swapped, error) {
	if ctx == nil {
		panic(panicNilContext)
	}
	switch {
	case s == nil:
		return nil, fmt.Errorf("%w: swap out of a nil sequence", ErrSwap)
	case tier == nil:
		return nil, fmt.Errorf("%w: swap out into a nil tier", ErrSwap)
	case s.c != c:
		return nil, fmt.Errorf("%w: sequence %d belongs to another cache", ErrSwap, s.id)
	case s.closed:
		return nil, fmt.Errorf("%w: swap out of sequence %d, closed already", ErrClosed, s.id)
	}
	if err := s.usable(); err != nil {
		return nil, err
	}
	ns, err := c.swapNamespace()
	if err != nil {
		return nil, err
	}
	h := &Swapped{c: c, tier: tier, inProc: inProcess(tier), ns: ns, n: s.n, helds: s.helds(),
		starts: make([]int, len(s.bufs)), ends: make([]int, len(s.bufs))}
	// NB: a value of a whole chunk is swapChunk bytes, its header included, so that a
	// tier of granules of a power of two wastes none.
	chunk := swapChunk - tierval.HeaderSize
	for gi := range c.groups {
		g := &c.groups[gi]
		hi := g.extent(s.n)
		for j, b := range g.ranges(s.bufs) {
			i := g.first + j
			h.starts[i], h.ends[i] = b.Start(), hi
			for off := b.Start(); off < hi; off += chunk {
				size := min(chunk, hi-off)
				h.parts = append(h.parts, swapPart{buf: i, off: off, size: size})
				h.bytes += int64(size)
			}
		}
	}
	encode := tierval.Encode
	if h.inProc {
		encode = tierval.EncodeInProcess
	}
	for i, p := range h.parts {
		key, buf := h.key(i), s.bufs[p.buf]
		err := tier.Store(ctx, key, tierval.Size(0, p.size), func(dst []byte) error {
			return encode(dst, key, nil, p.size, func(payload []byte) error {
				return buf.readAt(p.off, payload)
			})
		})
		if err != nil {
			err = fmt.Errorf("kv: swap out of sequence %d into tier %q: value %d of %d: %w", s.id, tier.Name(), i, len(h.parts), err)
			return nil, errors.Join(err, h.deleteFirst(context.WithoutCancel(ctx), i))
		}
	}
	invariants.Track(&h.leak, h, "kv.Swapped")
	if out := s.Close(); !out.OK() {
		return h, fmt.Errorf("kv: swap out of sequence %d: its release was not complete: %w", s.id, releaseError(out))
	}
	return h, nil
}

// swapNamespace returns a new swap's tier namespace (see the top of this file).
func (c *Cache) swapNamespace() (uint64, error) {
	base, err := TierNamespace(c.cfg, c.gran, "")
	if err != nil {
		return 0, err
	}
	b := make([]byte, 0, 64)
	b = append(b, "vmarena kv swap namespace v1\x00"...)
	b = binary.LittleEndian.AppendUint64(b, base)
	var nonce [16]byte
	_, _ = rand.Read(nonce[:]) // NB: crypto/rand.Read never fails (Go 1.24)
	b = append(b, nonce[:]...)
	sum := sha256.Sum256(b)
	return binary.LittleEndian.Uint64(sum[:8]), nil
}

// deleteFirst deletes the swap's values [0, n) from its tier and returns what failed.
func (h *Swapped) deleteFirst(ctx context.Context, n int) error {
	var errs []error
	for i := range n {
		if err := h.tier.Delete(ctx, h.key(i)); err != nil {
			errs = append(errs, fmt.Errorf("kv: deleting value %d of a swap from tier %q: %w", i, h.tier.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// SwapIn returns a new sequence holding what h holds: the tokens of the sequence that
// SwapOut moved into h's tier, bit-exact, each group holding what it held (a window
// group its live window). It commits the granules first, charged to the budget as an
// append's: where the memory can not be had now it evicts cached prefixes, then waits
// in the governor's FIFO queue of the device until ctx ends, as AppendCtx does (a
// swap larger than the device's whole limit fails at once with ErrExceedsLimit). Then
// it loads every value, checked before its bytes are written, and deletes them from
// the tier. The new sequence MUST be closed.
//
// On an error nothing of the swap-in is left (no sequence, no granule) and h still
// holds the copy, to be swapped in again or dropped: a cancelled wait returns
// ctx.Err(); a value the tier no longer holds, or one that fails its check, an error
// matching ErrSwapLost (and tierval.ErrValue for a failed check); a closed cache
// ErrClosed. A nil h, one of another cache, one swapped in already, being swapped in
// or dropped fails with ErrSwap.
func (c *Cache) SwapIn(ctx context.Context, h *Swapped) (*Sequence, error) {
	if ctx == nil {
		panic(panicNilContext)
	}
	if h == nil {
		return nil, fmt.Errorf("%w: swap in of a nil handle", ErrSwap)
	}
	if h.c != c {
		return nil, fmt.Errorf("%w: the swapped copy belongs to another cache", ErrSwap)
	}
	if err := h.take(); err != nil {
		return nil, err
	}
	s, err := c.swapIn(ctx, h)
	h.mu.Lock()
	if err != nil {
		h.state = swapHeld
	} else {
		h.state = swapIn
		h.leak.Close()
	}
	h.mu.Unlock()
	if err != nil {
		return nil, err
	}
	// NB: a value whose Delete fails stays in the tier under a key no one asks again;
	// the sequence is whole, so that is no error of the swap-in.
	_ = h.deleteFirst(context.WithoutCancel(ctx), len(h.parts))
	return s, nil
}

// take moves h from Held to Busy, or returns why it can not.
func (h *Swapped) take() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch h.state {
	case swapBusy:
		return fmt.Errorf("%w: the swapped copy is being swapped in", ErrSwap)
	case swapIn:
		return fmt.Errorf("%w: the swapped copy was swapped in already", ErrSwap)
	case swapDropped:
		return fmt.Errorf("%w: the swapped copy was dropped", ErrSwap)
	}
	h.state = swapBusy
	return nil
}

// swapIn is SwapIn of h, which this call holds Busy.
func (c *Cache) swapIn(ctx context.Context, h *Swapped) (*Sequence, error) {
	s, err := c.newSequence()
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Sequence, error) {
		return nil, errors.Join(err, c.abandon(s))
	}
	var need int64
	for i, b := range s.bufs {
		if h.starts[i] > 0 {
			if err := b.StartAt(h.starts[i]); err != nil {
				return fail(err)
			}
		}
		size, _ := backing.AlignUp(h.ends[i], c.gran)
		need += int64(max(size-h.starts[i], 0))
	}
	if err := c.swapCommit(ctx, s, h.ends, need); err != nil {
		return fail(err)
	}
	decode := tierval.Decode
	if h.inProc {
		decode = tierval.DecodeInProcess
	}
	for i, p := range h.parts {
		key, buf := h.key(i), s.bufs[p.buf]
		err := h.tier.Load(ctx, key, func(src []byte) error {
			payload, err := decode(src, key, nil, p.size)
			if err != nil {
				return err
			}
			return buf.writeAt(p.off, payload)
		})
		if err != nil {
			if errors.Is(err, ErrTierMiss) || errors.Is(err, tierval.ErrValue) {
				err = fmt.Errorf("%w: value %d of %d from tier %q: %w", ErrSwapLost, i, len(h.parts), h.tier.Name(), err)
			} else {
				err = fmt.Errorf("kv: swap in from tier %q: value %d of %d: %w", h.tier.Name(), i, len(h.parts), err)
			}
			return fail(err)
		}
	}
	s.n = h.n
	for gi := range s.gs {
		s.gs[gi].held = h.helds[gi]
	}
	s.refreshStats()
	c.register(s)
	return s, nil
}

// swapCommit resizes s's ranges to end, need bytes of new granules, charged as a
// growth is: cached prefixes evicted before a refusal, then a wait in the governor's
// queue within ctx (see Cache.wait, which this follows for one sequence). A commit
// that fails gives back what it committed.
func (c *Cache) swapCommit(ctx context.Context, s *Sequence, end []int, need int64) error {
	commit := func(credit int64) error {
		if need > 0 && c.ahead != nil {
			defer c.ahead.hold(need, credit)()
		}
		if be := c.budgetOrEvict(need, credit); be != nil {
			return c.refuse(be)
		}
		for i, b := range s.bufs {
			if end[i] == 0 {
				continue
			}
			if err := b.Resize(end[i]); err != nil {
				for _, b := range s.bufs[:i+1] {
					// NB: back to empty at its start; a range that can not is given
					// back whole by abandon, with its outcome.
					_ = b.Resize(b.Start())
				}
				return c.refused(err)
			}
		}
		return nil
	}
	err := commit(0)
	for accounting.CanWait(err) {
		var be *accounting.BudgetError
		if !errors.As(err, &be) {
			return err
		}
		want := max(be.Requested+min(be.Held, c.idle()), int64(c.gran))
		var stepErr error
		err = c.auth.AcquireFor(ctx, want, func(idle int64) error {
			stepErr = commit(want - idle)
			return nil
		})
		switch {
		case err == nil:
			err = stepErr
		case ctx.Err() != nil:
			return ctx.Err()
		}
	}
	return err
}

// Drop deletes h's values from its tier: the server abandons the request that SwapOut
// preempted. It returns what the tier failed to delete (those values stay there under
// keys no one asks again). Dropping a copy swapped in already, or dropped, does
// nothing; one being swapped in fails with ErrSwap.
func (h *Swapped) Drop() error {
	h.mu.Lock()
	switch h.state {
	case swapBusy:
		h.mu.Unlock()
		return fmt.Errorf("%w: drop of a swapped copy being swapped in", ErrSwap)
	case swapIn, swapDropped:
		h.mu.Unlock()
		return nil
	}
	h.state = swapDropped
	h.leak.Close()
	h.mu.Unlock()
	return h.deleteFirst(context.Background(), len(h.parts))
}
