package kv

import (
	"context"
	"errors"
)

// A lookup whose tier loads run in the background (LookupAsync). Lookup loads from the
// tiers in the caller's goroutine: a scheduler that admits a request waits there for
// the tiers' reads (a Redis round trip per block, a file's direct read), up to
// TierWait, with no step of any other request run meanwhile. LookupAsync maps the
// device's part of the hit in the caller's goroutine, as Lookup does (its memory is
// counted, the entry it maps from held), and starts the loads on a goroutine of their
// own: the scheduler goes on with its other requests' steps, and prefills this
// request once the loads end, from the tokens they loaded. The loads themselves are
// Lookup's, block by block, each value checked before its bytes are copied, within
// TierWait and TierLoads; the caller's context ends them early, at the next block,
// keeping the blocks loaded before it. Hits, the tiers' counts and the entry's reuse
// are counted when the loads end, as Lookup counts them when it returns.

// PendingLookup is a lookup whose loads from the prefix cache's tiers run in the
// background (PrefixCache.LookupAsync). Its sequence is the caller's only once Wait
// returns it, and MUST then be closed, as a Lookup's: a server that drops the request
// meanwhile cancels the context it passed and still calls Wait. Its methods are safe
// to call from any goroutine.
type PendingLookup struct {
	device int
	done   chan struct{}
	// Set before done is closed, read only after.
	s *Sequence
	m int
}

// Device returns the tokens the lookup matched on the device: mapped before
// LookupAsync returned, so at least these are the sequence's when Wait returns.
func (p *PendingLookup) Device() int { return p.device }

// Done returns a channel closed once the loads ended, when Wait no longer waits: for a
// scheduler's select.
func (p *PendingLookup) Done() <-chan struct{} { return p.done }

// Wait waits for the loads to end and returns what Lookup would have: the sequence,
// holding the prompt's first m tokens (the device's match and, after it, the whole
// blocks the tiers held and the loads read and checked before they ended, exactly
// those), and m. The caller writes the rest of the prompt from m on, as after Lookup.
// It returns the same sequence every time it is called; the sequence is closed once.
func (p *PendingLookup) Wait() (*Sequence, int) {
	<-p.done
	return p.s, p.m
}

// LookupAsync is LookupIn whose loads from the tiers (PrefixCacheOptions.Tiers) run on
// a goroutine of their own: it returns once the device's match is mapped, and the
// PendingLookup's Wait returns the sequence and its length once the loads end. ctx
// ends the loads early (the blocks loaded before it stay the sequence's, and the rest
// of the prompt is the caller's to prefill); cancelling it is not a drop of a tier.
// Without tiers, or with no whole tier block past the device's match, nothing is left
// to load and the PendingLookup is done when it returns. Errors are LookupIn's, all
// returned here with nothing changed: Wait has none. The cache's Close waits for the
// loads to end (each within TierWait). tokens is not kept: the caller may change it
// once LookupAsync returns. A nil ctx panics.
func (pc *PrefixCache) LookupAsync(ctx context.Context, ns Namespace, tokens []int32) (*PendingLookup, error) {
	if ctx == nil {
		panic("kv: PrefixCache.LookupAsync with a nil Context")
	}
	for {
		h, err := pc.find(ns, tokens)
		if err != nil {
			return nil, err
		}
		s, err := pc.start(h)
		p := &PendingLookup{device: h.m, done: make(chan struct{})}
		if limit := pc.matchable(tokens); err == nil && pc.tiers.asks(h.m, limit) {
			// The loads read no token past limit, and settle only the count.
			go p.load(ctx, pc, h, s, ns, append([]int32(nil), tokens[:limit]...), len(tokens))
			return p, nil
		}
		pc.settle(h, s, err, len(tokens))
		pc.working.Done()
		if errors.Is(err, errEntryGone) {
			continue // as LookupIn
		}
		if err != nil {
			return nil, err
		}
		p.s, p.m = s, h.m
		close(p.done)
		return p, nil
	}
}

// load is a PendingLookup's goroutine: it loads into s, the new sequence of the
// lookup that found h, what the tiers hold of tokens past h.m, settles the lookup (of
// queried tokens), makes p done, and only then ends the lookup in pc.working (which
// find began), so that a Close that waited for it finds p done.
func (p *PendingLookup) load(ctx context.Context, pc *PrefixCache, h hit, s *Sequence, ns Namespace, tokens []int32, queried int) {
	h.m = pc.tiers.loadFor(ctx, ns, s, tokens, h.m, len(tokens))
	pc.settle(h, s, nil, queried)
	p.s, p.m = s, h.m
	close(p.done)
	pc.working.Done()
}
