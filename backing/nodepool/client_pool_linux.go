package nodepool

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
)

// The client's pool of idle granules. A granule whose last mapping in the process
// goes stays with the client, charged, for its next commit (no message to the
// owner, no new memfd), up to ClientOptions.High, and goes back to the owner by
// host.Shared's decay rule (shared_decay.go there): each idle granule weighs
// 1 - smootherstep(age/Decay), the pool keeps max(Low, ceil(the weights' sum)) and
// gives back the longest idle first. The process's authority owns the idle granules
// and marks them idle (accounting.Authority.PutIdle), so that a commit that waits in
// its queue is served from them; the client reports their count to the owner (the
// idle message), whose ledger of the process marks them idle too.
//
// Giving them back: when another ledger of the process's governor waits (the
// authority's reclaimer, as host.Shared's), and when the owner asks (a reclaim
// message) for a request that waits on the node: stage one takes idle granules; stage
// two takes idle granules, then asks the process's other reclaimers (a kv.PrefixCache
// evicts cached prefixes no live sequence maps) and gives back what their eviction
// freed. While a request waits anywhere, a granule whose last mapping goes goes back
// rather than to the pool.

// maxQueuedReclaims bounds the owner's reclaim requests queued for the worker. The
// owner sends one at a time and another only after the first was answered or timed
// out; one that finds the queue full is answered at once, with nothing given back.
const maxQueuedReclaims = 4

// decaySteps is how many passes the scavenger makes per Decay (as host's).
const decaySteps = 16

// keep puts gr, whose last mapping went, in the pool, and reports whether it did: not
// a borrowed or lent granule, not past High, not while a request of another ledger
// waits (*pressure caches that answer: -1 unknown), one of this client waits on the
// node (the owner serves it with the granule) or the owner reclaims. c.mu must be
// held; the caller marks it idle on the authority.
func (c *Client) keep(gr *granule, pressure *int) bool {
	if gr.borrowed || gr.lent || c.closed || c.gone != nil || c.reclaiming > 0 || c.waiting > 0 || len(c.pool) >= c.high {
		return false
	}
	if *pressure < 0 {
		*pressure = 0
		if c.auth.OthersWait() {
			*pressure = 1
		}
	}
	if *pressure == 1 {
		return false
	}
	gr.since = time.Now()
	c.pool = append(c.pool, gr)
	return true
}

// takeIdle takes up to n idle granules out of the pool for use, the most recently
// idle (warmest) first, or the longest idle first when old is set; it takes only as
// many as the authority's idle bytes allow (the rest may be a waiting commit's
// already). c.mu must be held.
func (c *Client) takeIdle(n int, old bool) []*granule {
	n = min(n, len(c.pool))
	if n <= 0 {
		return nil
	}
	k := int(c.auth.TakeIdle(int64(n*c.g)) / int64(c.g))
	var out []*granule
	if old {
		out = slices.Clone(c.pool[:k])
		c.pool = slices.Delete(c.pool, 0, k)
	} else {
		out = slices.Clone(c.pool[len(c.pool)-k:])
		c.pool = c.pool[:len(c.pool)-k]
	}
	return out
}

// takeGranted takes k idle granules that the governor gave a waiting commit
// (AcquireIdle's idle part): they are no longer idle on the authority. c.mu must be
// held.
func (c *Client) takeGranted(k int) []*granule {
	if k > len(c.pool) {
		panic("nodepool: the governor granted more idle granules than the pool holds")
	}
	out := slices.Clone(c.pool[len(c.pool)-k:])
	c.pool = c.pool[:len(c.pool)-k]
	return out
}

// putIdle puts granules taken from the pool and not used back, idle since now; once
// the owner is gone it gives them up instead.
func (c *Client) putIdle(grs []*granule) {
	if len(grs) == 0 {
		return
	}
	c.mu.Lock()
	if c.gone != nil || c.closed {
		c.mu.Unlock()
		c.release(grs)
		closeAll(fdsOf(grs))
		return
	}
	defer c.mu.Unlock()
	now := time.Now()
	for _, gr := range grs {
		gr.since = now
	}
	c.pool = append(c.pool, grs...)
	c.auth.PutIdle(int64(len(grs) * c.g))
	c.startDecay()
}

