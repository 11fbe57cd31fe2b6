package accounting

import (
	"fmt"
	"sync"
)

// ReclaimOthers asks the device's other ledgers to give memory back, as a request of
// need bytes that starts to wait on this ledger does: it calls the reclaimer of every
// other ledger of the device that has one (SetReclaimer), each on a goroutine of its
// own, with need, and returns once all of them have returned, with how many it
// called. It is for an owner whose waiter is not in this governor's queue: a process
// attached to a node pool, asked by the node's owner to give back memory for a
// request that waits in another process (backing/nodepool). The reclaimers decide
// what they can spare, as for a waiter here (a prefix cache evicts only what no live
// sequence maps). It takes nothing and queues nothing. A negative need panics; so
// does a closed ledger (PanicAuthorityClosed).
func (a *Authority) ReclaimOthers(need int64) int {
	if need < 0 {
		panic(fmt.Sprintf("accounting: ReclaimOthers of negative size %d", need))
	}
	a.g.mu.Lock()
	a.live()
	var reclaimers []func(int64)
	for _, o := range a.d.auths {
		if o.reclaim != nil && o != a {
			reclaimers = append(reclaimers, o.reclaim)
		}
	}
	a.g.mu.Unlock()
	if need == 0 {
		return 0
	}
	var wg sync.WaitGroup
	for _, fn := range reclaimers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(need)
		}()
	}
	wg.Wait()
	return len(reclaimers)
}
