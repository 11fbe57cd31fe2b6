package kv_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// TestRefusalsReachTheGovernor: a growth the cache refuses for budget, having checked
// the budget itself, counts in the governor's refusals as in the cache's, so that
// vmarena_governor_refusals_total and vmarena_kv_refusals_total agree where the cache
// is the device's only taker.
func TestRefusalsReachTheGovernor(t *testing.T) {
	e := openEnv(t, withLimit(2*perTensorGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
	seqs := newSeqs(t, c, 2)
	require.NoError(t, c.AppendBatch([]kv.Growth{{seqs[0], 8}, {seqs[1], 8}}))
	require.ErrorIs(t, seqs[0].Append(1), accounting.ErrBudgetExceeded)
	require.ErrorIs(t, c.AppendBatch([]kv.Growth{{seqs[0], 1}, {seqs[1], 1}}), accounting.ErrBudgetExceeded)
	require.ErrorIs(t, seqs[0].Append(64-8), accounting.ErrExceedsLimit)
	assert.Equal(t, int64(3), c.Stats().Refusals)
	assert.Equal(t, c.Stats().Refusals, e.gov.Stats(accounting.HostKey).Counters.Refusals,
		"the governor counts what the cache refused")
	closeAll(t, seqs...)
}

// TestExceedsLimitRequestedIsNeed: a step larger than the whole limit is refused with
// Requested equal to the step's Need, the pool's idle granules netted out as in every
// other refusal, and still matches ErrExceedsLimit (waiting can not help).
func TestExceedsLimitRequestedIsNeed(t *testing.T) {
	const limit = 24 * envGranule
	e := openEnv(t, onCUDA, pooled, withConfig(kv.Config{MaxTokens: 512, Layout: kv.PerLayer}), withLimit(limit))
	defer e.finish(t)
	warm, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, warm.Append(16)) // 2 granules in each of tiny8's 6 tensors
	require.True(t, warm.Close().OK())
	e.quiet()
	require.Positive(t, e.pool.PoolStats().Idle, "the pool holds idle granules")

	s, err := e.c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	const n = 40 // 5 granules in each of 6 tensors: 30 > 24
	need, err := s.Need(n)
	require.NoError(t, err)
	err = s.Append(n)
	var be *accounting.BudgetError
	require.ErrorAs(t, err, &be)
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.False(t, accounting.CanWait(err))
	assert.Equal(t, need, be.Requested, "one figure for one step")
	assert.Equal(t, int64(30*envGranule), be.Requested+be.Held, "the step's granules in all")
}

// TestFailedStepKeepsRangesAlike: when the commit of a sequence's second range fails
// (PerLayer has a range per tensor), the rollback puts every range back as it was,
// spare granules included (a sequence that took over an evicted entry's ranges holds
// granules past its tokens), so Stats and Need stay right and the sequence is not
// damaged.
func TestFailedStepKeepsRangesAlike(t *testing.T) {
	const p = 64
	x := entryBytes(t, kv.PerLayer, p)
	e := openEnv(t, onFake, withConfig(kv.Config{MaxTokens: 512, Layout: kv.PerLayer}), withLimit(2*x+x/2), withFaults)
	defer e.finish(t)
	pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	defer func() { require.NoError(t, pc.Close()) }()
	a, err := serveN(pc, promptIDs(0, p))
	require.NoError(t, err)
	require.True(t, a.Close().OK())

	// A miss for 2p tokens that the budget can not hold: it takes over a's ranges.
	s, m, err := pc.Lookup(promptIDs(1000, 2*p+1))
	require.NoError(t, err)
	defer s.Close()
	require.Zero(t, m)
	require.Equal(t, x, committedOf(t, e.c, s), "the new sequence holds a's granules")
	need, err := s.Need(2 * p)
	require.NoError(t, err)
	require.Equal(t, x, need)

	boom := errors.New("boom")
	e.faults.FailOp(backingtest.OpCommit, 2, boom)
	require.ErrorIs(t, s.Append(2*p), boom)
	assert.False(t, s.Damaged())
	assert.Zero(t, s.Len())
	assert.Equal(t, x, committedOf(t, e.c, s), "every range holds what it held before the step")
	again, err := s.Need(2 * p)
	require.NoError(t, err)
	assert.Equal(t, need, again)
	e.books(t, "after the failed step")

	e.faults.Reset()
	require.NoError(t, s.Append(2*p))
	assert.Equal(t, 2*x, committedOf(t, e.c, s))
}

// serveN is serve, for a caller that needs only the sequence.
func serveN(pc *kv.PrefixCache, ids []int32) (*kv.Sequence, error) {
	s, _, err := serve(pc, ids)
	return s, err
}

// holdings returns c's Stats without its refusal count, which only grows: what the
// cache holds and has waited for.
func holdings(c *kv.Cache) kv.Stats {
	st := c.Stats()
	st.Refusals = 0
	return st
}
