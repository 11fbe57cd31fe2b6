package arena_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
)

func TestBufferStartAt(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 8*g, a)
	require.NoError(t, err)
	defer buf.Close()

	// Bad offsets are refused and change nothing.
	for _, off := range []int{-g, 1, g + 1, 9 * g} {
		assert.ErrorIs(t, buf.StartAt(off), arena.ErrInvalidSize, "start at %d", off)
		assert.Zero(t, buf.Start())
	}

	// Growth from a moved start commits only the granules from there on.
	require.NoError(t, buf.StartAt(3*g))
	assert.Equal(t, 3*g, buf.Start())
	assert.Zero(t, buf.Committed())
	assert.ErrorIs(t, buf.Resize(2*g), arena.ErrInvalidSize, "a length below the start")
	require.NoError(t, buf.Resize(5*g))
	assert.Equal(t, 2*g, buf.Committed())
	assert.Equal(t, int64(2*g), a.Stats().Owned, "only the granules from the start are charged")
	assert.Equal(t, 3*g, buf.Start())

	// A buffer with bytes in use can not move its start.
	assert.ErrorIs(t, buf.StartAt(0), arena.ErrNotEmpty)
	assert.Equal(t, 3*g, buf.Start())

	// Emptied, it grows from 0 again unless moved once more.
	require.NoError(t, buf.Resize(0))
	assert.Zero(t, buf.Start())
	assert.Zero(t, a.Stats().Owned)
	require.NoError(t, buf.StartAt(8*g))
	require.NoError(t, buf.Resize(8*g))
	assert.Zero(t, buf.Committed(), "a start at the capacity commits nothing")
}
