package kv

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/causes"
	"github.com/vmarena/vmarena/internal/poll"
)

// Map-ahead (on by default on a pool; Config.NoMapAhead turns it off): the granules
// a growing sequence will commit next are committed into the sequence's own ranges
// before the step that needs them, off the token path, so that the step which crosses into them makes no backing call and
// takes no lock that a system call holds: it adopts them (arena.Buffer.AdoptAhead,
// which moves a few fields).
//
// A sequence has a run ahead per layer group that holds tokens (full attention, MLA,
// sliding-window and chunked-local; a recurrent state does not grow): the same
// granules at the same offset in each of the group's ranges, the granules the
// group's next aheadTokens tokens need. Groups of other shapes cross their block
// boundaries at other tokens, so each group's run is asked, committed, adopted and
// given back on its own. A window group gets its run like a full group: it commits
// a new block at its front as often as a full group of its shape does (gpt-oss's
// window and full groups at the same tokens), so leaving it out would leave a
// backing call on the very step map-ahead empties; the blocks it gives back behind
// its window go idle in the pool, where the worker's next run takes them. (That
// give-back is the worker's too: the step that moves the window leaves the blocks
// behind, with no backing call, and the worker decommits them when it next wakes;
// see ahead_behind.go.) Each run is in one of these states, guarded by ahead.mu:
//
//  1. none: nothing asked.
//  2. asked: queued for the worker. After an append that leaves a group of the
//     sequence within aheadTokens of a commit, its owner asks (after), once per run.
//  3. mapping: the worker commits the run (arena.Buffer.CommitAhead, range by
//     range, outside every lock of kv's); a failure (the budget, say) undoes the
//     ranges done and goes back to none: the step then commits the group's block
//     as without map-ahead.
//  4. mapped: committed ahead in every range of the group, owned and charged (the governor and
//     PoolStats show it; Stats.Ahead counts it), and listed in ahead.mapped.
//  5. dropping: being given back (arena.Buffer.DecommitAhead) by a growth of
//     another sequence that the budget can not hold otherwise (reclaim), outside
//     every lock. Then none.
//
// Only the worker moves asked to mapping and mapping on; only a reclaim moves mapped
// to dropping and dropping on; only the owner moves asked or mapped to none
// (settle), and only the owner reads or changes its ranges' fields. The worker and
// a reclaim touch nothing of a sequence but its ranges' runs ahead, which they reach
// through the arena's word (CommitAhead and DecommitAhead change no other field), so
// the owner can read, write and view its ranges meanwhile. The owner settles a run
// before anything that changes its ranges: a step that needs the run adopts it
// (under lockRanges, as a resize, so a lookup mapping from the ranges sees whole
// fields); Truncate, Close, ForkAt, Freeze and PrefixCache.Insert give it back first,
// so a run never holds tokens, is never shared or copied, and no range closes with
// one (the budget it held goes back to the pool, where that operation finds it).
// A step adopts the runs of the groups it crosses into, the others' stay mapped,
// and of a run that reaches past the step's tokens it adopts the granules they need
// (arena.Buffer.AdoptAhead of part): the rest stays mapped, asked still, for the
// step that crosses into it (the owner holds it off ahead.mapped meanwhile, where no
// reclaim takes it). A step refused or failed after adopting gives back what it
// adopted (unadopt, in ahead_step.go), so that a sequence never holds a granule its
// tokens do not need.
//
// The owner waits in two rare cases only: the step crosses into its run while the
// worker is still committing it (the worker had aheadTokens steps of lead and lost
// them: a loaded machine), or while another goroutine's growth gives it back under
// a full budget; it then waits for that one backing call, which it would otherwise
// have made itself. A sequence's owner also takes ahead.mu briefly, once per run,
// to ask and to settle (a few times where it adopts a run in part), and on a step
// that leaves a window's granules behind (ahead_behind.go); neither the worker nor a
// reclaim holds it across a call. No step wakes the worker while the cache's
// sequences grow: it looks for runs asked at short intervals (aheadPoll), and waits
// for a kick only once it found none for a while; even then the crossing step makes
// no futex call: the kick for the run it asks is left to the cache's next step
// (after). The first ask of a cache starts the worker.
//
// Accounting: Need, AppendBatch and every check of the budget count the runs mapped
// ahead as the cache's own, like the pool's idle granules (own), and a growth that
// the budget could not hold otherwise gives back other sequences' runs first
// (reclaim), so map-ahead never makes a growth of this cache refused. A step that
// commits keeps the worker from the budget it counts on until it has committed
// (hold): where the pool holds no idle granule (the worker would take those first)
// and the free budget holds its need besides the run or granule in flight, it
// reserves that need, and the worker goes on
// meanwhile but starts no run or filling that would leave less than the bytes
// reserved (so a step that commits a granule itself, or a long prompt's commit, does
// not stop the worker behind it); otherwise it holds the worker off until it has
// committed, and where the budget is so short that the run in flight could make it
// fail, first waits for that run to land (mapped, where the step can take it back).
// A Truncate that replaces a shared granule by one of its own keeps the worker from
// it the same way. ForkAt, Freeze and NewSequenceFrom
// reclaim too but do not hold the worker: a run it starts meanwhile may take the
// last granule they counted on, which the next try finds mapped and takes back.
//
// What map-ahead holds: at most one run per group of a growing sequence beyond its
// tokens (one block of the group in the Blocked layout; one granule a range in the
// others, two where aheadTokens straddle a granule boundary), from the step that
// adopts the last run until its next crossing. A sequence that stops growing keeps its
// run until it is truncated or closed, or a growth of another sequence needs the budget.
//
// Filling the pool (fill): with no run asked, the worker makes the granules of the
// runs that the mapped ones will ask next (as many as they hold, for the sequences
// that can grow past them) resident and idle in the pool, one at a time, so that the
// next run's commit, on the worker or on a step that found the worker behind, takes
// a granule made already instead of making one: a burst of crossings then costs the
// worker moves, not new pages, and it keeps its lead. It fills only while the budget
// has room: the granules so held stay within 1/fillShare of the limit and leave at
// least 2/fillShare of it free. They are the pool's idle granules (PoolStats shows
// them; Stats.Ahead does not), which every growth takes first and the pool's decay
// gives back; a step keeps the filling from its budget as it keeps the runs (hold).

