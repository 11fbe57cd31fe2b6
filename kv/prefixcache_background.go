package kv

// The tiers' work off the request's path: a write-through's stores, the write-downs of
// entries an eviction took (later, closeAll), and Close's part (seal, flush). These
// close entries and evict, so they sit above the index and eviction, which only pick
// what to write down (prefixcache_tier.go).

import (
	"context"
	"runtime"

	"github.com/vmarena/vmarena/internal/lowprio"
)

// background moves the calling goroutine, one of the tiers' own that copies blocks
// into the tiers and ends with its work, onto a thread of the lowest priority
// (lowprio): on a machine of few CPUs its copies and checksums then take no CPU from a
// thread that writes a decode step. Its stores hold no lock the token path waits for
// (the entries they read are busy or out of the index). The one wait on them is a
// growth's that finds nothing to evict but an entry whose write-through runs
// (evictFor): that growth's thread sleeps meanwhile, leaving its CPU to the store,
// but where other processes keep every CPU busy the store runs slower than at the
// normal priority, as on a slow tier, each store bounded by TierWait. The thread ends
// with the goroutine.
func background() {
	runtime.LockOSThread()
	lowprio.Lower()
}

// writeThrough stores e's whole blocks into the tiers now that e holds ranges of its
// own and, under a reuse threshold, was hit often enough (TierWriteThrough), on one
// of the store workers, counted in bg: e is busy meanwhile, so that eviction leaves
// its ranges as they are, and the blocks it stores are not written again when e is
// evicted. A growth that finds nothing else to evict waits for the store to end
// (storingVictim) rather than being refused. An entry whose write-through runs starts
// no second one: eviction writes down what that one did not store. When the workers'
// queue is full the write-through is deferred (TierStats.Deferred): e stays as it
// was, and its blocks go down as it is evicted. pc.mu is held.
func (t *pcTiers) writeThrough(pc *PrefixCache, e *pcEntry) {
	if t == nil || !t.through || t.sealed || e.closed || e.seq == nil || e.seq.err != nil || !t.keep(e) || t.storing[e] != nil {
		return
	}
	p, ok := t.part(e, e.leaf.Tokens(), e.leaf.Parent().Depth()/t.bt, e.n)
	if !ok {
		return
	}
	if len(t.queue) == cap(t.queue) {
		t.deferred(p.last - p.first)
		return
	}
	if !t.working {
		t.working = true
		for range cap(t.slots) {
			go t.storeWorker()
		}
	}
	t.holdStatesLive(e, &p)
	e.stored = p.last
	e.busy++
	done := make(chan struct{})
	t.storing[e] = done
	t.bg.Add(1)
	// e.seq's ranges stay as they are while e is busy. The send does not block: only
	// writeThrough sends, under pc.mu, and the queue had room.
	t.queue <- throughJob{pc: pc, e: e, seq: e.seq, p: p, done: done}
}

// throughJob is one write-through for a store worker: the part p of e's blocks, in
// seq's ranges, and the channel to close once it ended.
type throughJob struct {
	pc   *PrefixCache
	e    *pcEntry
	seq  *Sequence
	p    tierPart
	done chan struct{}
}

// storeWorker runs the write-throughs of the queue until seal closes it, on a thread
// of the lowest priority (background). No lock is held.
func (t *pcTiers) storeWorker() {
	background()
	for j := range t.queue {
		t.through1(j)
	}
}

// through1 runs one write-through, then gives its entry back to eviction (closing it
// if it left the index meanwhile). No lock is held.
func (t *pcTiers) through1(j throughJob) {
	defer t.bg.Done()
	pc, e := j.pc, j.e
	t.writeDown(context.Background(), j.seq, &tierWrite{t: t, parts: []tierPart{j.p}})
	pc.mu.Lock()
	e.busy--
	delete(t.storing, e)
	out := e.state() == entryOut // it left the index meanwhile: ours to close
	// The cap could not take e while it was busy (an insert's, on a model of groups,
	// finds it so at once): it may now.
	drop, later := t.later(pc.capLocked())
	pc.mu.Unlock()
	if out {
		e.close()
	}
	t.closeAll(drop, later)
	close(j.done) // after the close: a growth waiting for it finds the memory back
	t.repay(pc)
}

