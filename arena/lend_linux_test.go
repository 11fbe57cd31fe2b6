package arena_test

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
)

// TestBufferLendBorrow: a buffer lends its committed granules to another client of
// a node pool, whose buffer borrows them after its own committed bytes: the same
// bytes, read-only there, counted as Shared; ranges that are misaligned, outside
// the committed bytes, or leave a gap are refused and change nothing.
func TestBufferLendBorrow(t *testing.T) {
	const pg = 4096
	path := filepath.Join(t.TempDir(), "node.sock")
	o, err := nodepool.Listen(path, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close()) })
	var cl [2]*nodepool.Client
	for i := range cl {
		cl[i], err = nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
		require.NoError(t, err)
		t.Cleanup(func() { _ = cl[i].Close() })
	}
	src, err := arena.NewBuffer(cl[0], 4*pg, nil)
	require.NoError(t, err)
	defer src.Close()
	require.NoError(t, src.Resize(3*pg))
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i * 7)
	}
	dst, err := arena.NewBuffer(cl[1], 4*pg, nil)
	require.NoError(t, err)
	defer dst.Close()
	require.NoError(t, dst.Resize(pg))

	for _, tt := range []struct {
		name      string
		off, size int
		want      error
	}{
		{"misaligned", 1, pg, arena.ErrInvalidSize},
		{"past the committed bytes", 2 * pg, 2 * pg, arena.ErrInvalidSize},
		{"negative", -pg, pg, arena.ErrInvalidSize},
	} {
		_, err := src.Lend(tt.off, tt.size, cl[1].Number())
		assert.ErrorIs(t, err, tt.want, tt.name)
	}
	ids, err := src.Lend(pg, 2*pg, cl[1].Number())
	require.NoError(t, err)
	require.Len(t, ids, 2)

	assert.ErrorIs(t, dst.BorrowRange(2*pg, ids), arena.ErrNotEmpty, "a gap after the committed bytes")
	assert.ErrorIs(t, dst.BorrowRange(pg+1, ids), arena.ErrNotEmpty)
	assert.ErrorIs(t, dst.BorrowRange(pg, append(ids, ids...)), arena.ErrCapacity)
	assert.Equal(t, pg, dst.Committed(), "nothing changed")
	require.NoError(t, dst.BorrowRange(pg, ids))
	assert.Equal(t, 3*pg, dst.Len())
	assert.Equal(t, 3*pg, dst.Committed())
	assert.Equal(t, 2*pg, dst.Shared())
	assert.Equal(t, src.Bytes()[pg:3*pg], dst.Bytes()[pg:3*pg])
	assert.Error(t, testutil.Touch(dst.Base()+pg, true), "a borrowed granule is read-only")
	assert.ErrorIs(t, dst.Protect(pg, pg, backing.ReadWrite), backing.ErrReadOnly)
	as := cl[1].Accounting().Authority().Stats()
	assert.Equal(t, int64(pg), as.Owned, "the borrower owns its own granule only")
	assert.Equal(t, int64(3*pg), as.Mapped)

	// A decommit of the lender's leaves the borrower's bytes.
	want := append([]byte(nil), src.Bytes()[pg:3*pg]...)
	require.NoError(t, src.Resize(0))
	assert.Equal(t, want, dst.Bytes()[pg:3*pg])
	require.NoError(t, dst.Resize(0))
	for _, c := range cl {
		_, err := c.Usage()
		require.NoError(t, err)
	}
	assert.Zero(t, o.Stats().Device.Used)
}

// TestBufferNoLending: a backing that is not a backing.Lender refuses both with
// ErrNoLending, which matches errors.ErrUnsupported.
func TestBufferNoLending(t *testing.T) {
	const pg = 4096
	auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: pg, Authority: auth})
	buf, err := arena.NewBuffer(f, 2*pg, nil)
	require.NoError(t, err)
	defer buf.Close()
	require.NoError(t, buf.Resize(pg))
	_, err = buf.Lend(0, pg, 1)
	assert.ErrorIs(t, err, arena.ErrNoLending)
	err = buf.BorrowRange(pg, []uint64{1})
	assert.ErrorIs(t, err, arena.ErrNoLending)
	assert.True(t, errors.Is(err, errors.ErrUnsupported))
	assert.Equal(t, pg, buf.Committed())
}
