package kv_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/internal/logrec"
	"github.com/vmarena/vmarena/kv"
)

// TestLogsKeptRange: a range whose release fails twice is logged, once, when the
// cache keeps it; appends, truncations and good closes log nothing.
func TestLogsKeptRange(t *testing.T) {
	var rec logrec.Recorder
	e := openEnv(t, noCache, withLimit(1<<30), withFaults)
	c, err := e.tryCache(kv.Config{Model: tiny8, MaxTokens: 64, Logger: rec.Logger()})
	require.NoError(t, err)
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(16))
	require.NoError(t, s.Truncate(8))
	require.NoError(t, s.Append(20))
	q, err := c.NewSequence()
	require.NoError(t, err)
	require.True(t, q.Close().OK())
	assert.Empty(t, rec.Records(), "nothing logged on the token path or a good close")

	boom := errors.New("boom")
	e.faults.FailOp(backingtest.OpUnreserve, 1, boom)
	e.faults.FailOp(backingtest.OpUnreserve, 2, boom)
	out := s.Close()
	require.False(t, out.OK())
	kept := rec.Find("kv: a range could not be given back; the cache keeps it for Close to retry")
	require.Len(t, kept, 1)
	assert.Equal(t, "WARN", kept[0]["level"])
	assert.Equal(t, float64(out.Residual), kept[0]["bytes"])
	assert.Contains(t, kept[0]["err"], "boom")
	e.faults.Reset()
	require.NoError(t, c.Close())
	assert.Len(t, rec.Records(), 1)
}

// TestRefusals: the cache counts each growth refused for memory, and nothing else.
func TestRefusals(t *testing.T) {
	e := openEnv(t, withLimit(2*perTensorGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
	seqs := newSeqs(t, c, 2)
	require.NoError(t, seqs[0].Append(8)) // 1 granule per tensor
	require.NoError(t, c.AppendBatch([]kv.Growth{{seqs[1], 8}}))
	assert.Zero(t, c.Stats().Refusals)

	require.ErrorIs(t, seqs[0].Append(1), accounting.ErrBudgetExceeded)
	require.ErrorIs(t, c.AppendBatch([]kv.Growth{{seqs[0], 1}, {seqs[1], 1}}), accounting.ErrBudgetExceeded)
	require.ErrorIs(t, seqs[0].Append(100), kv.ErrTooLong, "not a refusal for memory")
	require.NoError(t, seqs[0].Append(0))
	assert.Equal(t, int64(2), c.Stats().Refusals)
	closeAll(t, seqs...)
}

// TestLogsEvictions: each eviction pass of the prefix cache that takes something is
// summarised, at Debug for the cache's own growth and at Info for a waiter on the
// device; lookups and inserts that evict nothing log nothing.
func TestLogsEvictions(t *testing.T) {
	var rec logrec.Recorder
	const limit = 256 * fakeGranule
	e := openEnv(t, noCache, withLimit(limit))
	c := e.cache(t, kv.Config{Model: tiny8, MaxTokens: 256, BlockTokens: testBlockTokens, Logger: rec.Logger()})
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pc.Close()) })

	// Cache four prompts, no sequence left live.
	for i := range 4 {
		ids := make([]int32, 40)
		for j := range ids {
			ids[j] = int32(100*i + j)
		}
		s, m, err := pc.Lookup(ids)
		require.NoError(t, err)
		require.NoError(t, s.Append(len(ids)-m))
		require.NoError(t, pc.Insert(s, ids))
		require.True(t, s.Close().OK())
	}
	require.Positive(t, pc.Stats().CachedBytes)
	assert.Empty(t, rec.Records(), "no eviction yet, nothing logged")

	// Growth that needs the cached bytes evicts them: a Debug summary.
	big, err := c.NewSequence()
	require.NoError(t, err)
	free := limit - e.auth.Stats().Owned
	n := int((free + pc.Stats().CachedBytes/2) / int64(tiny8.BytesPerToken()))
	require.NoError(t, big.Append(min(n, 256)))
	ev := rec.Find("kv: prefix cache eviction")
	require.NotEmpty(t, ev)
	assert.Equal(t, "DEBUG", ev[0]["level"])
	assert.Equal(t, "growth", ev[0]["for"])
	assert.Positive(t, ev[0]["granules"])
	assert.Positive(t, ev[0]["freed_bytes"])
	require.True(t, big.Close().OK())

	// Another ledger waits on the device for more than is free: the prefix cache's
	// reclaimer evicts, at Info.
	require.Positive(t, pc.Stats().CachedBytes, "the growth left some cached")
	other := e.gov.Authority("other", accounting.HostKey)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	want := e.gov.Available(accounting.HostKey) + fakeGranule
	require.NoError(t, other.Acquire(ctx, want))
	other.Release(want)
	waiter := func() []map[string]any {
		var out []map[string]any
		for _, r := range rec.Find("kv: prefix cache eviction") {
			if r["for"] == "waiter" {
				out = append(out, r)
			}
		}
		return out
	}
	require.Eventually(t, func() bool { return len(waiter()) > 0 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, "INFO", waiter()[0]["level"])
	assert.Equal(t, float64(want), waiter()[0]["need_bytes"])
}
