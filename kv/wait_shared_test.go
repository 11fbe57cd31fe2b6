//go:build linux || windows

package kv_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// Under budget pressure a waiting append takes the pool's idle granules and waits
// only for the bytes they can not cover: the idle granules are not given back to the
// OS first (their old contents show they were reused), and Need counts them.
func TestWaiterUsesIdleGranules(t *testing.T) {
	const g = 64 << 10 // 128 tiny8 tokens per tensor
	// No decay: the idle granules must stay for the waiter however long the machine
	// takes to get there (decay would give one back after about 1.5 s idle).
	e := openEnv(t, onShared, withGranule(64<<10), withGranule(g), withLimit(12*g), withName("kv-idle"), withShared(host.SharedOptions{Decay: host.SharedNoDecay}), withConfig(perLayer1024))
	gov, pool, b, c := e.gov, e.auth, e.shared, e.c
	other := gov.Authority("other", accounting.HostKey)

	a, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, a.Append(1)) // 6 granules, one per tensor
	writeTokens(t, a, 5, 0, 1)
	require.True(t, a.Close().OK())
	require.Equal(t, int64(6*g), b.PoolStats().Idle)
	require.NoError(t, other.TryAcquire(6*g)) // the rest of the budget

	s, err := c.NewSequence()
	require.NoError(t, err)
	defer closeAll(t, s)
	need, err := s.Need(129) // 2 granules per tensor: 6 idle, 6 new
	require.NoError(t, err)
	assert.Equal(t, int64(6*g), need, "idle granules counted")
	var be *accounting.BudgetError
	require.ErrorAs(t, s.Append(129), &be)
	assert.Equal(t, int64(6*g), be.Requested)
	assert.Zero(t, be.Available)

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		done <- s.AppendCtx(ctx, 129)
	}()
	require.Eventually(t, func() bool { return gov.Stats(accounting.HostKey).Waiters == 1 }, 5*time.Second, time.Millisecond)
	time.Sleep(10 * time.Millisecond) // a reclaimer would run now
	assert.Equal(t, int64(6*g), b.PoolStats().Idle, "the waiter's own pool keeps its idle granules for it")
	other.Release(6 * g)
	require.NoError(t, <-done)
	assert.Equal(t, 129, s.Len())
	assert.Zero(t, b.PoolStats().Idle)
	assert.Equal(t, int64(12*g), pool.Stats().Owned)

	// The six reused granules still hold a's token 0; the six new ones read zero.
	reused := 0
	buf := make([]byte, tiny8.Groups[0].TokenBytes())
	zero := make([]byte, len(buf))
	for layer := range tiny8.Layers {
		for _, kind := range kv.KindsOf(tiny8) {
			for _, tok := range []int{0, 128} { // the first token of each granule
				require.NoError(t, s.ReadToken(layer, kind, tok, buf))
				if !slices.Equal(buf, zero) {
					reused++
				}
			}
		}
	}
	assert.Equal(t, 6, reused, "idle granules went to the waiter, not back to the OS")
}

// perLayer1024 is the PerLayer cache of tiny8 tokens that the wait tests make: 6
// granules a token, one per tensor.
var perLayer1024 = kv.Config{Model: tiny8, MaxTokens: 1024, Layout: kv.PerLayer}

// A refused Append on a pooled backing holds no budget afterwards.
func TestRefusedAppendHoldsNoBudget(t *testing.T) {
	const g = 64 << 10
	e := openEnv(t, onShared, withGranule(64<<10), withLimit(8*g), withName("kv-refused"), withConfig(perLayer1024))
	gov, c := e.gov, e.c
	other := gov.Authority("other", accounting.HostKey)
	require.NoError(t, other.TryAcquire(4*g))
	s, err := c.NewSequence()
	require.NoError(t, err)
	err = s.Append(1) // 6 tensors need 6 granules; 4 are free
	require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.NotErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.Equal(t, 0, s.Len())
	assert.Equal(t, int64(4*g), gov.Stats(accounting.HostKey).Used, "nothing taken")
	assert.True(t, s.Close().OK())
	other.Release(4 * g)
	e.finish(t)
}

// Two caches on one pool: memory one gives back wakes the other's waiting append.
func TestWaitWakesAcrossCachesOnOnePool(t *testing.T) {
	const g = 64 << 10
	e := openEnv(t, onShared, withGranule(64<<10), withLimit(6*g), withName("kv-wake"), withConfig(perLayer1024))
	gov, ca, cb := e.gov, e.c, e.cache(t, perLayer1024)
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
}

// Two pools under one governor: the idle granules of one are given back to serve a
// waiter of the other.
func TestWaitReclaimsAnotherPool(t *testing.T) {
	gov := accounting.NewGovernor()
	const g = 64 << 10
	require.NoError(t, gov.SetLimit(accounting.HostKey, 6*g))
	pa := gov.Authority("a", accounting.HostKey)
	pb := gov.Authority("b", accounting.HostKey)
	ea := openEnv(t, onShared, withGranule(64<<10), withAuthority(pa), withName("kv-reclaim-a"), noCache)
	eb := openEnv(t, onShared, withGranule(64<<10), withAuthority(pb), withName("kv-reclaim-b"), noCache)
	bb := eb.shared
	ca, err := ea.tryCache(perLayer1024)
	require.NoError(t, err)
	cb, err := eb.tryCache(perLayer1024)
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