// release gives back the authority's bytes of idle granules taken out of the pool
// (takeIdle) to be returned to the owner. c.mu must not be held.
func (c *Client) release(grs []*granule) int64 {
	if len(grs) == 0 {
		return 0
	}
	n := int64(len(grs) * c.g)
	c.mu.Lock()
	c.owned -= n
	c.givenBack += int64(len(grs))
	c.mu.Unlock()
	c.auth.Release(n)
	return n
}

// giveIdle gives up to n idle granules back to the owner, the longest idle first,
// and returns their bytes.
func (c *Client) giveIdle(n int) int64 {
	c.mu.Lock()
	grs := c.takeIdle(n, true)
	c.mu.Unlock()
	got := c.release(grs)
	c.giveBack(grs)
	return got
}

func fdsOf(grs []*granule) []int {
	fds := make([]int, len(grs))
	for i, gr := range grs {
		fds[i] = gr.fd
	}
	return fds
}

// report tells the owner how many granules the pool holds, when that changed since
// the last report. NB: one report at a time, each read after the change it reports,
// so that the owner sees the counts in order; a count may still reach the owner
// after a free of pooled granules sent later, and the owner bounds it by the
// granules the client holds.
func (c *Client) report() {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.mu.Lock()
	n := len(c.pool)
	same := n == c.reported
	c.reported = n
	c.mu.Unlock()
	if !same {
		_ = c.post(msg{op: opIdle, a: uint64(n)})
	}
}

// reclaimLocal is the authority's reclaimer: a request of another ledger of the
// process's governor waits, and the idle granules hold budget it can not otherwise
// have (host.Shared's reclaim).
func (c *Client) reclaimLocal(int64) {
	c.mu.Lock()
	if c.closed || !c.auth.OthersWait() {
		c.mu.Unlock() // only this client's requests wait: the idle granules serve them
		return
	}
	n := len(c.pool)
	c.mu.Unlock()
	if c.giveIdle(n) > 0 {
		c.report()
	}
}

// queueReclaim hands the owner's reclaim request m to the worker; it reports false
// when m is malformed. A request that finds the queue full is answered at once with
// nothing given back. It runs on the goroutine that reads the socket.
func (c *Client) queueReclaim(m msg) bool {
	if m.code != 0 || len(m.ids) != 0 || m.a == 0 || m.a > math.MaxInt64 || (m.b != stageIdle && m.b != stagePrefix) || m.c != 0 {
		return false
	}
	select {
	case c.reclaims <- m:
	default:
		go func() { _ = c.write(msg{op: opReclaim | replyBit, id: m.id}) }()
	}
	return true
}

// reclaimWorker serves the owner's reclaim requests in turn until Close.
func (c *Client) reclaimWorker() {
	defer c.bg.Done()
	for {
		select {
		case <-c.stop:
			return
		case m := <-c.reclaims:
			given := c.reclaim(int64(m.a), m.b)
			_ = c.write(msg{op: opReclaim | replyBit, id: m.id, a: uint64(given)})
		}
	}
}

// reclaim gives back want bytes for a request that waits on the node, as the owner
// asks in stage (see the top of this file), and returns the bytes given back. Their
// frees are on the socket before it returns.
func (c *Client) reclaim(want int64, stage uint64) int64 {
	given := c.giveIdle(c.granules(want))
	if stage == stagePrefix && given < want {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return given
		}
		c.reclaiming++
		before := c.reclaimGot
		c.mu.Unlock()
		c.auth.ReclaimOthers(want - given)
		c.mu.Lock()
		c.reclaiming--
		given += c.reclaimGot - before
		c.mu.Unlock()
		if given < want { // pooled by a decommit that was under way
			given += c.giveIdle(c.granules(want - given))
		}
	}
	c.report()
	return given
}

