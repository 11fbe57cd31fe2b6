package arena_test

import (
	"bytes"
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

// windowEnv is one backing under the window tests: DecommitBelow and ShareRange.
type windowEnv[R any, B backing.Backing[R]] struct {
	b      B
	auth   *accounting.Authority // the buffers' authority under ByBuffer, else nil
	ledger *accounting.Authority // where the granules are charged and mappings attributed
	// live returns the physical granules alive, or is nil where a pool hides them.
	live func() int
}

// check asserts that the ledger matches the buffers exactly: every committed byte is
// attributed once per mapping, and under ByBuffer owned once.
func (e windowEnv[R, B]) check(t *testing.T, what string, bufs ...*arena.Buffer[R, B]) {
	t.Helper()
	mapped := 0
	for _, b := range bufs {
		mapped += b.Committed()
	}
	st := e.ledger.Stats()
	assert.Equal(t, int64(mapped), st.Mapped, "%s: mapped bytes", what)
	if e.auth != nil {
		assert.Equal(t, int64(mapped), st.Owned, "%s: owned bytes", what)
	}
}

// fill writes a byte pattern (the offset's granule number plus one, mixed with the
// offset) to buf's bytes [from, to).
func fill[R any, B backing.Backing[R]](t *testing.T, buf *arena.Buffer[R, B], from, to int) {
	t.Helper()
	c, ok := any(buf.Backing()).(backing.Copier[R])
	require.True(t, ok, "the window tests copy through backing.Copier")
	require.NoError(t, c.CopyIn(buf.Reservation(), from, pattern(from, to)))
}

func pattern(from, to int) []byte {
	p := make([]byte, to-from)
	for i := range p {
		p[i] = byte((from+i)/g+1) ^ byte(from+i)
	}
	return p
}

// readable asserts that buf's bytes [from, to) still hold the pattern fill wrote and
// that the byte just below Start can not be read.
func readable[R any, B backing.Backing[R]](t *testing.T, buf *arena.Buffer[R, B], from, to int) {
	t.Helper()
	c := any(buf.Backing()).(backing.Copier[R])
	got := make([]byte, to-from)
	require.NoError(t, c.CopyOut(got, buf.Reservation(), from))
	assert.True(t, bytes.Equal(pattern(from, to), got), "bytes [%d, %d) kept", from, to)
	if s := buf.Start(); s > 0 {
		assert.Error(t, c.CopyOut(make([]byte, 1), buf.Reservation(), s-1), "the byte below Start is not committed")
	}
}

// testDecommitBelow walks a buffer through DecommitBelow, growth and shrinking, with
// the accounting checked after every step.
func testDecommitBelow[R any, B backing.Backing[R]](t *testing.T, e windowEnv[R, B]) {
	buf, err := arena.NewBuffer(e.b, 16*g, e.auth)
	require.NoError(t, err)
	base := buf.Base()
	require.NoError(t, buf.Resize(5*g+7))
	fill(t, buf, 0, 5*g+7)

	steps := []struct {
		name              string
		op                func() error
		len, start, comm  int
		liveFrom, liveEnd int // the bytes still holding the pattern
	}{
		{"below an unaligned offset", func() error { return buf.DecommitBelow(2*g + 5) }, 5*g + 7, 2 * g, 4 * g, 2 * g, 5*g + 7},
		{"below what is gone already", func() error { return buf.DecommitBelow(g) }, 5*g + 7, 2 * g, 4 * g, 2 * g, 5*g + 7},
		{"below the start exactly", func() error { return buf.DecommitBelow(2 * g) }, 5*g + 7, 2 * g, 4 * g, 2 * g, 5*g + 7},
		{"grow on", func() error { return buf.Resize(9 * g) }, 9 * g, 2 * g, 7 * g, 2 * g, 5*g + 7},
		{"below the length", func() error { return buf.DecommitBelow(9 * g) }, 9 * g, 9 * g, 0, 0, 0},
		{"grow from the start", func() error { return buf.Resize(10*g + 1) }, 10*g + 1, 9 * g, 2 * g, 0, 0},
		{"shrink to the start", func() error { return buf.Resize(9 * g) }, 9 * g, 9 * g, 0, 0, 0},
		{"empty", func() error { return buf.Resize(0) }, 0, 0, 0, 0, 0},
		{"grow again from 0", func() error { return buf.Resize(6 * g) }, 6 * g, 0, 6 * g, 0, 0},
		{"below a granule boundary", func() error { return buf.DecommitBelow(4 * g) }, 6 * g, 4 * g, 2 * g, 0, 0},
		{"below zero changes nothing", func() error { return buf.DecommitBelow(0) }, 6 * g, 4 * g, 2 * g, 0, 0},
	}
	for _, st := range steps {
		require.NoError(t, st.op(), st.name)
		assert.Equal(t, st.len, buf.Len(), "%s: Len", st.name)
		assert.Equal(t, st.start, buf.Start(), "%s: Start", st.name)
		assert.Equal(t, st.comm, buf.Committed(), "%s: Committed", st.name)
		assert.Equal(t, base, buf.Base(), "%s: the base never moves", st.name)
		assert.Zero(t, buf.Shared(), st.name)
		e.check(t, st.name, buf)
		if e.live != nil {
			assert.Equal(t, st.comm/g, e.live(), "%s: physical granules", st.name)
		}
		if st.liveEnd > st.liveFrom {
			readable(t, buf, st.liveFrom, st.liveEnd)
		}
	}

	for _, off := range []int{-1, buf.Len() + 1} {
		assert.ErrorIs(t, buf.DecommitBelow(off), arena.ErrInvalidSize, "DecommitBelow(%d)", off)
	}
	for _, n := range []int{1, 3*g + 1, 4*g - 1} {
		assert.ErrorIs(t, buf.Resize(n), arena.ErrInvalidSize, "Resize(%d) below Start", n)
	}
	assert.Equal(t, 6*g, buf.Len())
	assert.Equal(t, 4*g, buf.Start(), "a refusal changes nothing")
	assert.Equal(t, 2*g, buf.Committed())
	e.check(t, "after the refusals", buf)

	assert.Equal(t, accounting.Complete, buf.Close().Status)
	e.check(t, "after Close")
	assert.PanicsWithValue(t, arena.PanicClosed, func() { _ = buf.DecommitBelow(0) })
}

// testShareRange shares middle ranges between buffers whose starts moved, with the
// accounting checked after every step. The backing must share (ByBacking).
func testShareRange[R any, B backing.Backing[R]](t *testing.T, e windowEnv[R, B]) {
	src, err := arena.NewBuffer(e.b, 8*g, nil)
	require.NoError(t, err)
	defer src.Close()
	dst, err := arena.NewBuffer(e.b, 10*g, nil)
	require.NoError(t, err)
	defer dst.Close()
	require.NoError(t, src.Resize(6*g))
	fill(t, src, 0, 6*g)
	require.NoError(t, src.DecommitBelow(g))
	e.check(t, "the source's window", src, dst)

	// Each refusal changes nothing.
	bad := []struct {
		name           string
		srcOff, dstOff int
		size           int
		want           error
	}{
		{"misaligned source", g + 1, 2 * g, g, arena.ErrInvalidSize},
		{"misaligned destination", 2 * g, 2*g + 1, g, arena.ErrInvalidSize},
		{"misaligned size", 2 * g, 2 * g, g + 1, arena.ErrInvalidSize},
		{"negative offset", -g, 2 * g, g, arena.ErrInvalidSize},
		{"negative size", 2 * g, 2 * g, -g, arena.ErrInvalidSize},
		{"below the source's start", 0, 0, 2 * g, arena.ErrInvalidSize},
		{"past the source's end", 4 * g, 4 * g, 3 * g, arena.ErrInvalidSize},
		{"past the capacity", 2 * g, 9 * g, 2 * g, arena.ErrCapacity},
	}
	for _, tt := range bad {
		assert.ErrorIs(t, dst.ShareRange(src, tt.srcOff, tt.dstOff, tt.size, backing.ReadOnly), tt.want, tt.name)
		assert.Zero(t, dst.Committed(), tt.name)
		assert.Zero(t, dst.Len(), tt.name)
		e.check(t, tt.name, src, dst)
	}
	require.NoError(t, dst.ShareRange(src, 2*g, 2*g, 0, backing.ReadOnly), "an empty share")
	assert.Zero(t, dst.Len(), "an empty share changes nothing")

	steps := []struct {
		name                     string
		op                       func() error
		len, start, comm, shared int
	}{
		{"share a middle range", func() error { return dst.ShareRange(src, 2*g, 2*g, 3*g, backing.ReadOnly) }, 5 * g, 2 * g, 3 * g, 3 * g},
		{"grow on own granules", func() error { return dst.Resize(7 * g) }, 7 * g, 2 * g, 5 * g, 3 * g},
		{"share on at the end", func() error { return dst.ShareRange(src, 5*g, 7*g, g, backing.ReadOnly) }, 8 * g, 2 * g, 6 * g, 4 * g},
		{"decommit into the first share", func() error { return dst.DecommitBelow(3 * g) }, 8 * g, 3 * g, 5 * g, 3 * g},
		{"shrink off the last share", func() error { return dst.Resize(6*g + 1) }, 6*g + 1, 3 * g, 4 * g, 2 * g},
		{"decommit past the first share", func() error { return dst.DecommitBelow(5 * g) }, 6*g + 1, 5 * g, 2 * g, 0},
	}
	for _, st := range steps {
		require.NoError(t, st.op(), st.name)
		assert.Equal(t, st.len, dst.Len(), "%s: Len", st.name)
		assert.Equal(t, st.start, dst.Start(), "%s: Start", st.name)
		assert.Equal(t, st.comm, dst.Committed(), "%s: Committed", st.name)
		assert.Equal(t, st.shared, dst.Shared(), "%s: Shared", st.name)
		e.check(t, st.name, src, dst)
	}
	// dst's own granules never held the pattern; its shares did.
	fill(t, dst, 5*g, 6*g)
	readable(t, dst, 5*g, 6*g)
	assert.ErrorIs(t, dst.ShareRange(src, 2*g, 2*g, g, backing.ReadOnly), arena.ErrNotEmpty, "a share must start where the committed bytes end")
	assert.ErrorIs(t, dst.ShareFrom(src, 0, backing.ReadOnly), arena.ErrNotEmpty)

	// The source gives its window up; the granules the other buffer shared live on.
	require.NoError(t, dst.Resize(0))
	require.NoError(t, dst.ShareRange(src, 3*g, 3*g, 2*g, backing.ReadOnly))
	require.NoError(t, src.DecommitBelow(src.Len()))
	assert.Zero(t, src.Committed())
	readable(t, dst, 3*g, 5*g)
	e.check(t, "after the source left", src, dst)
	if e.live != nil {
		assert.Equal(t, 2, e.live(), "only the shared granules stay alive")
	}
	require.NoError(t, dst.Resize(7*g))
	assert.Equal(t, 2*g, dst.Shared(), "own growth is not shared")
}

func TestBufferWindowFake(t *testing.T) {
	t.Run("ByBuffer", func(t *testing.T) {
		f, a := newFake(t, 1<<30)
		testDecommitBelow(t, windowEnv[*backingtest.FakeReservation, *backingtest.Fake]{b: f, auth: a, ledger: a, live: f.LiveGranules})
	})
	t.Run("ByBacking", func(t *testing.T) {
		pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
		f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: pool})
		t.Cleanup(func() {
			assert.Zero(t, f.LiveGranules(), "granules leaked")
			assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
		})
		e := windowEnv[*backingtest.FakeReservation, *backingtest.Fake]{b: f, ledger: pool, live: f.LiveGranules}
		t.Run("DecommitBelow", func(t *testing.T) { testDecommitBelow(t, e) })
		t.Run("ShareRange", func(t *testing.T) { testShareRange(t, e) })
	})
}

func TestBufferWindowCUDAFake(t *testing.T) {
	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: g, Memory: 64 << 20})
	pool := accounting.NewGovernor().Authority("kv", accounting.GPU(0))
	b, err := cuda.New(cuda.Options{Authority: pool, Driver: fake.Driver()})
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, b.Close())
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
		assert.NoError(t, fake.CheckLeaks())
	})
	e := windowEnv[*cuda.Reservation, *cuda.Backing]{b: b, ledger: pool}
	t.Run("DecommitBelow", func(t *testing.T) { testDecommitBelow(t, e) })
	t.Run("ShareRange", func(t *testing.T) { testShareRange(t, e) })
}

func TestBufferShareRangeNoSharing(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 2*g, a)
	require.NoError(t, err)
	defer buf.Close()
	require.NoError(t, buf.Resize(2*g))
	other, err := arena.NewBuffer(f, 2*g, a)
	require.NoError(t, err)
	defer other.Close()
	assert.ErrorIs(t, other.ShareRange(buf, g, g, g, backing.ReadOnly), arena.ErrNoSharing, "a ByBuffer backing does not share")
	assert.Zero(t, other.Committed())
}
