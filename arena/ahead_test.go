package arena_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
)

// TestBufferCommitAhead: a run committed ahead is charged and live in the backing
// but no part of the buffer until AdoptAhead, which makes it so with no backing call;
// DecommitAhead and Close give it back.
func TestBufferCommitAhead(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 8*g, a)
	require.NoError(t, err)
	require.NoError(t, buf.Resize(g+1))

	require.NoError(t, buf.CommitAhead(2*g, 2*g))
	off, size := buf.Ahead()
	assert.Equal(t, []int{2 * g, 2 * g}, []int{off, size})
	assert.Equal(t, g+1, buf.Len(), "the buffer is as it was")
	assert.Equal(t, 2*g, buf.Committed())
	assert.Equal(t, 4, f.LiveGranules(), "the run is committed in the backing")
	assert.Equal(t, int64(4*g), a.Stats().Owned, "and charged")
	assert.ErrorIs(t, buf.Resize(3*g), arena.ErrAhead, "a growth over the run is refused")
	assert.Equal(t, 2*g, buf.Committed(), "and changes nothing")
	require.NoError(t, buf.Resize(2*g), "a growth up to it is not")
	assert.ErrorIs(t, buf.CommitAhead(6*g, g), arena.ErrAheadBusy, "one run at a time")

	faults := f.LiveGranules()
	require.NoError(t, buf.AdoptAhead(2*g))
	assert.Equal(t, 4*g, buf.Len())
	assert.Equal(t, 4*g, buf.Committed())
	assert.Equal(t, faults, f.LiveGranules(), "adopting commits nothing")
	_, size = buf.Ahead()
	assert.Zero(t, size)
	assert.ErrorIs(t, buf.AdoptAhead(g), arena.ErrAhead, "nothing left to adopt")

	require.NoError(t, buf.CommitAhead(4*g, g))
	n, err := buf.DecommitAhead()
	require.NoError(t, err)
	assert.Equal(t, g, n)
	assert.Equal(t, int64(4*g), a.Stats().Owned, "its charge went back")
	n, err = buf.DecommitAhead()
	require.NoError(t, err)
	assert.Zero(t, n, "nothing to give back")

	require.NoError(t, buf.CommitAhead(4*g, g))
	out := buf.Close()
	require.Equal(t, accounting.Complete, out.Status)
	assert.Zero(t, a.Stats().Owned, "Close gives back the run ahead too")
	assert.Zero(t, a.Stats().Mapped)
}

// TestBufferCommitAheadBadInput: misaligned, empty, negative or too large runs, and a
// run that is not at the committed bytes' end when adopted, are refused and change
// nothing.
func TestBufferCommitAheadBadInput(t *testing.T) {
	f, a := newFake(t, 4*g)
	buf, err := arena.NewBuffer(f, 8*g, a)
	require.NoError(t, err)
	defer buf.Close()
	require.NoError(t, buf.Resize(g))
	for _, tt := range []struct {
		name      string
		off, size int
		want      error
	}{
		{"misaligned offset", g + 1, g, arena.ErrInvalidSize},
		{"misaligned size", 2 * g, g - 1, arena.ErrInvalidSize},
		{"empty", 2 * g, 0, arena.ErrInvalidSize},
		{"negative", -g, g, arena.ErrInvalidSize},
		{"past the capacity", 7 * g, 2 * g, arena.ErrCapacity},
		{"over the budget", 2 * g, 4 * g, accounting.ErrBudgetExceeded},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, buf.CommitAhead(tt.off, tt.size), tt.want)
			_, size := buf.Ahead()
			assert.Zero(t, size)
			assert.Equal(t, 1, f.LiveGranules())
			assert.Equal(t, int64(g), a.Stats().Owned)
		})
	}
	t.Run("committed already", func(t *testing.T) {
		assert.Error(t, buf.CommitAhead(0, g), "the backing refuses a granule committed twice")
		assert.Equal(t, int64(g), a.Stats().Owned)
	})
	t.Run("not at the end", func(t *testing.T) {
		require.NoError(t, buf.CommitAhead(3*g, g))
		assert.ErrorIs(t, buf.AdoptAhead(g), arena.ErrAhead)
		assert.Equal(t, g, buf.Committed())
		off, size := buf.Ahead()
		assert.Equal(t, []int{3 * g, g}, []int{off, size}, "the run stays")
		n, err := buf.DecommitAhead()
		require.NoError(t, err)
		assert.Equal(t, g, n)
	})
}

// TestBufferCommitAheadConcurrent: another goroutine commits runs ahead while the
// owner grows, adopts them (whole or in part), gives them back, shrinks and reads
// the buffer (run under -race): the ledger stays exact and the buffer's own fields
// are the owner's alone.
func TestBufferCommitAheadConcurrent(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 64*g, a)
	require.NoError(t, err)
	var wg sync.WaitGroup
	want := make(chan int, 1) // the owner asks for a run at this offset
	wg.Add(1)
	go func() {
		defer wg.Done()
		for off := range want {
			if err := buf.CommitAhead(off, 2*g); err != nil {
				t.Errorf("commit ahead at %d: %v", off, err)
			}
		}
	}()
	for i := range 200 {
		end := buf.Committed()
		if end >= 58*g {
			require.NoError(t, buf.Resize(0))
			end = 0
		}
		want <- end
		// The owner reads and grows within its granules meanwhile.
		_ = buf.Len()
		_ = buf.Committed()
		for {
			if _, size := buf.Ahead(); size > 0 {
				break
			}
		}
		switch i % 4 {
		case 0:
			n, err := buf.DecommitAhead()
			require.NoError(t, err)
			require.Equal(t, 2*g, n)
			require.NoError(t, buf.Resize(end+2*g))
		case 1:
			require.NoError(t, buf.AdoptAhead(2*g))
		default:
			// In part: the rest stays ahead until adopted or given back.
			require.NoError(t, buf.AdoptAhead(g))
			off, size := buf.Ahead()
			require.Equal(t, []int{end + g, g}, []int{off, size})
			if i%4 == 2 {
				require.NoError(t, buf.AdoptAhead(g))
			} else {
				n, err := buf.DecommitAhead()
				require.NoError(t, err)
				require.Equal(t, g, n)
				require.NoError(t, buf.Resize(end+2*g))
			}
		}
		require.Equal(t, end+2*g, buf.Committed())
		require.Equal(t, int64(end+2*g), a.Stats().Owned)
	}
	close(want)
	wg.Wait()
	require.Equal(t, accounting.Complete, buf.Close().Status)
	assert.Zero(t, a.Stats().Owned)
}
