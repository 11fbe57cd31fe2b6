package kv

import "github.com/vmarena/vmarena/kv/tierval"

// KindsOf returns the tensors each layer of m's first group has, in order, for tests
// that walk every tensor of a sequence of a uniform model without assuming a K and a
// V per layer.
func KindsOf(m Model) []Kind { return m.Groups[0].kinds() }

// Shape is the layout's arithmetic (layout.go) for the tests' own model of it to
// check directly, function by function.
type Shape struct{ sh shape }

// NewShape is newGroupShape of m's one group, once Model.Validate takes m.
func NewShape(m Model, layout Layout, granule, blockTokens, runTokens, maxTokens int) (Shape, error) {
	if err := m.Validate(0); err != nil {
		return Shape{}, err
	}
	sh, err := newGroupShape(m.Groups[0], layout, granule, blockTokens, runTokens, maxTokens)
	return Shape{sh}, err
}

// The fields of the shape: ranges per sequence, bytes from one token to the next, a
// block's tokens and bytes (0 outside Blocked), a sharing unit's bytes, and the bytes
// reserved per range.
func (s Shape) Ranges() int         { return s.sh.nbuf }
func (s Shape) Row() int            { return s.sh.row }
func (s Shape) TokensPerBlock() int { return s.sh.tpb }
func (s Shape) BlockBytes() int     { return s.sh.blk }
func (s Shape) Unit() int           { return s.sh.unit }
func (s Shape) Capacity() int       { return s.sh.capac }

// Tensors is len(places); Place(i) is places[i] as (range, offset).
func (s Shape) Tensors() int               { return len(s.sh.places) }
func (s Shape) Place(i int) (buf, off int) { p := s.sh.places[i]; return p.buf, p.off }

// The pure functions of the shape, each under its exported name.
func (s Shape) Extent(n int) int                       { return s.sh.extent(n) }
func (s Shape) UnitsFor(n int) int                     { return s.sh.unitsFor(n) }
func (s Shape) FullUnits(n int) int                    { return s.sh.fullUnits(n) }
func (s Shape) Shareable(n int) int                    { return s.sh.shareable(n) }
func (s Shape) TokensWithin(b int) int                 { return s.sh.tokensWithin(b) }
func (s Shape) TokensIn(k int) int                     { return s.sh.tokensIn(k) }
func (s Shape) WritableFrom(frozen int) int            { return s.sh.writableFrom(frozen) }
func (s Shape) Offset(off, t int) int                  { return s.sh.offset(off, t) }
func (s Shape) TokenAt(off, t, frozen int) (int, bool) { return s.sh.tokenAt(off, t, frozen) }
func (s Shape) Run(t int) int                          { return s.sh.run(t) }
func (s Shape) Tensor(layer int, kind Kind) (buf, off int, ok bool) {
	return s.sh.tensor(layer, kind)
}

// AheadMisses returns the steps that needed their run ahead and found it still
// queued (they committed it themselves) or being committed (they waited for it).
func (c *Cache) AheadMisses() (queued, inFlight int64) {
	if c.ahead == nil {
		return 0, 0
	}
	c.ahead.mu.Lock()
	defer c.ahead.mu.Unlock()
	return c.ahead.missQueued, c.ahead.missInFlight
}

// SetAheadFill turns the filling of the pool by the map-ahead worker on or off.
func (c *Cache) SetAheadFill(on bool) {
	if c.ahead != nil {
		c.ahead.mu.Lock()
		c.ahead.noFill = !on
		c.ahead.mu.Unlock()
	}
}

// SetLeaveBehind turns leaving a window's granules behind for the worker on (the
// default) or off: the step then gives them back itself, as without map-ahead.
func (c *Cache) SetLeaveBehind(on bool) {
	if c.ahead != nil {
		c.ahead.mu.Lock()
		c.ahead.noLeave = !on
		c.ahead.mu.Unlock()
	}
}

// HoldAhead keeps the cache's map-ahead worker from its next run or give-back, as a
// step's hold does, until release: a test then sees what a step left it.
func (c *Cache) HoldAhead() (release func()) {
	a := c.ahead
	if a == nil {
		return func() {}
	}
	a.mu.Lock()
	a.holds++
	a.mu.Unlock()
	return func() {
		a.mu.Lock()
		if a.holds--; a.holds == 0 {
			a.cond.Broadcast()
		}
		a.mu.Unlock()
	}
}

// WaitAhead waits until the cache's map-ahead worker has committed every run asked
// (or failed to) and given back what windows left behind: the tests that compare
// ledgers then read them at rest.
func (c *Cache) WaitAhead() {
	a := c.ahead
	if a == nil {
		return
	}
	if a.owed.Swap(false) {
		a.kickNow() // the kick a last crossing step left for the next step
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.behind) > 0 && a.parked {
		a.parked = false
		a.kickNow() // NB: what windows left behind waits for the worker's next wake
	}
	for !a.atRest() {
		a.cond.Wait()
	}
}

// OnStoringWait has f called each time a growth of pc's cache starts to wait for an
// entry's write-through (evictFor), with no lock held. pc must have tiers, and f must
// be set before the growth starts.
func (pc *PrefixCache) OnStoringWait(f func()) { pc.tiers.onStoringWait = f }

// Storing returns how many of pc's entries a write-through holds busy now; pc must
// have tiers.
func (pc *PrefixCache) Storing() int {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return len(pc.tiers.storing)
}

// OnLoadWait has f called each time a lookup of pc starts to wait for a slot to load
// from the tiers (TierLoads), with no lock held. pc must have tiers, and f must be
// set before the lookup starts.
func (pc *PrefixCache) OnLoadWait(f func()) { pc.tiers.onLoadWait = f }

// TierOwed returns the bytes pc's reclaimer owes requests that wait on the device
// (pcTiers.owe); pc must have tiers.
func (pc *PrefixCache) TierOwed() int64 { return pc.tiers.owed.Load() }

// TierLayout returns the value layout of pc's tiers on a cache of several groups and
// the bytes of each group's whole part of a value, for tests that forge values; nil
// where pc has no tiers or its cache one group.
func TierLayout(pc *PrefixCache) (*tierval.Layout, []int) {
	if pc.tiers == nil || pc.tiers.grp == nil {
		return nil, nil
	}
	return pc.tiers.grp.layout, append([]int(nil), pc.tiers.grp.parts...)
}
