package kv

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmarena/vmarena/internal/radix"
)

// IndexPaths returns the tokens of every path from the root to a leaf of the index.
func (pc *PrefixCache) IndexPaths() [][]int32 {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	var out [][]int32
	for leaf := range pc.tree.EachLeaf {
		out = append(out, leaf.Tokens())
	}
	return out
}

// IndexEntries returns, for every leaf of the index, its tokens and, per layer group,
// the first token its entry's sequence holds there (as FirstHeld reads it).
func (pc *PrefixCache) IndexEntries() (paths [][]int32, held [][]int) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	for leaf := range pc.tree.EachLeaf {
		e := leaf.Value()
		h := make([]int, len(pc.c.groups))
		for gi := range h {
			if e.seq != nil {
				h[gi] = e.seq.heldOf(gi)
			}
		}
		paths = append(paths, leaf.Tokens())
		held = append(held, h)
	}
	return paths, held
}

// EventsQueued returns how many changes the prefix cache queued for its events'
// goroutine, in all (0 without an observer).
func (pc *PrefixCache) EventsQueued() int64 {
	if pc.ev.side == nil {
		return 0
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return pc.ev.count()
}

// EventPaths returns, once every change so far is applied, how many inserted paths
// the events' side keeps and how many entries the index holds (0, 0 without an
// observer).
func (pc *PrefixCache) EventPaths() (paths, entries int) {
	if pc.ev.side == nil {
		return 0, 0
	}
	pc.ev.flush() // NB: the events' goroutine takes pc.mu to take the queue
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.ev.applied != pc.ev.count() {
		panic("EventPaths: a change queued during the flush")
	}
	return len(pc.ev.side.paths), pc.entries
}

// EventQueueAllocs returns the allocations, on average, of queueing one Insert's and
// one eviction's change along a path of n tokens, as the cache's calls do, once the
// queue's buffers have grown: the events' goroutine is stood in for by emptying the
// queue after each round. (The path stays in the index, so that the round allocates
// nothing of its own.)
func EventQueueAllocs(n int) float64 {
	round := EventQueueRound(n, false, nil)
	return testing.AllocsPerRun(100, func() { round() })
}

// EventQueueRound returns a round of queueing an Insert's and an eviction's change
// along a path of n tokens, then the queue emptied, which returns the time the events'
// calls took. With remove, the eviction takes the path's leaf out of the index, as
// the cache's do, and the round puts it back, untimed. before, when not nil, runs
// before each of the two calls, untimed; then the entry and its leaf are read, as
// the cache's call has before it queues (before the eviction's Remove), and the
// clock once. Each call is made with the prefix cache's lock held, taken untimed
// after before, as the cache's calls hold it.
func EventQueueRound(n int, remove bool, before func()) func() time.Duration {
	// The queue as a prefix cache holds it, as if its goroutine ran.
	pc := &PrefixCache{}
	ev := &pc.ev
	ev.attach(&evSide{bs: 16}, &pc.mu)
	ev.started, ev.lim = true, evFirst // as if the goroutine ran
	tree := radix.New[*pcEntry]()
	tree.DeferReuse()
	path := make([]int32, n)
	for i := range path {
		path[i] = int32(i)
	}
	e := &pcEntry{}
	e.leaf, _, _ = tree.Insert(path, e)
	var sink int
	prepare := func() {
		if before != nil {
			before()
			sink += e.leaf.Depth() + e.leaf.Parent().Depth() + int(e.leaf.Edge()[0]) + int(e.evID)
			_ = time.Now()
		}
		pc.mu.Lock()
	}
	return func() time.Duration {
		prepare()
		t0 := time.Now()
		ev.inserted(tree, e, 0, nil, false)
		d := time.Since(t0)
		pc.mu.Unlock()
		held := n
		prepare()
		if remove {
			tree.Remove(e.leaf)
			held = 0
		}
		t0 = time.Now()
		ev.cut(e, held, remove)
		d += time.Since(t0)
		pc.mu.Unlock()
		pc.mu.Lock()
		q := ev.first[:ev.n]
		if len(q) != 2 || len(ev.more) != 0 || q[0].kind != evInsert || len(q[0].tail) != n || q[1].kind != evCut || int(q[1].n) != held || q[1].id != q[0].id || sink < 0 {
			panic("EventQueueRound: not the changes queued")
		}
		clear(ev.first[:])
		ev.taken += int64(ev.n)
		ev.n = 0
		ev.applied = ev.taken // as the events' goroutine would
		pc.mu.Unlock()
		if remove {
			e.leaf, _, _ = tree.Insert(path, e)
		}
		return d
	}
}

// HoldEvents returns park, which returns once the events' goroutine waits at a poll
// before it takes the queue (it allocates nothing meanwhile), and resume, which lets
// it go on. Before the cache's first change, and park after it (the goroutine runs
// from it); nil, nil without an observer.
func (pc *PrefixCache) HoldEvents() (park, resume func()) {
	ev := pc.ev.side
	if ev == nil {
		return nil, nil
	}
	var held atomic.Bool
	parked, cont := make(chan struct{}), make(chan struct{})
	ev.hold = func() {
		if held.Load() {
			parked <- struct{}{}
			<-cont
		}
	}
	park = func() {
		held.Store(true)
		select {
		case ev.kick <- struct{}{}:
		default:
		}
		<-parked
	}
	resume = func() {
		held.Store(false)
		cont <- struct{}{}
	}
	return park, resume
}

// OnReclaimed makes fn called as each of the prefix cache's reclaims returns (each
// starts on a goroutine of its own when a request on another ledger of the device
// starts to wait); nil: none.
func (pc *PrefixCache) OnReclaimed(fn func()) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.reclaimed = fn
}
