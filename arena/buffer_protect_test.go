package arena_test

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
)

func TestBufferProtect(t *testing.T) {
	pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: g, Authority: pool})
	src, err := arena.NewBuffer(f, 4*g, nil)
	require.NoError(t, err)
	require.NoError(t, src.Resize(3*g))
	require.NoError(t, f.CopyIn(src.Reservation(), g, []byte("prefix")))
	dst, err := arena.NewBuffer(f, 4*g, nil)
	require.NoError(t, err)
	require.NoError(t, dst.ShareFrom(src, 2*g, backing.ReadOnly))

	// The origin of a read-only share goes read-only too.
	require.NoError(t, src.Protect(0, 2*g, backing.ReadOnly))
	assert.ErrorIs(t, f.CopyIn(src.Reservation(), g, []byte{1}), backing.ErrReadOnly)
	require.NoError(t, f.CopyIn(src.Reservation(), 2*g, []byte{1}), "the granule past the range")
	got := make([]byte, 6)
	require.NoError(t, f.CopyOut(got, dst.Reservation(), g))
	assert.Equal(t, []byte("prefix"), got)

	// The sharer can never write a granule shared to it read-only.
	err = dst.Protect(0, 2*g, backing.ReadWrite)
	assert.ErrorIs(t, err, backing.ErrReadOnly)
	assert.ErrorIs(t, f.CopyIn(dst.Reservation(), 0, []byte{1}), backing.ErrReadOnly)
	// Nor can anyone share read-only bytes on writable, from the sharer or the
	// protected origin; and the refused buffer stays empty.
	w, err := arena.NewBuffer(f, 4*g, nil)
	require.NoError(t, err)
	assert.ErrorIs(t, w.ShareFrom(dst, 2*g, backing.ReadWrite), backing.ErrReadOnly)
	assert.ErrorIs(t, w.ShareFrom(src, 2*g, backing.ReadWrite), backing.ErrReadOnly)
	assert.Zero(t, w.Committed())
	assert.True(t, w.Close().OK())

	// The owner may write again.
	require.NoError(t, src.Protect(0, 2*g, backing.ReadWrite))
	require.NoError(t, f.CopyIn(src.Reservation(), g, []byte("PREFIX")))
	require.NoError(t, f.CopyOut(got, dst.Reservation(), g))
	assert.Equal(t, []byte("PREFIX"), got)

	// Shrinking below a protected range decommits it; growing again is read-write.
	require.NoError(t, src.Protect(g, 2*g, backing.ReadOnly))
	require.NoError(t, src.Resize(g))
	require.NoError(t, src.Resize(3*g))
	require.NoError(t, f.CopyIn(src.Reservation(), g, []byte("fresh!")), "a recommitted granule is writable")
	require.NoError(t, f.CopyIn(src.Reservation(), 2*g, []byte{1}))
	require.NoError(t, f.CopyOut(got, dst.Reservation(), g))
	assert.Equal(t, []byte("PREFIX"), got, "the sharer keeps the granule src gave up")
	assert.True(t, dst.Close().OK())
	assert.True(t, src.Close().OK())
	assert.Zero(t, pool.Stats().Owned)
	assert.Zero(t, f.LiveGranules())
}

func TestBufferProtectBadInput(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(f, 4*g, a)
	require.NoError(t, err)
	require.NoError(t, buf.Resize(2*g+1)) // 3 granules committed
	for _, tt := range []struct {
		name      string
		off, size int
	}{
		{"negative offset", -g, g},
		{"negative size", 0, -g},
		{"misaligned offset", 1, g},
		{"misaligned size", 0, g + 1},
		{"past the committed bytes", 2 * g, 2 * g},
		{"past the capacity", 4 * g, g},
		{"min int offset", math.MinInt, g},
		{"max int size", g, math.MaxInt &^ (g - 1)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, buf.Protect(tt.off, tt.size, backing.ReadOnly), arena.ErrInvalidSize)
		})
	}
	assert.Error(t, buf.Protect(0, g, backing.ReadOnly+1), "an unknown protection")
	// Nothing changed: every committed granule still takes a write.
	for o := 0; o < 3*g; o += g {
		require.NoError(t, f.CopyIn(buf.Reservation(), o, []byte{1}))
	}
	require.NoError(t, buf.Protect(0, 0, backing.ReadOnly), "an empty range")
	require.NoError(t, buf.Protect(0, 3*g, backing.ReadOnly), "the whole committed range")
	assert.True(t, buf.Close().OK())
	assert.PanicsWithValue(t, arena.PanicClosed, func() { _ = buf.Protect(0, 0, backing.ReadOnly) })
}

// noProtect hides the Fake's Protect.
type noProtect struct {
	backing.Backing[fakeR]
}

type fakeR = *backingtest.FakeReservation

func TestBufferProtectUnsupported(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(noProtect{f}, 2*g, a)
	require.NoError(t, err)
	require.NoError(t, buf.Resize(g))
	err = buf.Protect(0, g, backing.ReadOnly)
	assert.ErrorIs(t, err, arena.ErrNoProtection)
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	assert.True(t, buf.Close().OK())

	// A backing that has the method but answers that it can not.
	fb, err := arena.NewBuffer(backingtest.NewFaulty[fakeR](noProtect{f}), 2*g, a)
	require.NoError(t, err)
	require.NoError(t, fb.Resize(g))
	assert.ErrorIs(t, fb.Protect(0, g, backing.ReadOnly), arena.ErrNoProtection)
	require.NoError(t, f.CopyIn(fb.Reservation(), 0, []byte{1}), "nothing changed")
	assert.True(t, fb.Close().OK())
}
