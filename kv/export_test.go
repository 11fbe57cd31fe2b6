package kv

// KindsOf returns the tensors each layer of g has, in order, for tests that walk every
// tensor of a sequence without assuming a K and a V per layer.
func KindsOf(g Geometry) []Kind { return g.kinds() }

// WaitAhead waits until the cache's map-ahead worker has committed every run asked
// (or failed to): the tests that compare ledgers then read them at rest.
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
	for (len(a.queue) > 0 || a.busy != nil) && !a.stopped {
		a.cond.Wait()
	}
}
