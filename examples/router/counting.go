package main

import (
	"sync/atomic"

	"github.com/vmarena/vmarena/kv"
)

// countingIndex counts the blocks the replicas announce and withdraw, passing each
// event on.
type countingIndex struct {
	stored, removed, cleared atomic.Int64
}

func (c *countingIndex) wrap(next kv.BlockEvents) kv.BlockEvents { return counted{c, next} }

func (c *countingIndex) stats() eventStats {
	return eventStats{Stored: c.stored.Load(), Removed: c.removed.Load(), Cleared: c.cleared.Load()}
}

type counted struct {
	c    *countingIndex
	next kv.BlockEvents
}

func (t counted) BlocksStored(e kv.BlocksStored) {
	t.c.stored.Add(int64(len(e.Hashes)))
	t.next.BlocksStored(e)
}

func (t counted) BlocksRemoved(e kv.BlocksRemoved) {
	t.c.removed.Add(int64(len(e.Hashes)))
	t.next.BlocksRemoved(e)
}

func (t counted) AllBlocksCleared() {
	t.c.cleared.Add(1)
	t.next.AllBlocksCleared()
}