// deferred counts blocks whose write-through the full queue deferred, in every tier.
func (t *pcTiers) deferred(blocks int) {
	for i := range t.tiers {
		t.count(i, func(st *TierStats) { st.Deferred += int64(blocks) })
	}
}

// repay, once a write-through's stores ended and its entry can be evicted again,
// evicts for the requests that still wait for memory on the device what the
// reclaimer owed them: the governor calls the reclaimer only as a request starts to
// wait, so that without this a request would wait on for memory the prefix cache
// could give it now. What it still can not give stays owed while requests wait. No
// lock is held.
func (t *pcTiers) repay(pc *PrefixCache) {
	owed := t.owed.Swap(0)
	if owed <= 0 || t.c.gov.Stats(t.c.dev).Waiters == 0 {
		return
	}
	t.owe(owed - pc.evictFor(owed, evictForWaiter))
}

// later tells whether the entries in drop, which an eviction to MaxBytes took after an
// Insert or a lookup, or an origin's close, have blocks to write down: those are then
// written, and the entries closed, on a goroutine of their own (closeAll), off the
// request's path, counted in bg so that Close waits for them. Once Close sealed the
// tiers, those with blocks to write are parked for Close instead: it returns the
// entries left for closeAll. pc.mu is held: an Insert holds it from its check that the
// prefix cache is open, a lookup is counted in pc.working, which Close waits for
// before it seals, and an origin's close seals nothing.
func (t *pcTiers) later(drop []*pcEntry) ([]*pcEntry, bool) {
	if t == nil {
		return drop, false
	}
	if t.sealed {
		rest := drop[:0]
		for _, d := range drop {
			if d.wb != nil {
				t.parked = append(t.parked, d)
			} else {
				rest = append(rest, d)
			}
		}
		return rest, false
	}
	for _, d := range drop {
		if d.wb != nil {
			t.bg.Add(1)
			return drop, true
		}
	}
	return drop, false
}

// closeAll closes the entries in drop, on a goroutine of its own when later said so.
// No lock is held.
func (t *pcTiers) closeAll(drop []*pcEntry, later bool) {
	if !later {
		for _, d := range drop {
			d.close()
		}
		return
	}
	go func() {
		defer t.bg.Done()
		background()
		for _, d := range drop {
			d.close()
		}
	}()
}

// seal starts Close's part: write-downs are parked for Close from now on, and those
// running in the background are waited for.
func (t *pcTiers) seal(pc *PrefixCache) {
	if t == nil {
		return
	}
	pc.mu.Lock()
	t.sealed = true
	if t.working {
		close(t.queue) // nothing is sent once sealed; the workers drain it and end
	}
	pc.mu.Unlock()
	t.bg.Wait()
}

// closeContext returns the context bounding Close's write-downs, all of them together:
// one TierWait.
func (t *pcTiers) closeContext() (context.Context, context.CancelFunc) {
	if t == nil {
		return context.Background(), func() {}
	}
	return context.WithTimeout(context.Background(), t.wait)
}

// flush writes down, within ctx, what waits in live origins' ranges (pending) and
// what was parked, for Close, which evicted the index before: each origin's under its
// ranges lock, so that it can not close meanwhile. No lock is held.
func (t *pcTiers) flush(ctx context.Context, pc *PrefixCache) []error {
	if t == nil {
		return nil
	}
	pc.mu.Lock()
	origins := make([]*Sequence, 0, len(t.pending))
	ols := make([]*pcLive, 0, len(t.pending))
	for s, pe := range t.pending {
		origins, ols = append(origins, s), append(ols, pe.ol)
	}
	pc.mu.Unlock()
	for i, s := range origins {
		ols[i].mu.Lock()
		pc.mu.Lock()
		pe := t.pending[s]
		delete(t.pending, s)
		pc.mu.Unlock()
		if pe != nil && s.err == nil {
			t.writeBack(ctx, s, &tierWrite{t: t, parts: pe.parts})
		}
		ols[i].mu.Unlock()
	}
	pc.mu.Lock()
	parked := t.parked
	t.parked = nil
	pc.mu.Unlock()
	var errs []error
	for _, d := range parked {
		if out := d.closeCtx(ctx); out.Err != nil {
			errs = append(errs, out.Err)
		}
	}
	return errs
}
