package arena_test

import (
	"errors"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
)

// testLeaveBehind: granules left behind leave the buffer with no backing call (b is
// counted through a backingtest.Faulty) and stay committed and charged until
// DecommitBehind or Close gives them back; the run grows while it ends at Start;
// bad input, a run that no longer ends at Start and a growth over the run are
// refused and change nothing; the ledger is exact at each step and holds nothing
// after Close. auth is the buffer's authority under ByBuffer (nil where the backing
// owns its memory), ledger where the granules are charged and mappings attributed.
func testLeaveBehind[R any, B backing.Backing[R]](t *testing.T, b B, auth, ledger *accounting.Authority) {
	f := backingtest.NewFaulty[R](b)
	buf, err := arena.NewBuffer[R](f, 8*g, auth)
	require.NoError(t, err)
	check := func(what string, start, committed, behindOff, behind int) {
		t.Helper()
		assert.Equal(t, start, buf.Start(), "%s: start", what)
		assert.Equal(t, committed, buf.Committed(), "%s: committed", what)
		off, size := buf.Behind()
		assert.Equal(t, []int{behindOff, behind}, []int{off, size}, "%s: the run behind", what)
		st := ledger.Stats()
		assert.Equal(t, int64(committed+behind), st.Mapped, "%s: mapped bytes", what)
		if auth != nil {
			assert.Equal(t, int64(committed+behind), st.Owned, "%s: owned bytes", what)
		} else {
			assert.GreaterOrEqual(t, st.Owned, st.Mapped, "%s: owned bytes", what)
		}
	}
	require.NoError(t, buf.Resize(6*g))
	if backing.IsHostAccessible(f) {
		buf.Bytes()[3*g] = 7
	}

	calls := f.Calls()
	left, err := buf.LeaveBehind(2*g + 1)
	require.NoError(t, err)
	require.True(t, left)
	assert.Equal(t, calls, f.Calls(), "leaving behind makes no backing call")
	assert.Equal(t, 6*g, buf.Len(), "the length stays")
	check("two granules left", 2*g, 4*g, 0, 2*g)

	for _, tt := range []struct {
		name string
		off  int
	}{{"negative", -1}, {"past the length", 6*g + 1}} {
		t.Run(tt.name, func(t *testing.T) {
			left, err := buf.LeaveBehind(tt.off)
			assert.ErrorIs(t, err, arena.ErrInvalidSize)
			assert.False(t, left)
			check("refused", 2*g, 4*g, 0, 2*g)
		})
	}
	left, err = buf.LeaveBehind(2*g + g/2)
	require.NoError(t, err)
	assert.True(t, left, "no whole granule below it: nothing to leave")
	check("nothing more", 2*g, 4*g, 0, 2*g)

	left, err = buf.LeaveBehind(3 * g)
	require.NoError(t, err)
	require.True(t, left)
	assert.Equal(t, calls, f.Calls())
	check("the run grew", 3*g, 3*g, 0, 3*g)
	if backing.IsHostAccessible(f) {
		assert.Equal(t, byte(7), buf.Bytes()[3*g], "the bytes from Start on stay")
	}

	n, err := buf.DecommitBehind()
	require.NoError(t, err)
	assert.Equal(t, 3*g, n)
	check("given back", 3*g, 3*g, 0, 0)
	n, err = buf.DecommitBehind()
	require.NoError(t, err)
	assert.Zero(t, n, "nothing left to give back")

	left, err = buf.LeaveBehind(4 * g)
	require.NoError(t, err)
	require.True(t, left)
	check("a new run", 4*g, 2*g, 3*g, g)
	require.NoError(t, buf.DecommitBelow(5*g))
	check("DecommitBelow beside it", 5*g, g, 3*g, g)
	left, err = buf.LeaveBehind(6 * g)
	require.NoError(t, err)
	assert.False(t, left, "a run that does not end at Start does not grow")
	check("not left", 5*g, g, 3*g, g)

	require.NoError(t, buf.Resize(0))
	assert.ErrorIs(t, buf.Resize(4*g), arena.ErrBehind, "a growth over the run behind is refused")
	check("refused growth", 0, 0, 3*g, g)
	require.NoError(t, buf.Resize(3*g), "a growth up to it is not")
	check("grown up to it", 0, 3*g, 3*g, g)
	require.Equal(t, accounting.Complete, buf.Close().Status, "Close gives back the run behind")
	assert.Zero(t, ledger.Stats().Mapped)
	if auth != nil {
		assert.Zero(t, ledger.Stats().Owned)
	}
}

func TestBufferLeaveBehind(t *testing.T) {
	onFakes(t, testLeaveBehind[*backingtest.FakeReservation, *backingtest.Fake], testLeaveBehind[*cuda.Reservation, *cuda.Backing])
}