// granules returns how many granules hold n bytes, rounded up (n > 0, up to
// math.MaxInt64).
func (c *Client) granules(n int64) int {
	k := n / int64(c.g)
	if n%int64(c.g) != 0 {
		k++
	}
	return int(k)
}

// startDecay starts the scavenger when idle granules exceed Low and none runs.
// c.mu must be held.
func (c *Client) startDecay() {
	if c.decay <= 0 || c.decaying || c.closed || len(c.pool) <= c.low {
		return
	}
	c.decaying = true
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		t := time.NewTimer(c.decay / decaySteps)
		defer t.Stop()
		for {
			select {
			case <-t.C:
			case <-c.stop:
				return
			}
			if !c.decayPass(time.Now()) {
				return
			}
			t.Reset(c.decay / decaySteps)
		}
	}()
}

// decayPass gives back the idle granules that have decayed at now and reports
// whether idle granules above Low remain (when not, the scavenger stops; the next
// granule to go idle starts it again).
func (c *Client) decayPass(now time.Time) bool {
	c.mu.Lock()
	if c.closed {
		c.decaying = false
		c.mu.Unlock()
		return false
	}
	d := float64(c.decay.Nanoseconds())
	var w float64
	for _, gr := range c.pool {
		w += weight(float64(now.Sub(gr.since)) / d)
	}
	// The pool is in the order granules went idle but for those put back by a
	// commit that had to wait: sort, so the longest idle go first.
	slices.SortStableFunc(c.pool, func(a, b *granule) int { return cmp.Compare(a.since.UnixNano(), b.since.UnixNano()) })
	keep := max(c.low, int(math.Ceil(w-1e-9)))
	var grs []*granule
	if k := len(c.pool) - keep; k > 0 {
		grs = c.takeIdle(k, true)
	}
	c.mu.Unlock()
	if len(grs) > 0 {
		c.release(grs)
		c.giveBack(grs)
		c.report()
	}
	c.mu.Lock()
	more := !c.closed && len(c.pool) > c.low
	if !more {
		c.decaying = false
	}
	c.mu.Unlock()
	return more
}

// weight is 1 - smootherstep(x) on [0, 1], 0 beyond (host's sharedWeight).
func weight(x float64) float64 {
	if x >= 1 {
		return 0
	}
	x = max(x, 0)
	return 1 - x*x*x*(x*(6*x-15)+10)
}

// Prefill makes at least n idle granules resident in the pool (every page allocated,
// so that the first touch takes no fault): it allocates the pages of idle granules
// that are not, then asks the owner for the missing granules now, within this
// process's and the node's budgets (it does not wait), and charges them to the
// process as idle. A client that keeps no pool (ClientNoPool) answers
// ErrUnsupported.
func (c *Client) Prefill(n int) error {
	return c.prefill(context.Background(), n, false)
}

// PrefillCtx is Prefill that waits for the node's budget in the owner's FIFO queue,
// with ctx's deadline carried across the socket, until ctx ends
// (backing.PoolWaiter). This process's own budget it does not wait for: its governor
// refuses at once, as for Prefill. kv's AppendCtx waits here when this process's
// governor granted a step the node refused.
func (c *Client) PrefillCtx(ctx context.Context, n int) error {
	return c.prefill(ctx, n, true)
}

