package arena_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// testAdoptAheadInPart: a run committed ahead is adopted a granule at a time, the rest
// staying Ahead at its new offset, with no backing call (b is counted through a
// backingtest.Faulty); the rest is given back by DecommitAhead or by Close; bad
// counts are refused and change nothing; the ledger is exact at each step and holds
// nothing after Close. auth is the buffers' authority under ByBuffer (nil where the
// backing owns its memory), ledger where the granules are charged and mappings
// attributed.
func testAdoptAheadInPart[R any, B backing.Backing[R]](t *testing.T, b B, auth, ledger *accounting.Authority) {
	f := backingtest.NewFaulty[R](b)
	buf, err := arena.NewBuffer[R](f, 8*g, auth)
	require.NoError(t, err)
	check := func(what string, committed, ahead int) {
		t.Helper()
		assert.Equal(t, committed, buf.Committed(), "%s: committed", what)
		_, size := buf.Ahead()
		assert.Equal(t, ahead, size, "%s: ahead", what)
		st := ledger.Stats()
		assert.Equal(t, int64(committed+ahead), st.Mapped, "%s: mapped bytes", what)
		if auth != nil {
			assert.Equal(t, int64(committed+ahead), st.Owned, "%s: owned bytes", what)
		} else {
			assert.GreaterOrEqual(t, st.Owned, st.Mapped, "%s: owned bytes", what)
		}
	}
	require.NoError(t, buf.Resize(g))
	require.NoError(t, buf.CommitAhead(g, 3*g))
	check("committed ahead", g, 3*g)

	calls := f.Calls()
	require.NoError(t, buf.AdoptAhead(g))
	assert.Equal(t, calls, f.Calls(), "adopting makes no backing call")
	assert.Equal(t, 2*g, buf.Len())
	off, size := buf.Ahead()
	assert.Equal(t, []int{2 * g, 2 * g}, []int{off, size}, "the rest stays ahead, past the committed bytes")
	check("one granule adopted", 2*g, 2*g)
	if backing.IsHostAccessible(f) {
		buf.Bytes()[2*g-1] = 7 // the adopted granule is the buffer's own
	}

	for _, tt := range []struct {
		name string
		n    int
		want error
	}{
		{"zero", 0, arena.ErrInvalidSize},
		{"negative", -g, arena.ErrInvalidSize},
		{"misaligned", g + 1, arena.ErrInvalidSize},
		{"more than the run", 3 * g, arena.ErrInvalidSize},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, buf.AdoptAhead(tt.n), tt.want)
			check("refused", 2*g, 2*g)
		})
	}
	assert.ErrorIs(t, buf.Resize(3*g), arena.ErrAhead, "a growth over the rest is refused")
	require.NoError(t, buf.Resize(2*g-1), "a shrink within the committed bytes is not")

	require.NoError(t, buf.AdoptAhead(g))
	off, size = buf.Ahead()
	assert.Equal(t, []int{3 * g, g}, []int{off, size})
	check("two granules adopted", 3*g, g)
	n, err := buf.DecommitAhead()
	require.NoError(t, err)
	assert.Equal(t, g, n, "the rest went back")
	check("the rest given back", 3*g, 0)
	if backing.IsHostAccessible(f) {
		assert.Equal(t, byte(7), buf.Bytes()[2*g-1], "adopted bytes keep what was written")
	}

	require.NoError(t, buf.CommitAhead(3*g, 2*g))
	require.NoError(t, buf.AdoptAhead(2*g), "the whole run")
	check("a whole run adopted", 5*g, 0)
	assert.ErrorIs(t, buf.AdoptAhead(g), arena.ErrAhead, "nothing left")

	require.NoError(t, buf.CommitAhead(6*g, 2*g))
	assert.ErrorIs(t, buf.AdoptAhead(g), arena.ErrAhead, "a run that is not at the committed bytes' end")
	check("not adopted", 5*g, 2*g)
	n, err = buf.DecommitAhead()
	require.NoError(t, err)
	assert.Equal(t, 2*g, n)

	require.NoError(t, buf.CommitAhead(5*g, 3*g))
	require.NoError(t, buf.AdoptAhead(g))
	check("a rest left for Close", 6*g, 2*g)
	require.Equal(t, accounting.Complete, buf.Close().Status)
	assert.Zero(t, ledger.Stats().Mapped, "Close gives back the rest ahead")
	if auth != nil {
		assert.Zero(t, ledger.Stats().Owned)
	}
}

// bufferTest is a generic Buffer test instantiated for one backing: b, the buffer's
// authority under ByBuffer (auth, nil where b owns its memory), and ledger, where the
// granules are charged.
type bufferTest[R any, B backing.Backing[R]] func(t *testing.T, b B, auth, ledger *accounting.Authority)

// onFakes runs a generic Buffer test on the Fake, ByBuffer and ByBacking, and on the
// CUDA fake (ByBacking), then checks that each gave everything back.
func onFakes(t *testing.T, fake bufferTest[*backingtest.FakeReservation, *backingtest.Fake], gpu bufferTest[*cuda.Reservation, *cuda.Backing]) {
	t.Run("ByBuffer", func(t *testing.T) {
		f, a := newFake(t, 1<<30)
		fake(t, f, a, a)
	})
	t.Run("ByBacking", func(t *testing.T) {
		pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
		f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: pool})
		fake(t, f, nil, pool)
		assert.Zero(t, f.LiveGranules(), "granules leaked")
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
	})
	t.Run("CUDAFake", func(t *testing.T) {
		drv := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: g, Memory: 64 << 20})
		pool := accounting.NewGovernor().Authority("kv", accounting.GPU(0))
		b, err := cuda.New(cuda.Options{Authority: pool, Driver: drv.Driver()})
		require.NoError(t, err)
		gpu(t, b, nil, pool)
		require.NoError(t, b.Close())
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
		assert.NoError(t, drv.CheckLeaks())
	})
}

func TestBufferAdoptAheadInPart(t *testing.T) {
	onFakes(t, testAdoptAheadInPart[*backingtest.FakeReservation, *backingtest.Fake], testAdoptAheadInPart[*cuda.Reservation, *cuda.Backing])
}
