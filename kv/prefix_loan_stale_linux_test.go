package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/kv"
)

// TestPrefixLoanStale: a loan whose lender released the prefix (its granules went
// back to the node) before the borrow, and a loan a second cache on the same node
// pool client borrows while the first maps it, are refused with ErrLoan and
// backing.ErrNotLent, mapping nothing; the borrower's client serves on (its caches
// commit, the first borrow reads its tokens) and every ledger ends at zero.
// (Before, the owner ended the borrower's connection for both.)
func TestPrefixLoanStale(t *testing.T) {
	cfg := loanConfig(0)
	np := newNodePair(t, cfg)
	b := np.caches[1]
	bAuth := np.cl[1].Accounting().Authority()

	// A stale loan.
	s, p := np.frozen(t, loanTokens)
	stale, err := p.Lend(np.cl[1].Number())
	require.NoError(t, err)
	p.Release()
	require.Equal(t, accounting.Complete, s.Close().Status)
	_, err = np.cl[0].Usage() // the lender's frees are served before its next request
	require.NoError(t, err)
	require.Zero(t, np.o.Stats().Granules, "the loan's granules are gone")
	_, err = b.BorrowPrefix(stale)
	require.ErrorIs(t, err, kv.ErrLoan)
	assert.ErrorIs(t, err, backing.ErrNotLent)
	assert.ErrorIs(t, err, nodepool.ErrLoanGone)
	assert.Zero(t, bAuth.Stats().Mapped, "nothing mapped")
	assert.Zero(t, b.Stats().Prefixes)

	// A loan borrowed by two caches on one client.
	s, p = np.frozen(t, loanTokens)
	loan, err := p.Lend(np.cl[1].Number())
	require.NoError(t, err)
	bp, err := b.BorrowPrefix(loan)
	require.NoError(t, err)
	mapped := bAuth.Stats().Mapped
	b2, err := kv.New(np.cl[1], cfg)
	require.NoError(t, err)
	_, err = b2.BorrowPrefix(loan)
	require.ErrorIs(t, err, kv.ErrLoan)
	assert.ErrorIs(t, err, backing.ErrNotLent)
	assert.ErrorIs(t, err, nodepool.ErrBorrowed)
	assert.Equal(t, mapped, bAuth.Stats().Mapped, "the second cache mapped nothing")
	assert.Zero(t, b2.Stats().Prefixes)

	// The client serves on: the first borrow reads, both caches commit.
	seq, err := b.NewSequenceFrom(bp)
	require.NoError(t, err)
	require.NoError(t, checkHeld(seq, 1, 0, loanTokens))
	own, err := b2.NewSequence()
	require.NoError(t, err)
	require.NoError(t, own.Append(loanOwn))
	require.NoError(t, writeHeld(own, 2, 0, loanOwn))
	require.NoError(t, checkHeld(own, 2, 0, loanOwn))

	bp.Release()
	require.Equal(t, accounting.Complete, seq.Close().Status)
	require.Equal(t, accounting.Complete, own.Close().Status)
	p.Release()
	require.Equal(t, accounting.Complete, s.Close().Status)
	require.NoError(t, b2.Close())
	for i, c := range np.caches {
		require.NoError(t, c.Close())
		_, err := np.cl[i].Usage()
		require.NoError(t, err)
		as := np.cl[i].Accounting().Authority().Stats()
		assert.Zero(t, as.Owned)
		assert.Zero(t, as.Mapped)
	}
	assert.Zero(t, np.o.Stats().Device.Used)
}