// aheadTokens is how many tokens before its next commit a sequence asks for it: at
// one token a step, that many steps of lead for the worker. 16 is a whole block of
// the default layout at 2 MiB granules for Llama-3-8B (the next block is asked for
// as the current one begins): with 8, 0.26% of a long-prompt replay's steps still
// found no granule made (docs/benchmarks/kv.md, map-ahead).
const aheadTokens = 16

// fillShare bounds the filling of the pool (see above): the granules made ahead of
// the mapped runs stay within 1/fillShare of the limit, and are made only while
// more than 2/fillShare of it is free. At 32 they are at most about 3% of the
// limit, and none once the free budget falls to about 6% of it.
const fillShare = 32

// aheadState is the state of a sequence's run ahead (see above).
type aheadState uint8

const (
	aheadNone aheadState = iota
	aheadAsked
	aheadMapping
	aheadMapped
	aheadDropping
)

// seqAhead is the run ahead of one layer group of a sequence (Sequence.runs). on is
// its owner's alone; the rest is guarded by the cache's ahead.mu.
type seqAhead struct {
	on    bool // asked, and not settled since: the owner settles before it asks again
	state aheadState
	off   int      // where the run starts in each of the group's ranges
	size  int      // its bytes in each range
	bufs  []buffer // the group's ranges, as the owner asked (the worker's and reclaim's copy)
	at    int      // its index in ahead.mapped while mapped
	more  bool     // the group may grow past the run: another run follows it
}

// run returns a copy of the run without its owner's field (on), which only the
// owner may read: the worker's and reclaim's copy.
func (r *seqAhead) run() seqAhead {
	return seqAhead{state: r.state, off: r.off, size: r.size, bufs: r.bufs, more: r.more}
}

// left reports whether any of the run's ranges holds a run ahead.
func (r *seqAhead) left() bool {
	for _, b := range r.bufs {
		if _, size := b.Ahead(); size > 0 {
			return true
		}
	}
	return false
}

