package nodepool_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// TestLendBorrow lends a writer's granules to a reader on another connection: the
// reader maps the same memory read-only with no copy, the writer stays charged for
// it (owned once) until the reader gives it back, also after the writer let go.
func TestLendBorrow(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, rd, other := attach(t, o), attach(t, o), attach(t, o)
	wr, err := w.Reserve(3 * pg)
	require.NoError(t, err)
	require.NoError(t, w.Commit(wr, 0, 3*pg))
	require.NoError(t, w.CopyIn(wr, pg+1, []byte("prefix")))
	ids, err := w.Lend(wr, pg, 2*pg, rd.Number())
	require.NoError(t, err)
	require.Len(t, ids, 2)

	rr, err := rd.Reserve(4 * pg)
	require.NoError(t, err)
	defer rd.Unreserve(rr)
	require.NoError(t, rd.Borrow(rr, pg, ids))
	got := make([]byte, 6)
	require.NoError(t, rd.CopyOut(got, rr, pg+1))
	assert.Equal(t, "prefix", string(got), "the reader maps the writer's memory")
	require.NoError(t, w.CopyIn(wr, pg+1, []byte("PREFIX")))
	require.NoError(t, rd.CopyOut(got, rr, pg+1))
	assert.Equal(t, "PREFIX", string(got), "no copy: the writer's later write shows")
	assert.ErrorIs(t, rd.CopyIn(rr, pg, []byte{1}), backing.ErrReadOnly)
	assert.ErrorIs(t, rd.Protect(rr, pg, pg, backing.ReadWrite), backing.ErrReadOnly)
	assert.ErrorIs(t, rd.Share(rr, 0, rr, pg, pg, backing.ReadWrite), backing.ErrReadOnly)
	require.NoError(t, rd.Share(rr, 3*pg, rr, pg, pg, backing.ReadOnly), "shared onward read-only")
	_, err = rd.Lend(rr, pg, pg, other.Number())
	assert.ErrorIs(t, err, backing.ErrReadOnly, "only the lender lends")

	s := o.Stats()
	assert.Equal(t, int64(3*pg), s.Device.Used, "owned once")
	assert.Equal(t, int64(3*pg), s.Clients[0].Owned, "the lender is charged")
	assert.Zero(t, rd.Accounting().Authority().Stats().Owned, "the borrower owns nothing")

	// The writer lets go: the borrowed granules live on, still charged to it.
	require.True(t, w.Unreserve(wr).OK())
	require.NoError(t, w.Close())
	s = settle(t, o, 2)
	assert.Equal(t, int64(2*pg), s.Device.Used, "what the reader still borrows")
	require.NoError(t, rd.CopyOut(got, rr, pg+1))
	assert.Equal(t, "PREFIX", string(got), "the reader's memory after the writer left")
	require.NoError(t, rd.Decommit(rr, pg, pg))
	settle(t, o, 2) // still mapped at 3*pg by the onward share
	require.NoError(t, rd.Decommit(rr, 3*pg, pg))
	s = settle(t, o, 1)
	assert.Equal(t, int64(pg), s.Device.Used)
	require.NoError(t, rd.Decommit(rr, 2*pg, pg))
	s = settle(t, o, 0)
	assert.Zero(t, s.Device.Used, "the last borrower gave it back")
	assert.Zero(t, rd.Accounting().Authority().Stats().Mapped)
}

// TestBorrowRefused checks that a client can not borrow what was not lent to it:
// the owner ends its connection and the granule's holder keeps its memory.
func TestBorrowRefused(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, rd := attach(t, o), attach(t, o)
	wr, err := w.Reserve(2 * pg)
	require.NoError(t, err)
	defer w.Unreserve(wr)
	require.NoError(t, w.Commit(wr, 0, 2*pg))
	require.NoError(t, w.CopyIn(wr, 0, []byte("mine")))
	ids, err := w.Lend(wr, 0, pg, rd.Number())
	require.NoError(t, err)
	for _, tt := range []struct {
		name string
		msg  []byte
	}{
		{"a granule lent to another", nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, ids)},
		{"a granule never lent", nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, []uint64{ids[0] + 1})},
		{"an unknown granule", nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, []uint64{1 << 50})},
		{"lend of another's granule", nodepool.Encode(nodepool.OpLend, 0, 2, 99, 0, 0, ids)},
		{"borrow with fields", nodepool.Encode(nodepool.OpBorrow, 0, 2, 1, 0, 0, ids)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := dialRaw(t, o, true)
			r.send(tt.msg)
			r.closed(tt.name)
			got := make([]byte, 4)
			require.NoError(t, w.CopyOut(got, wr, 0))
			assert.Equal(t, "mine", string(got))
		})
	}
	// A peer that borrows what was lent to it once, then again, is answered
	// CodeBorrowed and keeps its connection and its first borrow
	// (stale_loan_linux_test.go).
	r := dialRaw(t, o, true)
	st := o.Stats()
	ids2, err := w.Lend(wr, pg, pg, st.Clients[len(st.Clients)-1].Number)
	require.NoError(t, err)
	r.send(nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, ids2))
	_, code, _, fds, ok := r.recv()
	require.True(t, ok)
	require.Equal(t, nodepool.CodeOK, code)
	for _, fd := range fds {
		require.NoError(t, unix.Close(fd))
	}
	r.send(nodepool.Encode(nodepool.OpBorrow, 0, 3, 0, 0, 0, ids2))
	_, code, got, fds, ok := r.recv()
	require.True(t, ok, "a granule borrowed twice: the connection")
	assert.Equal(t, nodepool.CodeBorrowed, code)
	assert.Empty(t, got)
	assert.Empty(t, fds)
	st = settle(t, o, 2)
	assert.Equal(t, 1, st.Clients[len(st.Clients)-1].Borrowed, "the first borrow")
	assert.Equal(t, int64(2*pg), o.Governor().Stats(accounting.HostKey).Used)
}