// TestBufferLeaveBehindShared: granules that map another buffer's are left behind
// like the buffer's own: they leave Shared, stay mapped (the source's granules live
// on regardless) until DecommitBehind unmaps them, and a share over the run behind
// is refused.
func TestBufferLeaveBehindShared(t *testing.T) {
	pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: pool})
	src, err := arena.NewBuffer(f, 8*g, nil)
	require.NoError(t, err)
	require.NoError(t, src.Resize(4*g))
	dst, err := arena.NewBuffer(f, 8*g, nil)
	require.NoError(t, err)
	require.NoError(t, dst.ShareFrom(src, 2*g, backing.ReadOnly))
	require.NoError(t, dst.Resize(4*g))
	require.Equal(t, 2*g, dst.Shared())
	require.Equal(t, int64(6*g), pool.Stats().Owned)
	require.Equal(t, int64(8*g), pool.Stats().Mapped)

	left, err := dst.LeaveBehind(3 * g)
	require.NoError(t, err)
	require.True(t, left)
	assert.Equal(t, 3*g, dst.Start())
	assert.Zero(t, dst.Shared(), "the shared granules left with the rest")
	off, size := dst.Behind()
	assert.Equal(t, []int{0, 3 * g}, []int{off, size})
	assert.Equal(t, int64(8*g), pool.Stats().Mapped, "mapped until given back")
	n, err := dst.DecommitBehind()
	require.NoError(t, err)
	assert.Equal(t, 3*g, n)
	assert.Equal(t, int64(5*g), pool.Stats().Owned, "the source keeps its granules; the own one went back")
	assert.Equal(t, int64(5*g), pool.Stats().Mapped)

	require.NoError(t, dst.Resize(0))
	left, err = dst.LeaveBehind(0)
	require.NoError(t, err)
	assert.True(t, left, "nothing to leave")
	require.NoError(t, dst.ShareFrom(src, 2*g, backing.ReadOnly))
	left, err = dst.LeaveBehind(2 * g)
	require.NoError(t, err)
	require.True(t, left)
	require.NoError(t, dst.Resize(0))
	assert.ErrorIs(t, dst.ShareRange(src, 0, g, 2*g, backing.ReadOnly), arena.ErrBehind, "a share over the run behind")
	require.Equal(t, accounting.Complete, dst.Close().Status, "Close unmaps the run behind")
	require.Equal(t, accounting.Complete, src.Close().Status)
	assert.Zero(t, f.LiveGranules(), "granules leaked")
	assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
	assert.Zero(t, pool.Stats().Mapped)
}

// TestBufferLeaveBehindConcurrent: another goroutine gives back the runs the owner
// leaves behind while the owner grows, leaves granules behind and reads the buffer
// (run under -race): the ledger holds the committed bytes and at most what lies
// below Start, a run being given back is never grown (the owner gives those
// granules back itself), and every granule left goes back once.
func TestBufferLeaveBehindConcurrent(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 64*g, a)
	require.NoError(t, err)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var given int
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
				runtime.Gosched()
			}
			n, err := buf.DecommitBehind()
			switch {
			case errors.Is(err, arena.ErrBehindBusy):
				// NB: the owner gives it back itself before it empties the buffer
			case err != nil:
				t.Errorf("decommit behind: %v", err)
				return
			}
			given += n
		}
	}()
	stopped := false
	halt := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer halt()
	var kept int // what the owner gave back itself
	for i := range 2000 {
		if buf.Committed()+buf.Start() >= 62*g {
			for { // the owner gives back what is left behind, unless the other does
				n, err := buf.DecommitBehind()
				if err == nil {
					kept += n
					break
				}
				require.ErrorIs(t, err, arena.ErrBehindBusy)
				runtime.Gosched()
			}
			require.NoError(t, buf.Resize(0))
		}
		require.NoError(t, buf.Resize(buf.Start()+buf.Committed()+g))
		if i%2 == 1 {
			start := buf.Start()
			to := buf.Start() + g
			left, err := buf.LeaveBehind(to)
			require.NoError(t, err)
			if !left {
				require.NoError(t, buf.DecommitBelow(to))
				kept += to - start
			}
			require.Equal(t, to, buf.Start())
		}
		owned := a.Stats().Owned
		require.LessOrEqual(t, int64(buf.Committed()), owned)
		require.LessOrEqual(t, owned, int64(buf.Start()+buf.Committed()), "besides the committed bytes, at most what lies below Start")
	}
	halt()
	n, err := buf.DecommitBehind()
	require.NoError(t, err)
	given += n
	assert.Equal(t, 1000*g, given+kept, "every granule left went back once")
	assert.Equal(t, int64(buf.Committed()), a.Stats().Owned)
	require.Equal(t, accounting.Complete, buf.Close().Status)
	assert.Zero(t, a.Stats().Owned)
}
