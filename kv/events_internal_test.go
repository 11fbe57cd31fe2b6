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
	q.attach(&evSide{bs: 16})
	q.queued = 1 // as if the goroutine ran
	const n = 3*evFirst + 1
	for i := range n {
		q.push(evChange{kind: evDrop, id: uint64(i)})
	}
	require.Equal(t, int64(n+1), q.queued)
	require.Equal(t, evFirst, int(q.n))
	require.Len(t, q.more, n-evFirst)
	got := append(q.first[:q.n:q.n], q.more...)
	for i, c := range got {
		assert.Equal(t, uint64(i), c.id)
	}
	q.closing = true
	assert.PanicsWithValue(t, PanicEventsOutOfStep, func() { q.push(evChange{kind: evDrop}) }, "a change after Close")
}