// TestBorrowReadOnlyDescriptor borrows as a raw peer and checks that the
// descriptor it gets can not be mapped for writing.
func TestBorrowReadOnlyDescriptor(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w := attach(t, o)
	wr, err := w.Reserve(pg)
	require.NoError(t, err)
	defer w.Unreserve(wr)
	require.NoError(t, w.Commit(wr, 0, pg))
	require.NoError(t, w.CopyIn(wr, 0, []byte("ro")))
	r := dialRaw(t, o, true)
	s := o.Stats()
	require.Len(t, s.Clients, 2)
	ids, err := w.Lend(wr, 0, pg, s.Clients[1].Number)
	require.NoError(t, err)
	r.send(nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, ids))
	_, code, got, fds, ok := r.recv()
	require.True(t, ok)
	require.Equal(t, nodepool.CodeOK, code)
	require.Equal(t, ids, got)
	require.Len(t, fds, 1)
	defer unix.Close(fds[0])
	_, err = unix.Mmap(fds[0], 0, pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	assert.ErrorIs(t, err, unix.EACCES, "a writable shared mapping of a borrowed granule")
	b, err := unix.Mmap(fds[0], 0, pg, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	assert.Equal(t, "ro", string(b[:2]))
	assert.ErrorIs(t, unix.Mprotect(b, unix.PROT_READ|unix.PROT_WRITE), unix.EACCES, "made writable later")
	require.NoError(t, unix.Munmap(b))
	assert.ErrorIs(t, unix.Ftruncate(fds[0], 0), unix.EINVAL, "truncated (not open for writing)")
}

func TestLendBorrowBadInput(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, rd := attach(t, o), attach(t, o)
	wr, err := w.Reserve(2 * pg)
	require.NoError(t, err)
	defer w.Unreserve(wr)
	require.NoError(t, w.Commit(wr, 0, pg))
	rr, err := rd.Reserve(2 * pg)
	require.NoError(t, err)
	defer rd.Unreserve(rr)
	ids, err := w.Lend(wr, 0, pg, rd.Number())
	require.NoError(t, err)
	for _, tt := range []struct {
		name string
		err  error
		want error
	}{
		{"Lend of an uncommitted granule", func() error { _, err := w.Lend(wr, pg, pg, rd.Number()); return err }(), backing.ErrNotCommitted},
		{"Lend misaligned", func() error { _, err := w.Lend(wr, 1, pg, rd.Number()); return err }(), backing.ErrInvalidRange},
		{"Lend out of range", func() error { _, err := w.Lend(wr, 0, 3*pg, rd.Number()); return err }(), backing.ErrOutOfRange},
		{"Lend of a foreign reservation", func() error { _, err := w.Lend(rr, 0, pg, rd.Number()); return err }(), backing.ErrForeignReservation},
		{"Borrow out of range", rd.Borrow(rr, 2*pg, ids), backing.ErrOutOfRange},
		{"Borrow misaligned", rd.Borrow(rr, 1, ids), backing.ErrInvalidRange},
		{"Borrow into a foreign reservation", rd.Borrow(wr, pg, ids), backing.ErrForeignReservation},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, tt.err, tt.want)
			var op *backing.OpError
			assert.ErrorAs(t, tt.err, &op)
		})
	}
	require.NoError(t, rd.Borrow(rr, 0, ids))
	assert.ErrorIs(t, rd.Borrow(rr, 0, ids), backing.ErrCommitted, "Borrow onto a committed granule")
	assert.Equal(t, int64(pg), o.Governor().Stats(accounting.HostKey).Used, "refused calls changed nothing")
	_, err = rd.Usage()
	assert.NoError(t, err, "refused calls keep the connection")
}
