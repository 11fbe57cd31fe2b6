package nodepool_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/kv"
)

// TestKVAppendCtxWaitsForTheNode: a kv cache on a client whose own governor has
// room, on a node whose budget another process holds, waits for the node in
// AppendCtx: it returns at its deadline when nothing frees (it neither spins past it
// nor fails at once), and is served as soon as the other process gives granules back.
// Before, kv's wait was the client's governor's queue only, which granted at once, so
// AppendCtx asked the owner again and again without looking at its context.
func TestKVAppendCtxWaitsForTheNode(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 8*pg))
	hog := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	hr, err := hog.Reserve(8 * pg)
	require.NoError(t, err)
	defer hog.Unreserve(hr)
	require.NoError(t, hog.Commit(hr, 0, 8*pg), "the other process holds the node's budget")

	c := attachWith(t, o, nodepool.ClientOptions{Decay: nodepool.ClientNoDecay})
	// One layer of one head of 16 fp16 values: a token is 64 bytes of K and V, a
	// block 64 tokens, one granule.
	cache, err := kv.New(c, kv.Config{Model: kv.Uniform("one", 1, 1, 16, arena.Float16), MaxTokens: 1024, BlockTokens: 64})
	require.NoError(t, err)
	defer cache.Close()
	s, err := cache.NewSequence()
	require.NoError(t, err)
	defer s.Close()

	assert.ErrorIs(t, s.Append(1), accounting.ErrBudgetExceeded, "Append does not wait")
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	start := time.Now()
	err = s.AppendCtx(ctx, 1)
	cancel()
	assert.ErrorIs(t, err, context.DeadlineExceeded, "nothing freed: the wait ends with its context")
	assert.Less(t, time.Since(start), hangGuard, "it returned")
	assert.Zero(t, s.Len(), "a wait that ended changed nothing")

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		done <- s.AppendCtx(ctx, 1)
	}()
	waitWaiters(t, o, 1) // in the owner's queue, not spinning in the client
	require.NoError(t, hog.Decommit(hr, 0, 2*pg))
	require.NoError(t, <-done, "served from what the other process gave back")
	assert.Equal(t, 1, s.Len())
	require.NoError(t, s.Close().Err)
	require.NoError(t, cache.Close())
	checkLedger(t, o)
}

// TestKVAppendCtxNoPool: a client that keeps no pool can not hold granules for a
// step while it waits, so kv's AppendCtx on it returns the node's refusal at once
// rather than asking the owner again and again until its deadline.
func TestKVAppendCtxNoPool(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 2*pg))
	hog := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	hr, err := hog.Reserve(2 * pg)
	require.NoError(t, err)
	defer hog.Unreserve(hr)
	require.NoError(t, hog.Commit(hr, 0, 2*pg))

	c := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	cache, err := kv.New(c, kv.Config{Model: kv.Uniform("one", 1, 1, 16, arena.Float16), MaxTokens: 1024, BlockTokens: 64})
	require.NoError(t, err)
	defer cache.Close()
	s, err := cache.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	assert.ErrorIs(t, s.AppendCtx(ctx, 1), accounting.ErrBudgetExceeded)
	assert.NoError(t, ctx.Err(), "returned before its deadline")
	assert.Zero(t, s.Len())
}
