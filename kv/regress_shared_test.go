//go:build linux || windows

package kv_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
)

// A refused Append on a pooled backing holds no budget afterwards.
func TestRefusedAppendHoldsNoBudget(t *testing.T) {
	gov := accounting.NewGovernor()
	const g = 64 << 10
	require.NoError(t, gov.SetLimit(accounting.HostKey, 8*g))
	pool := gov.Authority("pool", accounting.HostKey)
	other := gov.Authority("other", accounting.HostKey)
	require.NoError(t, other.TryAcquire(4*g))
	b := sharedPool(t, pool, "kv-refused")
	c, err := kv.New(b, kv.Config{Geometry: tiny8, MaxTokens: 1024, Layout: kv.PerLayer})
	require.NoError(t, err)
	s, err := c.NewSequence()
	require.NoError(t, err)
	err = s.Append(1) // 6 tensors need 6 granules; 4 are free
	require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.NotErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.Equal(t, 0, s.Len())
	assert.Equal(t, int64(4*g), gov.Stats(accounting.HostKey).Used, "nothing taken")
	assert.True(t, s.Close().OK())
	other.Release(4 * g)
	require.NoError(t, c.Close())
}

// Two caches on one pool: memory one gives back wakes the other's waiting append.
func TestWaitWakesAcrossCachesOnOnePool(t *testing.T) {
	gov := accounting.NewGovernor()
	const g = 64 << 10
	require.NoError(t, gov.SetLimit(accounting.HostKey, 6*g))
	pool := gov.Authority("pool", accounting.HostKey)
	b := sharedPool(t, pool, "kv-wake")
	cfg := kv.Config{Geometry: tiny8, MaxTokens: 1024, Layout: kv.PerLayer}
	ca, err := kv.New(b, cfg)
	require.NoError(t, err)
	cb, err := kv.New(b, cfg)
	require.NoError(t, err)
	sb, err := cb.NewSequence()
	require.NoError(t, err)
	require.NoError(t, sb.Append(1)) // all 6 granules
	sa, err := ca.NewSequence()
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		done <- sa.AppendCtx(ctx, 1)
	}()
	require.Eventually(t, func() bool { return gov.Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	require.True(t, sb.Close().OK())
	require.NoError(t, <-done)
	assert.Equal(t, 1, sa.Len())
	assert.True(t, sa.Close().OK())
	require.NoError(t, ca.Close())
	require.NoError(t, cb.Close())
}

// Two pools under one governor: the idle granules of one are given back to serve a
// waiter of the other.
func TestWaitReclaimsAnotherPool(t *testing.T) {
	gov := accounting.NewGovernor()
	const g = 64 << 10
	require.NoError(t, gov.SetLimit(accounting.HostKey, 6*g))
	pa := gov.Authority("a", accounting.HostKey)
	pb := gov.Authority("b", accounting.HostKey)
	ba := sharedPool(t, pa, "kv-reclaim-a")
	bb := sharedPool(t, pb, "kv-reclaim-b")
	cfg := kv.Config{Geometry: tiny8, MaxTokens: 1024, Layout: kv.PerLayer}
	ca, err := kv.New(ba, cfg)
	require.NoError(t, err)
	cb, err := kv.New(bb, cfg)
	require.NoError(t, err)
	sb, err := cb.NewSequence()
	require.NoError(t, err)
	require.NoError(t, sb.Append(1))
	require.True(t, sb.Close().OK())
	require.Equal(t, int64(6*g), bb.PoolStats().Idle, "b's granules wait idle in its pool")

	sa, err := ca.NewSequence()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, sa.AppendCtx(ctx, 1))
	assert.Zero(t, bb.PoolStats().Idle, "b gave its idle granules back")
	assert.Equal(t, int64(6*g), pa.Stats().Owned)
	assert.True(t, sa.Close().OK())
	require.NoError(t, ca.Close())
	require.NoError(t, cb.Close())
}
