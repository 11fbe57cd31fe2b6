package kv

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestEventQueueOverflow: changes beyond the inline slots go to more, and the events'
// goroutine takes them in the order queued, the inline ones first.
func TestEventQueueOverflow(t *testing.T) {
	var pc PrefixCache
	q := &pc.ev
	q.attach(&evSide{bs: 16}, &pc.mu)
	q.started, q.lim = true, evFirst // as if the goroutine ran
	const n = 3*evFirst + 1
	for i := range n {
		*q.next() = evChange{kind: evDrop, id: uint64(i)}
	}
	require.Equal(t, int64(n), q.count())
	require.Equal(t, evFirst, int(q.n))
	require.Len(t, q.more, n-evFirst)
	got := append(q.first[:q.n:q.n], q.more...)
	for i, c := range got {
		assert.Equal(t, uint64(i), c.id)
	}
	q.closing, q.lim = true, 0
	assert.PanicsWithValue(t, PanicEventsOutOfStep, func() { *q.next() = evChange{kind: evDrop} }, "a change after Close")
}
