package kv

import (
	"sync"
	"sync/atomic"
)

// Map-ahead (Config.MapAhead): the granules a growing sequence will commit next are
// made ready in the backing's pool before the step that commits them, off the token
// path, so that the step takes a granule that exists (a move out of the pool's park)
// rather than creating and populating one.
//
// A sequence asks once per growth frontier: after an append leaves it within
// aheadTokens of its next commit, it counts the bytes of that commit in want (asked),
// and stops counting them when it commits them, closes or is truncated. A worker
// goroutine of the cache keeps the pool's idle resident granules at or above want
// (Pool.Prefill, one granule at a time, up to the pool's High), within the budget: a
// prefill the budget refuses is left for the next ask. The granules it makes are idle
// granules of the pool like any other, owned and charged (the governor and PoolStats
// show them), and Need and AppendBatch count idle granules as the cache's own, so
// they never make this cache's growth refused. The one window where they could, a
// granule charged but still being populated (not idle yet) while a step finds the
// budget short, is closed by hold: such a step stops the worker and waits for its
// granule to land before it decides.

// aheadTokens is how many tokens before its next commit a sequence asks for it: at
// one token a step, that many steps of lead for the worker. 16 is a whole block of
// the default layout at 2 MiB granules for Llama-3-8B (the next block is asked for
// as the current one begins): with 8, 0.26% of a long-prompt replay's steps still
// found no granule made (BENCHMARKS.md, issue 23); the price is up to one block per
// growing sequence held idle ahead, charged and shown.
const aheadTokens = 16

// ahead is a cache's map-ahead worker.
type ahead struct {
	c    *Cache
	want atomic.Int64  // bytes the sequences that asked will commit next
	kick chan struct{} // wakes the worker (capacity 1)
	stop chan struct{} // closed by close
	done sync.WaitGroup

	mu      sync.Mutex
	cond    sync.Cond // on mu: busy went false, or held went 0
	busy    bool      // a prefill is in flight
	held    int       // steps that keep the worker from starting one
	started bool
	stopped bool
}

func newAhead(c *Cache) *ahead {
	a := &ahead{c: c, kick: make(chan struct{}, 1), stop: make(chan struct{})}
	a.cond.L = &a.mu
	return a
}

// after counts what the sequences of a batch that just grew will commit next: a
// sequence that committed since it asked stops counting, and one now within
// aheadTokens of a commit asks. committed says whether the batch committed granules
// (it may have taken those made ahead for others: the worker looks again). Only the
// batch's owner calls it.
func (a *ahead) after(batch []Growth, committed bool) {
	asked := committed
	for _, g := range batch {
		s := g.Seq
		if s.asked > 0 {
			if s.bufs[0].Committed() == s.askedAt {
				continue // still waiting for its commit
			}
			a.want.Add(-s.asked)
			s.asked = 0
		}
		if room := s.c.cfg.MaxTokens - s.n; room > 0 {
			if need := s.need(s.n + min(aheadTokens, room)); need > 0 {
				s.asked, s.askedAt = need, s.bufs[0].Committed()
				a.want.Add(need)
				asked = true
			}
		}
	}
	if asked {
		a.wake()
	}
}

// forget stops counting what s asked for (it closes, or its ranges changed).
func (a *ahead) forget(s *Sequence) {
	if s.asked > 0 {
		a.want.Add(-s.asked)
		s.asked = 0
	}
}

// wake starts the worker if need be and tells it to look.
func (a *ahead) wake() {
	a.mu.Lock()
	if a.stopped {
		a.mu.Unlock()
		return
	}
	if !a.started {
		a.started = true
		a.done.Add(1)
		go a.run()
	}
	a.mu.Unlock()
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// run is the worker: at each kick it prefills the pool up to want.
func (a *ahead) run() {
	defer a.done.Done()
	gran := int64(a.c.gran)
	for {
		select {
		case <-a.stop:
			return
		case <-a.kick:
		}
		for {
			want := (a.want.Load() + gran - 1) / gran
			if want <= 0 {
				break
			}
			a.mu.Lock()
			for a.held > 0 && !a.stopped {
				a.cond.Wait()
			}
			if a.stopped {
				a.mu.Unlock()
				return
			}
			st := a.c.pool.PoolStats()
			have := st.Resident / gran
			if have >= min(want, int64(st.High)) {
				a.mu.Unlock()
				break
			}
			a.busy = true
			a.mu.Unlock()
			// NB: Prefill makes granules until have+1 are resident: one, unless a
			// commit took some meanwhile.
			err := a.c.pool.Prefill(int(have + 1))
			a.mu.Lock()
			a.busy = false
			a.cond.Broadcast()
			a.mu.Unlock()
			if err != nil {
				break // the budget, say: the next ask tries again
			}
		}
	}
}

// hold keeps the worker from charging the budget while a step that needs need bytes
// of new granules (credit of them waited for already) decides and commits, where
// the budget is so short that a granule in flight could make it fail, or where the
// pool lacks idle granules for the step while one is in flight: it waits for the
// prefill in flight to land in the pool, where the step counts it as idle (and
// takes it, rather than make one more). A step that the pool's resident idle
// granules cover neither waits nor holds: the worker only creates granules or
// populates idle ones that are not resident, so nothing it does can take those or
// make the step short. It returns the function that lets the worker go on.
//
// NB: waiting there put the worker's whole populate (a 2 MiB MADV_POPULATE_WRITE,
// 0.3-1 ms) on the token path of most steps that commit under a full budget, where
// examples/kvcache's pool keeps its idle granules (BENCHMARKS.md, issue 23).
func (a *ahead) hold(need, credit int64) func() {
	c := a.c
	st := c.pool.PoolStats()
	if st.Resident >= need {
		return func() {}
	}
	idle := st.Idle
	tight := max(need-idle, 0)+int64(c.gran) > c.gov.Available(c.dev)+credit
	a.mu.Lock()
	if !tight && (!a.busy || idle >= need) {
		a.mu.Unlock()
		return func() {}
	}
	a.held++
	for a.busy {
		a.cond.Wait()
	}
	a.mu.Unlock()
	return func() {
		a.mu.Lock()
		if a.held--; a.held == 0 {
			a.cond.Broadcast()
		}
		a.mu.Unlock()
	}
}

// close stops the worker and waits for it.
func (a *ahead) close() {
	a.mu.Lock()
	if a.stopped {
		a.mu.Unlock()
		return
	}
	a.stopped = true
	close(a.stop)
	a.cond.Broadcast()
	a.mu.Unlock()
	a.done.Wait()
}
