package nodepool_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// TestConcurrentRequests runs requests of one client from many goroutines at once,
// so that the one that reads the socket hands replies to the others; then, on a
// full node, commits that wait end by their contexts while others ask beside them
// (a waiter in the read, woken to send its cancel, or one beside it), and once more
// with the read free. Every call gets its own answer and the ledgers end exact.
func TestConcurrentRequests(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	const workers, rounds = 6, 50
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, workers*pg))
	c := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	run := func(n int, f func(i int) error) {
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := range n {
			wg.Add(1)
			go func() { defer wg.Done(); errs <- f(i) }()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			assert.NoError(t, err)
		}
	}
	rs := make([]*nodepool.Reservation, workers)
	for i := range rs {
		var err error
		rs[i], err = c.Reserve(pg)
		require.NoError(t, err)
	}
	run(workers, func(i int) error {
		for range rounds {
			if _, err := c.Usage(); err != nil {
				return err
			}
			if err := c.Commit(rs[i], 0, pg); err != nil {
				return err
			}
			if err := c.Decommit(rs[i], 0, pg); err != nil {
				return err
			}
		}
		return nil
	})

	full, err := c.Reserve(workers * pg)
	require.NoError(t, err)
	require.NoError(t, c.Commit(full, 0, workers*pg))
	run(workers, func(i int) error {
		if i < 2 { // these wait on the full node
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			if err := c.CommitCtx(ctx, rs[i], 0, pg); !errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("a commit on the full node: %v, want the deadline", err)
			}
			return nil
		}
		for range rounds {
			if _, err := c.Usage(); err != nil {
				return err
			}
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = c.Usage() // the read is free now: the waiting commit takes it
	require.NoError(t, err)
	assert.ErrorIs(t, c.CommitCtx(ctx, rs[0], 0, pg), context.DeadlineExceeded)

	require.True(t, c.Unreserve(full).OK())
	for _, r := range rs {
		require.True(t, c.Unreserve(r).OK())
	}
	s := settle(t, o, 0)
	assert.Zero(t, s.Device.Used, "the node's used bytes")
	assert.Zero(t, s.Device.Waiters, "waiters")
	assert.Zero(t, c.Accounting().Authority().Stats().Owned, "the client's ledger")
}
