package kv

import (
	"errors"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// What a scheduler asks before it admits, forks or steps: what an operation would
// take from the budget now (Need, ForkNeed), what the budget could give now
// (Headroom), and where the cache's memory is (Device, Pool). What evicts cached
// prefixes, and when, is the package doc's memory rules.

// Device returns the device whose budget the cache's memory takes (the backing's):
// the key a server or a metrics collector passes to the governor about this cache.
func (c *Cache) Device() accounting.DeviceKey { return c.dev }

// Pool returns the backing's pool of physical granules (host.Shared, cuda), whose
// idle granules Need counts as owned already, or nil when the backing pools none:
// for a metrics collector that reads the pool's stats (package metrics does).
func (c *Cache) Pool() backing.Pool { return c.pool }

// Headroom returns the bytes of budget the cache's operations can have now, for a
// scheduler deciding whether to admit, fork or step: what
// the governor has free on the device plus what its prefix cache could give back by
// eviction (cached granules that no live sequence maps and no pin holds), which every
// operation evicts before it refuses. It is the one figure to compare with Need and
// ForkNeed, which already count the pool's idle granules as owned: an admission that
// fits (need <= Headroom) is not refused for budget unless another user of the
// device takes the memory first.
func (c *Cache) Headroom() int64 {
	h := c.gov.Available(c.dev)
	if ph := c.hooks(); ph != nil {
		h += ph.evictable()
	}
	return h
}

// shareNeed returns the bytes of the granules a new holder of the first n tokens of a
// sequence's ranges commits: in each range, the granules past the whole sharing units,
// which hold the copied tail.
func (c *Cache) shareNeed(n int) int64 {
	var need int64
	for gi := range c.groups {
		g := &c.groups[gi]
		size, _ := backing.AlignUp(g.extent(n), c.gran)
		need += int64(g.nbuf) * int64(size-g.shareable(n))
	}
	return need
}

// shareBudget checks that a new holder of the first n tokens of a sequence's ranges
// (a fork, a frozen prefix, a sequence started on a prefix or a cached entry) can
// have its copied tail's granules now, evicting cached prefixes first; it returns
// the refusal, counted, when it can not.
func (c *Cache) shareBudget(n int) error { return c.needBudget(c.shareNeed(n)) }

// needBudget is shareBudget for a holder that commits need bytes.
func (c *Cache) needBudget(need int64) error {
	if need > 0 {
		if be := c.budgetOrEvict(need, 0); be != nil {
			return c.refuse(be)
		}
	}
	return nil
}

// evicting runs op and, when the backing refuses it for budget (the memory went to
// another user of the device since shareBudget, or the backing needs more than the
// copied tail), runs it once more after the runs committed ahead (see ahead.go) and
// the prefix cache gave back what the refusal says is missing. op must change nothing
// when it fails. A refusal that stays is counted in Stats.Refusals.
func evicting[T any](c *Cache, op func() (T, error)) (T, error) {
	v, err := op()
	var be *accounting.BudgetError
	if err != nil && errors.As(err, &be) && !errors.Is(be, accounting.ErrExceedsLimit) {
		short := max(be.Requested-be.Available, int64(c.gran))
		// NB: what windows left behind goes first, and counts for nothing: what
		// giving back a mapping frees is not known here.
		drained := c.ahead.drainBehind()
		got := c.ahead.giveBack(short)
		if got < short {
			got += c.shortfall(short - got)
		}
		if got > 0 || drained {
			v, err = op()
		}
	}
	return v, c.refused(err)
}

// budgetOrEvict is budget that, before it refuses, evicts cached prefixes no live
// sequence maps to make up the shortfall.
func (c *Cache) budgetOrEvict(need, credit int64) *accounting.BudgetError {
	be := c.budget(need, credit)
	if be != nil && !errors.Is(be, accounting.ErrExceedsLimit) && c.ahead.drainBehind() {
		be = c.budget(need, credit) // NB: a window's dead granules before cached prefixes
	}
	if be != nil && !errors.Is(be, accounting.ErrExceedsLimit) && c.shortfall(be.Requested-be.Available-credit) > 0 {
		be = c.budget(need, credit)
	}
	if be == nil && c.ahead != nil {
		c.ahead.reclaim(need, credit) // the runs ahead counted as own
	}
	return be
}

// own returns the bytes the cache holds that any growth may take: the pool's idle
// granules and the runs committed ahead (see ahead.go).
func (c *Cache) own() int64 { return c.idle() + c.ahead.own() }

// budget returns a *accounting.BudgetError when need bytes of granules can not be
// had now: more than the device's whole limit (it matches ErrExceedsLimit then), or,
// less the pool's idle granules, more than is free under the limit plus credit (bytes
// already waited for). Its Requested is always the net figure, as Need says it; Held
// is the idle granules the growth would use. It counts nothing: a caller that refuses
// on it counts the refusal with refuse.
func (c *Cache) budget(need, credit int64) *accounting.BudgetError {
	limit := c.gov.Limit(c.dev)
	avail := c.gov.Available(c.dev)
	held := min(c.own(), need)
	if net := need - held; need > limit || net > avail+credit {
		return &accounting.BudgetError{Device: c.dev, Requested: net, Available: avail, Limit: limit, Held: held}
	}
	return nil
}

// refuse counts a refusal that budget decided, in the cache's Stats and in the
// governor's counters (accounting.Governor.Refuse), and returns its error.
func (c *Cache) refuse(be *accounting.BudgetError) error {
	c.refusals.Add(1)
	return c.gov.Refuse(c.dev, be.Requested, be.Held)
}

// refused counts err in the cache's Stats when it is a refusal for memory that the
// backing made (the governor counted it already), and returns it.
func (c *Cache) refused(err error) error {
	if errors.Is(err, accounting.ErrBudgetExceeded) {
		c.refusals.Add(1)
	}
	return err
}

// need returns the bytes of the granules s must commit to hold tokens (before a
// window group gives any back). The sequence must not be damaged: the ranges of each
// of its groups are then alike (see refreshStats).
func (s *Sequence) need(tokens int) int64 {
	var n int64
	for gi := range s.c.groups {
		n += s.groupNeed(gi, tokens)
	}
	return n
}

// groupNeed returns the bytes of the granules the ranges of s's group gi must commit
// to hold tokens (see need).
func (s *Sequence) groupNeed(gi, tokens int) int64 {
	g := &s.c.groups[gi]
	size, _ := backing.AlignUp(g.extent(tokens), s.c.gran)
	return int64(g.nbuf) * int64(max(size-rangeEnd(s.bufs[g.first]), 0))
}
