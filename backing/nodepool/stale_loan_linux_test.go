package nodepool_test

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// borrowedBy returns the granules the owner counts borrowed by c.
func borrowedBy(t *testing.T, o *nodepool.Owner, c *nodepool.Client) int {
	t.Helper()
	cs, ok := clientStats(o, c.Number())
	require.True(t, ok, "client %d attached", c.Number())
	return cs.Borrowed
}

// TestBorrowStaleLoan borrows granules whose lender gave them back before the
// borrow came: the borrow fails with ErrLoanGone and maps nothing, of the whole
// batch and of every message a long one takes, and the borrower's connection
// serves on.
func TestBorrowStaleLoan(t *testing.T) {
	const n = nodepool.MaxBatch + 2 // two borrow messages
	for _, tt := range []struct {
		name string
		gone []int // granules of the loan the lender gives back
	}{
		{"the first two", []int{0, 1}},
		{"the first", []int{0}},
		{"the last of the first message", []int{nodepool.MaxBatch - 1}},
		{"one in the second message", []int{nodepool.MaxBatch + 1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
			w, rd := attach(t, o), attach(t, o)
			wr, err := w.Reserve(n * pg)
			require.NoError(t, err)
			defer w.Unreserve(wr)
			require.NoError(t, w.Commit(wr, 0, n*pg))
			ids, err := w.Lend(wr, 0, n*pg, rd.Number())
			require.NoError(t, err)
			for _, i := range tt.gone {
				require.NoError(t, w.Decommit(wr, i*pg, pg))
			}
			settle(t, o, n-len(tt.gone)) // a lent granule goes back, not to the pool

			rr, err := rd.Reserve((n + 1) * pg)
			require.NoError(t, err)
			defer rd.Unreserve(rr)
			err = rd.Borrow(rr, 0, ids)
			require.ErrorIs(t, err, nodepool.ErrLoanGone)
			assert.ErrorIs(t, err, backing.ErrNotLent)
			var op *backing.OpError
			assert.ErrorAs(t, err, &op)
			assert.Contains(t, err.Error(), "given back by its lender")

			// NB: the first message's granules went back with a free, which the
			// socket orders before this round trip.
			_, err = rd.Usage()
			require.NoError(t, err)
			s := settle(t, o, n-len(tt.gone))
			checkLedger(t, o)
			assert.Zero(t, borrowedBy(t, o, rd), "all or nothing")
			assert.Equal(t, int64((n-len(tt.gone))*pg), s.Device.Used)
			assert.Zero(t, rd.Accounting().Authority().Stats().Mapped)
			assert.Zero(t, rd.Accounting().Authority().Stats().Owned)
			got := make([]byte, 1)
			assert.ErrorIs(t, rd.CopyOut(got, rr, 0), backing.ErrNotCommitted, "nothing mapped")

			// The connection serves on: a borrow of what is left and a commit.
			live := make([]uint64, 0, n)
			for i, id := range ids {
				if !slices.Contains(tt.gone, i) {
					live = append(live, id)
				}
			}
			require.NoError(t, rd.Borrow(rr, 0, live))
			require.NoError(t, rd.Commit(rr, n*pg, pg))
			_, err = rd.Usage()
			require.NoError(t, err)
			s = settle(t, o, n-len(tt.gone)+1)
			checkLedger(t, o)
			assert.Equal(t, int64((n-len(tt.gone)+1)*pg), s.Device.Used)
			assert.Equal(t, int64(pg), rd.Accounting().Authority().Stats().Owned, "its commit only")
			assert.Equal(t, int64((len(live)+1)*pg), rd.Accounting().Authority().Stats().Mapped)
			assert.Equal(t, int64((n-len(tt.gone))*pg), w.Accounting().Authority().Stats().Owned,
				"the lender is charged for what it lent and kept")
			require.NoError(t, rd.Decommit(rr, 0, len(live)*pg))
			require.NoError(t, rd.Decommit(rr, n*pg, pg))
		})
	}
}

// TestBorrowStaleAfterLenderLeft borrows a loan whose lender ended before the
// borrow: its granules went with it.
func TestBorrowStaleAfterLenderLeft(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, rd := attach(t, o), attach(t, o)
	wr, err := w.Reserve(pg)
	require.NoError(t, err)
	require.NoError(t, w.Commit(wr, 0, pg))
	ids, err := w.Lend(wr, 0, pg, rd.Number())
	require.NoError(t, err)
	require.True(t, w.Unreserve(wr).OK())
	require.NoError(t, w.Close())
	settle(t, o, 0)
	rr, err := rd.Reserve(pg)
	require.NoError(t, err)
	defer rd.Unreserve(rr)
	require.ErrorIs(t, rd.Borrow(rr, 0, ids), nodepool.ErrLoanGone)
	require.NoError(t, rd.Commit(rr, 0, pg))
	assert.Equal(t, int64(pg), o.Governor().Stats(accounting.HostKey).Used)
	require.NoError(t, rd.Decommit(rr, 0, pg))
}

