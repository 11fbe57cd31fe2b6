package kv

// prefixHooks is the one seam between the core (Cache, Sequence, Prefix) and the
// prefix cache: what the core tells it before and after it changes a sequence's
// ranges, shares them, closes them, or is about to refuse a growth for budget. The
// core calls these and nothing else of the prefix cache, and never reads its state;
// the prefix cache calls the core (it makes, resizes and closes sequences), never the
// other way round. A cache gets them with its first PrefixCache (Cache.prefixHooks)
// and keeps them after that one closes, since its sequences may still map the
// granules it counted. Every method is a no-op for a sequence or prefix that maps
// none of a prefix cache's granules.
//
// Locks: lockRanges takes, and unlockRanges releases, the lock that a lookup mapping
// from s's ranges holds (see the package doc's Concurrency); every other method takes
// what it needs itself and releases it before it returns. The caller holds no lock of
// the cache's (c.mu) on any call.
type prefixHooks interface {
	// lockRanges takes the lock under which s's ranges may be resized or protected
	// (none while no entry refers to them); unlockRanges releases it. Only s's owner
	// calls them, in pairs, in one function.
	lockRanges(s *Sequence)
	unlockRanges(s *Sequence)
	// truncating runs truncate, which cuts s to n tokens and returns the sharing unit
	// it replaced by a copy of the sequence's own (or -1), with s's ranges locked: the
	// lazy entries that hold s's tokens from n on get ranges of their own first, and
	// the books follow what truncate gave up afterwards.
	truncating(s *Sequence, n int, truncate func() (replaced int, err error)) error
	// beforeWrite: s is about to write its tokens from t on.
	beforeWrite(s *Sequence, t int)
	// forked: child (a fork) or pr (a frozen prefix) maps s's first n tokens from
	// now on: the first fulls[gi] bytes of each of group gi's ranges, a window
	// group's from its dropOff(n) on (shareGroups).
	forked(s *Sequence, n int, fulls []int, child *Sequence, pr *Prefix)
	// startedOn: s (new) maps what p shares from now on: the first fulls[gi] bytes
	// of each of group gi's ranges, a window group's from its dropOff(p's tokens) on.
	startedOn(s *Sequence, p *Prefix, fulls []int)
	// windowGaveBack: a window group of s gave back the units below its ranges' Start.
	windowGaveBack(s *Sequence)
	// closing: s is about to give back its ranges. It returns the ranges to give back
	// in their place and true when a prefix cache entry took s's over.
	closing(s *Sequence) ([]buffer, bool)
	// closed: s gave back its ranges (Close); released: p's last reference went.
	closed(s *Sequence)
	released(p *Prefix)
	// shortfall: a growth is need bytes short of the budget. It evicts what it can
	// toward them and returns the bytes that came back.
	shortfall(need int64) int64
	// evictable returns the bytes eviction could give back now.
	evictable() int64
}

// hooks returns the cache's prefix hooks, or nil before its first PrefixCache.
func (c *Cache) hooks() prefixHooks {
	if h := c.ph.Load(); h != nil {
		return *h
	}
	return nil
}

// lockRanges takes the lock under which s's ranges may change (see prefixHooks).
func (s *Sequence) lockRanges() {
	if h := s.c.hooks(); h != nil {
		h.lockRanges(s)
	}
}

// unlockRanges releases what lockRanges took.
func (s *Sequence) unlockRanges() {
	if h := s.c.hooks(); h != nil {
		h.unlockRanges(s)
	}
}

// shortfall asks the prefix cache to give back need bytes; it returns the bytes that
// came back.
func (c *Cache) shortfall(need int64) int64 {
	if h := c.hooks(); h != nil && need > 0 {
		return h.shortfall(need)
	}
	return 0
}
