package kv

import (
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

// EventsQueued returns how many changes the prefix cache queued for its events'
// goroutine, in all (0 without an observer).
func (pc *PrefixCache) EventsQueued() int64 {
	if pc.ev == nil {
		return 0
	}
	pc.ev.mu.Lock()
	defer pc.ev.mu.Unlock()
	return pc.ev.queued
}

// EventQueueAllocs returns the allocations, on average, of queueing one Insert's and
// one eviction's change along a path of n tokens, as the cache's calls do, once the
// queue's buffers have grown: the events' goroutine is stood in for by emptying the
// queue after each round. (The path stays in the index, so that the round allocates
// nothing of its own.)
func EventQueueAllocs(n int) float64 {
	round := EventQueueRound(n, false)
	return testing.AllocsPerRun(100, func() { round() })
}

// EventQueueRound returns a round of queueing an Insert's and an eviction's change
// along a path of n tokens, then the queue emptied, which returns the time the events'
// calls took. With remove, the eviction takes the path's leaf out of the index, as
// the cache's do, and the round puts it back, untimed.
func EventQueueRound(n int, remove bool) func() time.Duration {
	ev := &pcEvents{bs: 16, started: true}
	tree := radix.New[*pcEntry]()
	path := make([]int32, n)
	for i := range path {
		path[i] = int32(i)
	}
	leaf, _, _ := tree.Insert(path, &pcEntry{})
	return func() time.Duration {
		t0 := time.Now()
		ev.inserted(path)
		p := ev.path(leaf)
		d := time.Since(t0)
		held := n
		if remove {
			tree.Remove(leaf)
			held = 0
		}
		t0 = time.Now()
		ev.sync(tree, p)
		d += time.Since(t0)
		ev.mu.Lock()
		if len(ev.queue) != 2 || len(ev.log) != 2*n || ev.queue[1].held != held {
			panic("EventQueueRound: not the changes queued")
		}
		ev.queue, ev.log = ev.queue[:0], ev.log[:0]
		ev.mu.Unlock()
		if remove {
			leaf, _, _ = tree.Insert(path, &pcEntry{})
		}
		return d
	}
}
