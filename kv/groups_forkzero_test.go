package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestGroupForkAtZeroAfterWindowDrop: a fork at 0 tokens of a sequence whose window
// group gave its first blocks back shares nothing and holds nothing, and grows as a
// new sequence does (it used to ask the arena to share an empty range below the
// window's Start, which the arena refuses).
func TestGroupForkAtZeroAfterWindowDrop(t *testing.T) {
	fx := newGroupFixture(t)
	c, err := kv.New(fx.fake, kv.Config{Model: tinyHybrid, MaxTokens: 100})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	s, err := c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, s.Append(60))
	require.NoError(t, s.Append(1)) // the window gives back what no step from 60 on reads
	require.Positive(t, s.FirstHeld(0), "the window gave its first tokens back")
	f, err := s.ForkAt(0)
	require.NoError(t, err)
	defer f.Close()
	assert.Zero(t, f.Len())
	require.NoError(t, f.Append(7))
	assert.Equal(t, 7, f.Len())
}