// TestBorrowTwice borrows granules this process borrows already: the second
// borrow fails with ErrBorrowed and the first stays mapped.
func TestBorrowTwice(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, rd := attach(t, o), attach(t, o)
	wr, err := w.Reserve(3 * pg)
	require.NoError(t, err)
	defer w.Unreserve(wr)
	require.NoError(t, w.Commit(wr, 0, 3*pg))
	require.NoError(t, w.CopyIn(wr, pg, []byte("lent")))
	ids, err := w.Lend(wr, 0, 3*pg, rd.Number())
	require.NoError(t, err)

	rr, err := rd.Reserve(6 * pg)
	require.NoError(t, err)
	defer rd.Unreserve(rr)
	require.NoError(t, rd.Borrow(rr, 0, ids[1:2]))
	for _, tt := range []struct {
		name string
		ids  []uint64
	}{
		{"the same", ids[1:2]},
		{"after one not borrowed", ids},
		{"before one not borrowed", []uint64{ids[1], ids[2]}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := rd.Borrow(rr, 3*pg, tt.ids)
			require.ErrorIs(t, err, nodepool.ErrBorrowed)
			assert.ErrorIs(t, err, backing.ErrNotLent)
			assert.NotErrorIs(t, err, nodepool.ErrLoanGone)
			got := make([]byte, 4)
			require.NoError(t, rd.CopyOut(got, rr, 0))
			assert.Equal(t, "lent", string(got), "the first borrow's mapping")
			assert.ErrorIs(t, rd.CopyOut(got, rr, 3*pg), backing.ErrNotCommitted, "nothing mapped")
			settle(t, o, 3)
			assert.Equal(t, 1, borrowedBy(t, o, rd))
			assert.Equal(t, int64(pg), rd.Accounting().Authority().Stats().Mapped)
		})
	}
	// The connection serves on.
	require.NoError(t, rd.Borrow(rr, 3*pg, []uint64{ids[0], ids[2]}))
	require.NoError(t, rd.Share(rr, 5*pg, rr, 0, pg, backing.ReadOnly), "map it again with Share")
	assert.Equal(t, 3, borrowedBy(t, o, rd))
	require.NoError(t, rd.Decommit(rr, 0, pg))
	require.NoError(t, rd.Decommit(rr, 3*pg, 3*pg))
}

