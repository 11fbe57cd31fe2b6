package kv

import (
	"errors"
	"slices"
	"sync"

	"github.com/vmarena/vmarena/backing"
)

// pcLive is what a live sequence (or a prefix) maps of the cache's granules: set by
// Lookup and Insert, passed on to forks, frozen prefixes and the sequences started on
// them (inherit), dropped by Sequence.Close and a prefix's last release. A sequence
// that shares granules the cache does not hold yet (Fork, Freeze) counts them too, by
// references no entry holds (sharing), so that an entry inserted afterwards sees every
// holder that maps them.
type pcLive struct {
	pc    *PrefixCache
	grefs []*granuleRef
	entry *pcEntry // the last entry Insert made from the sequence, or nil (pc.mu)
	// lazy is the entries that refer to the sequence's ranges (pc.mu; see pcEntry).
	lazy []*pcEntry
	// origin: an entry referred to the sequence's ranges once. Read and written by the
	// sequence's owner only; from then on its calls that resize or protect its ranges
	// hold mu, which a lookup mapping from them holds too.
	origin bool
	lazyN  int // owner's too: at least the tokens of every lazy entry referring to it
	mu     sync.Mutex
	// protected is the bytes at the start of each range that lookups made read-only
	// in the sequence's own mapping (mu).
	protected int
}

// protectFrom makes the first full bytes of each of s's ranges read-only in s's own
// mapping, where the backing can protect memory in place, before a lookup maps them
// into another sequence: an origin's stray write through Bytes or a View then faults
// rather than reach the sequences started on it. One call per range, for what earlier
// lookups did not protect yet. l.mu is held; on error nothing changed.
func (l *pcLive) protectFrom(s *Sequence, full int) error {
	if !s.c.protector || full <= l.protected {
		return nil
	}
	for i, b := range s.bufs {
		if err := b.protect(l.protected, full-l.protected, backing.ReadOnly); err != nil {
			var errs []error
			for _, q := range s.bufs[:i] {
				if rerr := q.protect(l.protected, full-l.protected, backing.ReadWrite); rerr != nil {
					errs = append(errs, rerr)
				}
			}
			return errors.Join(append([]error{err}, errs...)...)
		}
	}
	l.protected = full
	return nil
}

// inherit returns what a fork or a frozen prefix that maps the first k sharing units
// of the ranges l belongs to (s's, or a prefix's when s is nil) maps of the cache's
// granules, counted as mapped by one more holder, or nil when it maps none: so that
// eviction does not count on them, nor a miss take over their entry's ranges, while
// the new holder lives. Only the owner of those ranges calls it.
func (l *pcLive) inherit(s *Sequence, k int) *pcLive {
	pc := l.pc
	pc.mu.Lock()
	defer pc.mu.Unlock()
	grefs := slices.Clone(l.grefs[:min(len(l.grefs), k)])
	if s != nil && len(grefs) == len(l.grefs) && len(grefs) < k {
		// s's granule past those it maps may be a lazy entry's partly filled tail.
		if g := pc.lazyTailAt(s, len(grefs)); g != nil {
			grefs = append(grefs, g)
		}
	}
	if len(grefs) == 0 {
		return nil
	}
	for _, g := range grefs {
		g.live++
	}
	return &pcLive{pc: pc, grefs: grefs}
}

// sharing readies s, whose first k sharing units a fork or a frozen prefix is about to
// map, for inherit: where c has a prefix cache, s's pcLive counts s's mapping of each of
// them, those the cache does not hold yet by references of their own. An entry that
// Insert makes later, from s or from the new holder, then holds those references, and
// so counts the holder as mapping its granules until the holder drops them: eviction
// does not count on them, nor a miss take over their entry's ranges. Only s's owner
// calls it, once s shares them.
func (s *Sequence) sharing(k int) {
	if s.pcl == nil {
		pc := s.c.pc.Load()
		if pc == nil || k == 0 {
			return
		}
		s.pcl = &pcLive{pc: pc}
	}
	l := s.pcl
	pc := l.pc
	if pc != s.c.pc.Load() {
		return // a record of an earlier prefix cache, closed since: Insert refuses s
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if k <= len(l.grefs) {
		return
	}
	from := len(l.grefs)
	l.grefs = slices.Grow(l.grefs, k-from)
	fresh := make([]granuleRef, k-from) // one allocation for s's own granules
	for j := from; j < k; j++ {
		g := pc.lazyTailAt(s, j)
		if g != nil {
			// A lazy entry of s holds granule j as its partly filled tail: from now
			// on l.grefs counts s's mapping of it, as Insert does.
			pc.untail(s, g)
		} else {
			g = &fresh[j-from]
			g.live = 1
		}
		l.grefs = append(l.grefs, g)
	}
}

// dropLive forgets what a closing sequence mapped.
func (l *pcLive) drop() {
	l.pc.mu.Lock()
	for _, g := range l.grefs {
		g.live--
	}
	l.grefs = nil
	l.pc.mu.Unlock()
}

// rangesLock returns the lock that s's calls resizing or protecting its ranges must
// hold (see pcLive), or nil when no entry ever referred to them. Only s's owner calls
// it.
func (s *Sequence) rangesLock() *sync.Mutex {
	if s.pcl == nil || !s.pcl.origin {
		return nil
	}
	return &s.pcl.mu
}

// beforeChange readies s to change its tokens from t on (a Truncate to t, a write of
// token t): lazy entries that hold those tokens get ranges of their own first. The
// lock from rangesLock is held.
func (s *Sequence) beforeChange(t int) {
	if l := s.pcl; l != nil && t < l.lazyN {
		l.pc.materialize(s, t)
		l.lazyN = t
	}
}

// unprotectPast forgets the protection of what s gave up (a Truncate). The lock from
// rangesLock is held.
func (l *pcLive) unprotectPast(s *Sequence) { l.protected = min(l.protected, s.frozen) }

// dropPast forgets the cache's granules that s no longer maps (a Truncate gave them
// up: only those below s's frozen bytes are still the cache's), so that they count as
// mapped by no live sequence for eviction and PinnedBytes. Only s's owner calls it.
func (l *pcLive) dropPast(s *Sequence) {
	keep := s.frozen / s.c.unit
	l.pc.mu.Lock()
	if e := l.entry; e != nil && s.frozen < s.c.shareable(e.n) {
		// s gave up granules the entry maps, and may write their tokens anew: its
		// ranges can not stand for the entry's when it closes (see adopt), even once
		// a later fork or freeze shares them again.
		l.entry = nil
	}
	if keep < len(l.grefs) {
		for _, g := range l.grefs[keep:] {
			g.live--
		}
		l.grefs = l.grefs[:keep]
	}
	l.pc.mu.Unlock()
}

// beforeWrite is beforeChange for a write of token t, taking the ranges' lock.
func (s *Sequence) beforeWrite(t int) {
	if l := s.pcl; l != nil && t < l.lazyN {
		mu := &l.mu
		mu.Lock()
		s.beforeChange(t)
		mu.Unlock()
	}
}