func (c *Client) prefill(ctx context.Context, n int, wait bool) error {
	if n < 0 {
		return &backing.OpError{Op: "prefill", Size: n, Kind: backing.ErrInvalidRange}
	}
	c.mu.Lock()
	if c.high == 0 {
		c.mu.Unlock()
		return &backing.OpError{Op: "prefill", Kind: backing.ErrUnsupported, Err: errNoPool}
	}
	if c.closed {
		c.mu.Unlock()
		return &backing.OpError{Op: "prefill", Err: ErrClosed}
	}
	have := 0
	for _, gr := range c.pool {
		if gr.resident {
			have++
		}
	}
	var cold []*granule
	if have < n {
		// NB: out of the pool while their pages are allocated, so that nothing
		// closes their descriptors meanwhile.
		cold = c.takeCold(n - have)
	}
	c.mu.Unlock()
	err := populate(cold, c.g)
	c.putIdle(cold)
	if err != nil {
		return &backing.OpError{Op: "prefill", Kind: backing.ErrOutOfMemory, Err: err}
	}
	k := n - have - len(cold)
	if k <= 0 {
		return nil
	}
	size := int64(k * c.g)
	if err := c.auth.TryAcquire(size); err != nil {
		return &backing.OpError{Op: "prefill", Size: int(size), Err: err}
	}
	grs, err := c.allocate(ctx, k, wait)
	if err != nil {
		c.auth.Release(size)
		return &backing.OpError{Op: "prefill", Size: int(size), Err: err}
	}
	c.mu.Lock()
	c.owned += size
	c.created += int64(k)
	c.mu.Unlock()
	err = populate(grs, c.g)
	c.putIdle(grs)
	c.report()
	if err != nil {
		return &backing.OpError{Op: "prefill", Kind: backing.ErrOutOfMemory, Err: err}
	}
	return nil
}

// errNoPool: the client keeps no pool (ClientNoPool).
var errNoPool = errors.New("nodepool: the client keeps no pool (ClientNoPool)")

// takeCold takes up to k idle granules that are not resident out of the pool, the
// most recently idle first, as takeIdle does. c.mu must be held.
func (c *Client) takeCold(k int) []*granule {
	cold := 0
	for _, gr := range c.pool {
		if !gr.resident {
			cold++
		}
	}
	k = min(k, cold)
	if k <= 0 {
		return nil
	}
	k = int(c.auth.TakeIdle(int64(k*c.g)) / int64(c.g))
	var out []*granule
	for i := len(c.pool) - 1; i >= 0 && len(out) < k; i-- {
		if !c.pool[i].resident {
			out = append(out, c.pool[i])
			c.pool = slices.Delete(c.pool, i, i+1)
		}
	}
	return out
}

// populate allocates every page of granules grs (of g bytes) in their memfds, and
// marks those it did resident.
func populate(grs []*granule, g int) error {
	for _, gr := range grs {
		if err := unix.Fallocate(gr.fd, 0, 0, int64(g)); err != nil {
			return fmt.Errorf("fallocate: %w", err)
		}
		gr.resident = true
	}
	return nil
}

// Trim gives idle granules back to the owner until at most keep remain, and
// returns the bytes given back.
func (c *Client) Trim(keep int) (int64, error) {
	if keep < 0 {
		return 0, &backing.OpError{Op: "trim", Size: keep, Kind: backing.ErrInvalidRange}
	}
	c.mu.Lock()
	if c.high == 0 {
		c.mu.Unlock()
		return 0, &backing.OpError{Op: "trim", Kind: backing.ErrUnsupported, Err: errNoPool}
	}
	k := len(c.pool) - keep
	c.mu.Unlock()
	if k <= 0 {
		return 0, nil
	}
	n := c.giveIdle(k)
	c.report()
	return n, nil
}

// PoolStats returns a snapshot of the pool; that of a client that keeps no pool
// (ClientNoPool) is zero. Resident counts the idle granules Prefill populated (the
// pages of a granule that was only mapped and written may be resident too: the
// client does not know which).
func (c *Client) PoolStats() backing.PoolStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.high == 0 {
		return backing.PoolStats{}
	}
	resident := 0
	for _, gr := range c.pool {
		if gr.resident {
			resident++
		}
	}
	return backing.PoolStats{Granule: c.g, Owned: c.owned, Idle: int64(len(c.pool) * c.g), Mapped: c.mapped,
		Resident: int64(resident * c.g), Low: c.low, High: c.high, Created: c.created, GivenBack: c.givenBack}
}