// bytes returns the run's bytes in all its ranges.
func (r *seqAhead) bytes() int64 { return int64(len(r.bufs)) * int64(r.size) }

// ahead is a cache's map-ahead worker and its books.
type ahead struct {
	c    *Cache
	kick chan struct{} // wakes the worker (capacity 1)
	stop chan struct{} // closed by close
	done sync.WaitGroup
	held atomic.Int64 // bytes of the runs mapped: a copy of mappedBytes for own

	// reserved is the bytes that steps committing beside the worker count on (hold):
	// the worker starts no run or filling that would leave less idle and free. It
	// grows under mu; the worker reads it after marking its run or filling in
	// flight there, so a step either sees that in flight or the worker sees its
	// reservation.
	reserved atomic.Int64
	owed     atomic.Bool // a kick a crossing step left for the next step (see after)
	// behindHeld is the owned bytes (not mapped from another holder) that windows
	// left behind for the worker to give back and that are not given back yet
	// (ahead_behind.go; Stats.Ahead shows them).
	behindHeld atomic.Int64

	mu          sync.Mutex
	cond        sync.Cond   // on mu: a run, filling or record left behind landed, holds went 0, or the worker parked
	queue       []*seqAhead // asked, in order
	mapped      []*seqAhead // mapped, in no order
	mappedBytes int64       // their bytes
	nextBytes   int64       // the bytes of the runs that follow them (more)
	busy        *seqAhead   // the run the worker commits, or nil
	// behind is the windows' records of granules left behind, queued in order;
	// behindOut counts those being given back (see ahead_behind.go).
	behind    []*seqBehind
	behindOut int
	filling   bool // the worker makes a granule for the pool (fill)
	holds     int  // steps that keep the worker from starting a run (hold)
	parked    bool // the worker found nothing to do and took none since: it looks again later (see run and next)
	sleeping  bool // and waits for a kick, not for its next look
	noFill    bool // fill is off (a benchmark's comparison)
	noLeave   bool // leaving behind is off (a benchmark's comparison)
	started   bool
	stopped   bool

	look func() // nil but in tests: called after each piece of work of a look (see run)

	// Steps that needed their run and found it still queued (they committed it
	// themselves), or being committed (they waited for it), on mu: a benchmark's figures.
	missQueued, missInFlight int64
}

func newAhead(c *Cache) *ahead {
	a := &ahead{c: c, kick: make(chan struct{}, 1), stop: make(chan struct{})}
	a.cond.L = &a.mu
	return a
}

// after asks for the runs of the sequences of a batch that just grew: each that is
// now within aheadTokens of a commit and has no run asked. Only the batch's owner
// calls it; crossed says whether the step adopted a run. A worker that waits for a
// kick (it found nothing to do for a while: see run) is kicked (a futex call, and
// on a busy machine the thread woken may take the step's CPU), but
// not by a step that crossed into a run: that kick is owed, and paid by the cache's
// next step (by the next crossing step too, where every step crosses), so that the
// step that crosses after a step that did not makes no system call. A run whose
// kick is owed when the cache makes no more steps waits: no step needs it.
func (a *ahead) after(batch []Growth, crossed bool) {
	kick := false
	for _, g := range batch {
		kick = a.ask(g.Seq) || kick
	}
	switch {
	case crossed && (kick || a.owed.Load()):
		if a.owed.Swap(true) {
			// NB: the step before crossed too (a batch of many tokens each step):
			// this one pays, so that a kick waits one step at most.
			a.owed.Store(false)
			a.kickNow()
		}
	case kick || a.owed.Load() && a.owed.Swap(false):
		a.kickNow()
	}
}

// kickNow wakes the worker if it waits for a kick.
func (a *ahead) kickNow() {
	select {
	case a.kick <- struct{}{}:
		causes.Add(causes.Wake)
	default:
	}
}

