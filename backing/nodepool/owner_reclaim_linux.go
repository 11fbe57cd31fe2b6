package nodepool

import (
	"cmp"
	"slices"
	"time"
)

// Memory that moves: when a request waits for the node's budget (the governor queues
// it), the owner takes memory back from the attached processes, in this order: free
// budget (the queue serves from it before anything waits), idle pooled granules (each
// process reports how many it keeps; the owner asks those that keep most first, for
// as much as the waiter needs), then cached prefixes no live sequence maps (every
// process is asked for what the idle granules do not cover: its own reclaimers
// decide, and a kv.PrefixCache evicts only what no live sequence maps). Never a live
// token: nothing else is asked for.
//
// The owner waits for nobody: a request is sent on a goroutine of its own with a
// write deadline, each process has at most one unanswered, and one not answered
// within reclaimTimeout is counted (ReclaimStats.Unanswered) and no longer waited
// for. What an answer of stage one leaves short of its ask (a stale idle count, or a
// lie), or an unanswered one, is asked of every process's cached prefixes while a
// request still waits. Requests that come while one is unanswered merge into one
// sent when it is answered, if a request still waits then. And while a request
// waits, a process that reports idle granules is asked for them at once, as a
// host.Shared pool gives back what goes idle while others wait.

// reclaimTimeout bounds the wait for a client's answer to a reclaim.
const reclaimTimeout = 500 * time.Millisecond

// reclaimAsk is a reclaim sent to a client and not answered yet.
type reclaimAsk struct {
	id    uint64
	stage uint64
	bytes int64
	timer *time.Timer
}

// reclaim is the node's reclaimer (accounting.Authority.SetReclaimer on o.node): a
// request of need bytes started to wait on the node's governor.
func (o *Owner) reclaim(need int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed || need <= 0 {
		return
	}
	cs := make([]*ownerConn, 0, len(o.clients))
	for c := range o.clients {
		cs = append(cs, c)
	}
	slices.SortFunc(cs, func(a, b *ownerConn) int {
		if a.idle != b.idle {
			return cmp.Compare(b.idle, a.idle)
		}
		return cmp.Compare(a.number, b.number)
	})
	covered := int64(0)
	for _, c := range cs {
		if covered >= need || c.idle == 0 {
			break
		}
		b := min(int64(c.idle)*int64(o.g), need-covered)
		covered += b
		c.askLocked(stageIdle, b)
	}
	if covered < need {
		for _, c := range cs {
			c.askLocked(stagePrefix, need-covered)
		}
	}
}

// askLocked asks the client to give back bytes in stage, on a goroutine of its own;
// while an earlier ask is unanswered it merges into the one sent after it. o.mu must
// be held.
func (c *ownerConn) askLocked(stage uint64, bytes int64) {
	o := c.o
	if c.gone || !c.ready || o.closed || bytes <= 0 {
		return // NB: not before its hello's answer, which must come first
	}
	if c.ask != nil {
		c.want = max(c.want, bytes)
		c.wantStage = max(c.wantStage, stage)
		return
	}
	c.askNext++
	a := &reclaimAsk{id: c.askNext, stage: stage, bytes: bytes}
	a.timer = time.AfterFunc(reclaimTimeout, func() { c.answered(a.id, 0, true) })
	c.ask = a
	c.reclaims++
	o.rstats.Asked++
	o.rstats.AskedBytes += bytes
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		m := msg{op: opReclaim, id: a.id, a: uint64(bytes), b: stage}
		// NB: a client that does not read its socket must not hold this goroutine:
		// the write gives up with the ask's bound, and the timer counts it.
		_ = c.c.send(m.encode(make([]byte, 0, headerLen)), nil, time.Now().Add(reclaimTimeout))
	}()
}

// answered ends the ask id: the client gave back given bytes, or did not answer in
// time (timedOut). It reports false when id was never sent (a protocol violation).
func (c *ownerConn) answered(id uint64, given uint64, timedOut bool) bool {
	o := c.o
	o.mu.Lock()
	defer o.mu.Unlock()
	if id == 0 || id > c.askNext {
		return false
	}
	a := c.ask
	if a == nil || a.id != id {
		if !timedOut {
			o.rstats.Late++ // answered after it was counted unanswered
		}
		return true
	}
	a.timer.Stop()
	c.ask = nil
	got := int64(min(given, uint64(a.bytes)))
	if timedOut {
		o.rstats.Unanswered++
	} else {
		o.rstats.Answered++
		o.rstats.Given += got
	}
	want, wantStage := c.want, c.wantStage
	c.want, c.wantStage = 0, 0
	if !o.node.OthersWait() {
		return true // nobody waits any more
	}
	if short := a.bytes - got; short > 0 && (a.stage == stageIdle || timedOut) {
		if !timedOut {
			o.rstats.Short++
		}
		for cl := range o.clients {
			cl.askLocked(stagePrefix, short)
		}
	}
	if want > 0 {
		c.askLocked(wantStage, want)
	}
	return true
}

// setIdle records the client's report of n idle granules, bounded by the granules
// it holds, on its ledger; while another client's request waits it asks for them.
// o.mu must be held.
func (c *ownerConn) setIdle(n uint64) {
	o := c.o
	k := int(min(n, uint64(len(c.granules))))
	switch g := int64(o.g); {
	case k > c.idle:
		c.auth.PutIdle(int64(k-c.idle) * g)
	case k < c.idle:
		c.auth.TakeIdle(int64(c.idle-k) * g)
	}
	c.idle = k
	if k > 0 && c.auth.OthersWait() {
		c.askLocked(stageIdle, int64(k)*int64(o.g))
	}
}
