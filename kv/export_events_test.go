package kv

import (
	"testing"

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
// queue after each round.
func EventQueueAllocs(n int) float64 {
	ev := &pcEvents{bs: 16, started: true}
	tree := radix.New[*pcEntry]()
	path := make([]int32, n)
	for i := range path {
		path[i] = int32(i)
	}
	leaf, _, _ := tree.Insert(path, &pcEntry{})
	return testing.AllocsPerRun(100, func() {
		ev.inserted(path)
		p := ev.path(leaf)
		ev.sync(tree, p)
		ev.mu.Lock()
		if len(ev.queue) != 2 || len(ev.log) != 2*n || ev.queue[1].held != n {
			panic("EventQueueAllocs: not the changes queued")
		}
		ev.queue, ev.log = ev.queue[:0], ev.log[:0]
		ev.mu.Unlock()
	})
}