// ask queues, for each group of s with no run asked, the run of its next commit if
// it is within aheadTokens: the granules past the group's committed bytes that its
// next tokens need. It starts the worker if need be, and reports whether the worker
// must be kicked (it waits for a kick).
func (a *ahead) ask(s *Sequence) bool {
	room := s.c.cfg.MaxTokens - s.n
	if room <= 0 || s.err != nil {
		return false
	}
	kick := false
	runs := s.runs()
	for gi := range runs {
		if r := &runs[gi]; !r.on {
			kick = a.askGroup(s, gi, r, s.n+min(aheadTokens, room)) || kick
		}
	}
	return kick
}

// askGroup queues r, the run of group gi of s, when the group's ranges must commit
// more to hold tokens; it reports whether the worker must be kicked.
func (a *ahead) askGroup(s *Sequence, gi int, r *seqAhead, tokens int) bool {
	g := &s.c.groups[gi]
	if g.spec.Kind == Recurrent {
		return false // a state does not grow
	}
	end := rangeEnd(s.bufs[g.first]) // the ranges of a group are alike (see refreshStats)
	target, ok := backing.AlignUp(g.extent(tokens), s.c.gran)
	if !ok || target <= end {
		return false
	}
	last, _ := backing.AlignUp(g.extent(s.c.cfg.MaxTokens), s.c.gran)
	causes.Lock(&a.mu, causes.WaitAhead)
	defer a.mu.Unlock()
	if a.stopped {
		return false
	}
	*r = seqAhead{on: true, state: aheadAsked, off: end, size: target - end, bufs: g.ranges(s.bufs), more: target < last}
	a.queue = append(a.queue, r)
	if !a.started {
		a.started = true
		a.done.Add(1)
		go a.run()
	}
	kick := a.sleeping
	a.parked, a.sleeping = false, false
	return kick
}

// runs returns s's runs ahead, one per group of its cache (a recurrent group's is
// never asked). Only the owner calls it.
func (s *Sequence) runs() []seqAhead {
	if s.ahead == nil {
		if len(s.c.groups) == 1 {
			s.ahead = s.ahead1[:] // NB: no allocation on a one-group cache's step
		} else {
			s.ahead = make([]seqAhead, len(s.c.groups))
		}
	}
	return s.ahead
}

// settle ends r, a run of s, before its owner changes the ranges of r's group: it
// gives the run back (upto < 0), or adopts it into them up to offset upto (a step
// that needs that much), waiting first while the worker commits it or a reclaim
// gives it back. A run that reaches past upto is adopted in part: its rest stays
// mapped, asked (on) still, for the step that crosses into it. It reports whether it
// adopted any. On error (a backing call that failed) the ranges may differ: the
// sequence is damaged, or, where giving back failed, its ranges keep the run for
// their Close to give back.
func (a *ahead) settle(s *Sequence, r *seqAhead, upto int) (bool, error) {
	if !r.on {
		return false, nil
	}
	adopt := upto >= 0
	causes.Lock(&a.mu, causes.WaitAhead)
	if adopt {
		switch r.state {
		case aheadAsked:
			a.missQueued++
		case aheadMapping:
			a.missInFlight++
		}
	}
	if r.state == aheadMapping || r.state == aheadDropping {
		causes.Add(causes.WaitAhead)
	}
	for r.state == aheadMapping || r.state == aheadDropping {
		a.cond.Wait()
	}
	cp := *r
	n := cp.size // the bytes of each range it adopts
	if adopt {
		n = min(max(upto-cp.off, 0), cp.size)
	}
	switch cp.state {
	case aheadAsked:
		a.queue = removeRun(a.queue, r)
		a.cond.Broadcast()
		causes.Add(causes.Wake)
	case aheadMapped:
		a.unlist(r)
	}
	part := adopt && cp.state == aheadMapped && 0 < n && n < cp.size
	if part {
		// NB: the owner holds the run off the list, where no reclaim takes it,
		// while it adopts; its rest stays counted as the cache's own.
		a.count(r.more, int64(len(cp.bufs))*int64(cp.size-n))
	} else {
		*r = seqAhead{}
	}
	a.mu.Unlock()
	if cp.state != aheadMapped {
		return false, nil
	}
	if !adopt {
		return false, dropRun(cp.bufs)
	}
	s.lockRanges()
	defer s.unlockRanges()
	for i, b := range cp.bufs {
		if err := b.AdoptAhead(n); err != nil {
			// NB: it can not fail while the protocol holds; if it did, the ranges
			// differ from here on.
			s.err = err
			if part {
				a.mu.Lock()
				a.count(r.more, -int64(len(cp.bufs))*int64(cp.size-n))
				*r = seqAhead{}
				a.mu.Unlock()
			}
			return false, errors.Join(fmt.Errorf("%w: adopting the run ahead of range %d: %w", ErrDamaged, i, err), dropRun(cp.bufs))
		}
	}
	if part {
		a.mu.Lock()
		r.off, r.size = cp.off+n, cp.size-n
		r.at = len(a.mapped)
		a.mapped = append(a.mapped, r) // counted already
		a.mu.Unlock()
	}
	return true, nil
}

