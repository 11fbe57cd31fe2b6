package kv

// OnAheadLook has f called on the map-ahead worker after each piece of work of a
// look (a record left behind given back, a run committed or failed, a granule made
// for the pool), with rest: whether WaitAhead, asked at that moment, would have
// returned. f must be set before the cache's first step (the worker starts on it).
// The worker goes on looking after f: WaitAhead must not have returned meanwhile.
func (c *Cache) OnAheadLook(f func(rest bool)) {
	a := c.ahead
	a.look = func() {
		a.mu.Lock()
		rest := a.atRest()
		a.mu.Unlock()
		f(rest)
	}
}

// atRest is WaitAhead's condition to return: nothing queued, left behind or in
// hand, and the worker parked (or stopped). a.mu must be held.
func (a *ahead) atRest() bool {
	return !(len(a.queue) > 0 || len(a.behind) > 0 || a.behindOut > 0 || a.busy != nil || a.filling || a.started && !a.parked) || a.stopped
}

// KickAhead wakes the map-ahead worker for a look of its own, as its next poll
// would: unlike WaitAhead it tells the worker nothing (it may believe itself parked).
func (c *Cache) KickAhead() {
	select {
	case c.ahead.kick <- struct{}{}:
	default:
	}
}

// LeftBehind returns the owned bytes windows left behind for the worker that it has
// not given back yet.
func (c *Cache) LeftBehind() int64 { return c.ahead.leftBehind() }
