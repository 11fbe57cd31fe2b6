package kv_test

import (
	"errors"
	"testing"

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
	fx := newFixture(t, 1<<30)
	faulty := backingtest.NewFaulty[*backingtest.FakeReservation](fx.fake)
	c, err := kv.New(faulty, kv.Config{Geometry: tiny8, MaxTokens: 64, Logger: rec.Logger()})
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
	faulty.FailOp(backingtest.OpUnreserve, 1, boom)
	faulty.FailOp(backingtest.OpUnreserve, 2, boom)
	out := s.Close()
	require.False(t, out.OK())
	kept := rec.Find("kv: a range could not be given back; the cache keeps it for Close to retry")
	require.Len(t, kept, 1)
	assert.Equal(t, "WARN", kept[0]["level"])
	assert.Equal(t, float64(out.Residual), kept[0]["bytes"])
	assert.Contains(t, kept[0]["err"], "boom")
	faulty.Reset()
	require.NoError(t, c.Close())
	assert.Len(t, rec.Records(), 1)
}

// TestStatsRefusals: Stats counts each growth refused for memory, and nothing else.
func TestStatsRefusals(t *testing.T) {
	fx := newFixture(t, 2*perTensorGranule)
	c := fx.cache(t, kv.PerLayer, 64)
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