// dropRun gives back the runs ahead of bufs.
func dropRun(bufs []buffer) error {
	var errs []error
	for _, b := range bufs {
		if _, err := b.DecommitAhead(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kv: giving back a run committed ahead: %w", err)
	}
	return nil
}

// removeRun removes r from q, keeping the order.
func removeRun(q []*seqAhead, r *seqAhead) []*seqAhead {
	for i, x := range q {
		if x == r {
			return append(q[:i], q[i+1:]...)
		}
	}
	return q
}

// unlist removes r, mapped, from the mapped runs. a.mu must be held.
func (a *ahead) unlist(r *seqAhead) {
	last := len(a.mapped) - 1
	i := r.at
	a.mapped[i] = a.mapped[last]
	a.mapped[i].at = i
	a.mapped[last] = nil
	a.mapped = a.mapped[:last]
	a.count(r.more, -r.bytes())
}

// list adds r, committed, to the mapped runs. a.mu must be held.
func (a *ahead) list(r *seqAhead) {
	r.state = aheadMapped
	r.at = len(a.mapped)
	a.mapped = append(a.mapped, r)
	a.count(r.more, r.bytes())
}

// count adds bytes to those of the runs mapped (and, more, of the runs that follow
// them). a.mu must be held.
func (a *ahead) count(more bool, bytes int64) {
	a.mappedBytes += bytes
	if more {
		a.nextBytes += bytes
	}
	a.held.Store(a.mappedBytes)
}

// aheadPoll is the interval at which the worker, with none left, looks for runs
// asked, doubling up to aheadIdlePolls intervals while it finds none; after
// aheadParkPolls looks that found none it waits for a kick. While a cache's sequences
// grow, their runs are asked every few steps, so the worker keeps looking and a step
// that asks one makes no futex call: the kick (a wake-up of the worker's thread,
// which on a busy machine may take the step's CPU) was on 4% of the steps of
// examples/kvcache and on 35-45% of those above its p99 (docs/benchmarks/step.md).
// At 250 µs doubled to 4 ms, a run is found well within the aheadTokens steps of
// lead that its ask leaves.
const (
	aheadPoll      = 250 * time.Microsecond
	aheadIdlePolls = 16
	aheadParkPolls = 32
)

// run is the worker: it commits the runs asked, in order, and with none left looks
// again at intervals (aheadPoll), or after long enough waits for a kick.
func (a *ahead) run() {
	defer a.done.Done()
	t := time.NewTimer(aheadPoll)
	t.Stop()
	defer t.Stop()
	backoff := poll.Backoff{Interval: aheadPoll, MaxPolls: aheadIdlePolls}
	empty := 0 // looks in a row that found nothing to do
	for {
		busy := false
		for a.next() {
			busy = true
			if a.look != nil {
				a.look()
			}
		}
		a.mu.Lock()
		a.parked = len(a.queue) == 0 && len(a.behind) == 0
		parked := a.parked
		if parked {
			a.cond.Broadcast() // for WaitAhead, in tests
			if busy {
				empty = 0
			} else {
				empty++
			}
			a.sleeping = empty >= aheadParkPolls
		}
		sleeping := a.sleeping
		a.mu.Unlock()
		if !parked {
			continue
		}
		if sleeping {
			select {
			case <-a.stop:
				return
			case <-a.kick:
			}
			a.mu.Lock()
			a.sleeping = false
			a.mu.Unlock()
			empty = 0
			backoff.Next(true)
			continue
		}
		t.Reset(backoff.Next(busy))
		select {
		case <-a.stop:
			return
		case <-a.kick:
			t.Stop()
		case <-t.C:
		}
	}
}

// next gives back the first record of granules a window left behind, or commits
// the first run asked, or with neither makes a granule for the pool (fill); it
// reports whether there may be more to do.
func (a *ahead) next() bool {
	a.mu.Lock()
	for a.holds > 0 && !a.stopped {
		a.cond.Wait()
	}
	if a.stopped {
		a.mu.Unlock()
		return false
	}
	if len(a.behind) > 0 {
		// NB: what windows left behind first: it gives back what the runs take.
		a.parked = false
		a.mu.Unlock()
		a.dropBehind()
		return true
	}
	if len(a.queue) == 0 {
		want := a.nextBytes
		if a.noFill {
			want = 0
		}
		a.filling = want > 0
		a.parked = a.parked && want == 0
		a.mu.Unlock()
		if want == 0 {
			return false
		}
		more := a.fill(want)
		a.mu.Lock()
		a.filling = false
		a.cond.Broadcast()
		a.mu.Unlock()
		return more
	}
	r := a.queue[0]
	// NB: shifted, not resliced from the front: the queue keeps its capacity, so
	// that the step that asks next (askGroup) appends without allocating.
	n := copy(a.queue, a.queue[1:])
	a.queue[n] = nil
	a.queue = a.queue[:n]
	r.state = aheadMapping
	a.busy = r
	a.parked = false
	cp := r.run()
	a.mu.Unlock()

	err := a.commit(cp)
	a.mu.Lock()
	if err == nil || cp.left() {
		a.list(r) // NB: left: what a failed undo kept, for the owner to settle
	} else {
		r.state = aheadNone // the step commits as without map-ahead
	}
	a.busy = nil
	a.cond.Broadcast()
	a.mu.Unlock()
	return true
}

// commit commits run r in each of its ranges, or none: a range that fails undoes
// those before it. A run that neither the pool's idle granules nor the free budget
// can hold now is not tried.
func (a *ahead) commit(r seqAhead) error {
	c := a.c
	if r.bytes() > c.idle()+c.gov.Available(c.dev)-a.reserved.Load() {
		return errAheadBudget
	}
	for i, b := range r.bufs {
		if err := b.CommitAhead(r.off, r.size); err != nil {
			if derr := dropRun(r.bufs[:i]); derr != nil {
				// NB: the runs that stay are given back by the ranges' Close.
				return errors.Join(err, derr)
			}
			return err
		}
	}
	return nil
}

// fill makes one more idle granule resident in the pool, if it holds fewer than want
// bytes of them and the budget has room besides what steps reserved (see fillShare
// and hold); it reports whether it made one. A refusal or failure of the pool leaves
// the filling to the next run that lands.
func (a *ahead) fill(want int64) bool {
	c := a.c
	g := int64(c.gran)
	limit := c.gov.Limit(c.dev)
	want = min(want, limit/fillShare/g*g)
	have := c.pool.PoolStats().Resident
	if have >= want || c.gov.Available(c.dev)-a.reserved.Load()-g < 2*(limit/fillShare) {
		return false
	}
	if err := c.pool.Prefill(int(have/g) + 1); err != nil {
		return false
	}
	// NB: a step may have taken granules meanwhile; the next call looks again.
	return c.pool.PoolStats().Resident > have
}

// errAheadBudget: the worker leaves a run the budget can not hold now.
var errAheadBudget = errors.New("kv: no budget for a run ahead")

// own returns the bytes of the runs mapped ahead, which every growth may take back.
func (a *ahead) own() int64 {
	if a == nil {
		return 0
	}
	return a.held.Load()
}

// hold keeps the worker from the budget that a step which needs need bytes of new
// granules (credit of them waited for already) counts on while it decides and
// commits, and returns the function that ends the hold. Where the pool holds no idle
// granule and the free budget, less what other steps reserved, holds need besides
// the run or granule in flight, it reserves need: the worker goes on, within the
// rest (see commit and fill). Otherwise it keeps the worker from starting a run or a
// filling, and where the budget is so short that the run or granule in flight could
// make the step fail, first waits for it to land (mapped, where reclaim can take it
// back, or idle, where the step takes it).
func (a *ahead) hold(need, credit int64) func() {
	c := a.c
	causes.Lock(&a.mu, causes.WaitAhead)
	margin := int64(0) // what the worker has in flight and may not have charged yet
	switch {
	case a.busy != nil:
		margin = a.busy.bytes()
	case a.filling:
		margin = int64(c.gran) // a granule the filling charged and has not made idle yet
	}
	// NB: only with no idle granule: the worker's runs take the pool's idle granules
	// first, so beside a step that counts on them it would leave the step new ones
	// to make (docs/benchmarks/kv.md, map-ahead: the steps that made a granule doubled). The
	// step's own commit lowers the free budget while its reservation stands, so the
	// worker sees less room than there is until the step ends: it errs towards
	// leaving a run to its step, never towards a refusal.
	if c.idle() == 0 && need+margin <= c.gov.Available(c.dev)+credit-a.reserved.Load() {
		a.reserved.Add(need)
		a.mu.Unlock()
		return func() { a.reserved.Add(-need) }
	}
	a.holds++
	tight := need-c.idle()-a.own()+margin > c.gov.Available(c.dev)+credit
	if tight && (a.busy != nil || a.filling) {
		causes.Add(causes.WaitAhead)
	}
	for tight && (a.busy != nil || a.filling) {
		a.cond.Wait()
	}
	a.mu.Unlock()
	return func() {
		causes.Lock(&a.mu, causes.WaitAhead)
		if a.holds--; a.holds == 0 {
			a.cond.Broadcast()
			causes.Add(causes.Wake)
		}
		a.mu.Unlock()
	}
}

// reclaim gives back runs mapped ahead, most recent first, until a growth that
// needs need bytes of new granules (credit waited for) fits in the pool's idle
// granules and the free budget, or none is left. Each goes idle in the pool (or,
// past the pool's High, back to the budget), where the growth takes it.
func (a *ahead) reclaim(need, credit int64) {
	c := a.c
	for need-c.idle() > c.gov.Available(c.dev)+credit {
		if a.dropLast() == 0 {
			return
		}
	}
}

// giveBack gives back runs mapped ahead, most recent first, until want bytes came
// back or none is left (an operation the backing refused for budget tries again
// with them); it returns the bytes given back.
func (a *ahead) giveBack(want int64) int64 {
	if a == nil {
		return 0
	}
	var got int64
	for got < want {
		n := a.dropLast()
		if n == 0 {
			break
		}
		got += n
	}
	return got
}

// dropLast gives back the run mapped last and returns its bytes: 0 when there is
// none, or when giving it back failed (the run then stays mapped, and its owner's
// settle finds what is left of it).
func (a *ahead) dropLast() int64 {
	a.mu.Lock()
	if len(a.mapped) == 0 {
		a.mu.Unlock()
		return 0
	}
	r := a.mapped[len(a.mapped)-1]
	a.unlist(r)
	r.state = aheadDropping
	cp := r.run()
	a.mu.Unlock()
	err := dropRun(cp.bufs)
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.cond.Broadcast()
	if err != nil {
		a.list(r)
		return 0
	}
	r.state = aheadNone
	return cp.bytes()
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

// dropAhead gives back s's runs ahead before its owner changes or shares its ranges
// (Truncate, Close, ForkAt, Freeze, PrefixCache.Insert).
func (s *Sequence) dropAhead() error {
	if s.c.ahead == nil {
		return nil
	}
	var errs []error
	for gi := range s.ahead {
		if _, err := s.c.ahead.settle(s, &s.ahead[gi], -1); err != nil {
			errs = append(errs, err)
		}
	}
	for gi := range s.gs {
		if err := s.c.ahead.settleBehind(&s.gs[gi].behind); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// idle returns the bytes the backing's pool holds idle.
func (c *Cache) idle() int64 {
	if c.pool == nil {
		return 0
	}
	return c.pool.PoolStats().Idle
}