// TestBorrowStaleHostile checks that the stale cases stay narrow: a borrow of a
// gone granule never lent to the sender, or naming a gone loan twice, still ends
// the connection, and changes nothing else.
func TestBorrowStaleHostile(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, rd := attach(t, o), attach(t, o)
	wr, err := w.Reserve(2 * pg)
	require.NoError(t, err)
	defer w.Unreserve(wr)
	require.NoError(t, w.Commit(wr, 0, 2*pg))
	require.NoError(t, w.CopyIn(wr, pg, []byte("kept")))
	gone, err := w.Lend(wr, 0, pg, rd.Number()) // lent to rd, not to the raw peers
	require.NoError(t, err)
	require.NoError(t, w.Decommit(wr, 0, pg))
	settle(t, o, 1)
	for _, tt := range []struct {
		name string
		lend bool // lend the gone granule to the peer first
		ids  func(gone uint64) []uint64
	}{
		{"a gone granule never lent", false, func(g uint64) []uint64 { return []uint64{g} }},
		{"a gone loan twice", true, func(g uint64) []uint64 { return []uint64{g, g} }},
		{"a gone loan and an unknown granule", true, func(g uint64) []uint64 { return []uint64{g, 1 << 50} }},
		{"a gone loan with fields", true, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := dialRaw(t, o, true)
			st := o.Stats()
			peer := st.Clients[len(st.Clients)-1].Number
			g := gone[0]
			if tt.lend { // a loan of its own, gone before it borrows
				wr2, err := w.Reserve(pg)
				require.NoError(t, err)
				defer w.Unreserve(wr2)
				require.NoError(t, w.Commit(wr2, 0, pg))
				ids, err := w.Lend(wr2, 0, pg, peer)
				require.NoError(t, err)
				require.NoError(t, w.Decommit(wr2, 0, pg))
				settle(t, o, 1) // the free came on another connection
				g = ids[0]
			}
			if tt.ids == nil {
				r.send(nodepool.Encode(nodepool.OpBorrow, 0, 2, 1, 0, 0, []uint64{g}))
			} else {
				r.send(nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, tt.ids(g)))
			}
			r.closed(tt.name)
			settle(t, o, 1)
			got := make([]byte, 4)
			require.NoError(t, w.CopyOut(got, wr, pg))
			assert.Equal(t, "kept", string(got))
		})
	}
	// Lent and gone, borrowed alone: answered, the connection stays.
	r := dialRaw(t, o, true)
	st := o.Stats()
	wr2, err := w.Reserve(pg)
	require.NoError(t, err)
	defer w.Unreserve(wr2)
	require.NoError(t, w.Commit(wr2, 0, pg))
	ids, err := w.Lend(wr2, 0, pg, st.Clients[len(st.Clients)-1].Number)
	require.NoError(t, err)
	require.NoError(t, w.Decommit(wr2, 0, pg))
	settle(t, o, 1)
	r.send(nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, ids))
	op, code, got, fds, ok := r.recv()
	require.True(t, ok)
	assert.Equal(t, nodepool.OpBorrow|nodepool.ReplyBit, op)
	assert.Equal(t, nodepool.CodeGone, code)
	assert.Empty(t, got)
	assert.Empty(t, fds)
	r.send(nodepool.Encode(nodepool.OpStats, 0, 3, 0, 0, 0, nil))
	op, code, _, _, ok = r.recv()
	require.True(t, ok, "the connection after a stale borrow")
	assert.Equal(t, nodepool.OpStats|nodepool.ReplyBit, op)
	assert.Equal(t, nodepool.CodeOK, code)
}

// TestBorrowStaleBound lends a raw peer more granules than the owner remembers by
// id and gives them all back: the oldest, forgotten, still reads as a gone loan, as
// does every gone granule at or below it (docs/node.md, "Prefixes across
// processes"), while a gone granule above it never lent to the peer ends the
// connection.
func TestBorrowStaleBound(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	w, other := attach(t, o), attach(t, o)
	r := dialRaw(t, o, true)
	st := o.Stats()
	peer := st.Clients[len(st.Clients)-1].Number
	const n = nodepool.MaxStale + 3*nodepool.MaxBatch // 2 batches past the bound lent to the peer
	wr, err := w.Reserve(n * pg)
	require.NoError(t, err)
	defer w.Unreserve(wr)
	var lent []uint64
	for off := 0; off < n*pg; off += nodepool.MaxBatch * pg {
		require.NoError(t, w.Commit(wr, off, nodepool.MaxBatch*pg))
		if off == pg*nodepool.MaxBatch { // one batch lent to another client: never to the peer
			_, err := w.Lend(wr, off, nodepool.MaxBatch*pg, other.Number())
			require.NoError(t, err)
			continue
		}
		ids, err := w.Lend(wr, off, nodepool.MaxBatch*pg, peer)
		require.NoError(t, err)
		lent = append(lent, ids...)
	}
	unlent := lent[nodepool.MaxBatch-1] + 1 // the first of the batch lent to other
	require.NoError(t, w.Decommit(wr, 0, n*pg))
	settle(t, o, 0)
	for _, tt := range []struct {
		name string
		id   uint64
	}{
		{"the oldest, forgotten", lent[0]},
		{"the newest", lent[len(lent)-1]},
		{"one never lent, at or below the forgotten", unlent},
	} {
		r.send(nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, []uint64{tt.id}))
		_, code, _, _, ok := r.recv()
		require.True(t, ok, tt.name)
		assert.Equal(t, nodepool.CodeGone, code, tt.name)
	}
	// A gone granule never lent to the peer, above every forgotten one.
	wr2, err := w.Reserve(pg)
	require.NoError(t, err)
	defer w.Unreserve(wr2)
	require.NoError(t, w.Commit(wr2, 0, pg))
	ids, err := w.Lend(wr2, 0, pg, other.Number())
	require.NoError(t, err)
	require.NoError(t, w.Decommit(wr2, 0, pg))
	settle(t, o, 0)
	r.send(nodepool.Encode(nodepool.OpBorrow, 0, 3, 0, 0, 0, ids))
	r.closed("a gone granule never lent, above the forgotten")
}
