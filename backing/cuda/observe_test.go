package cuda_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/internal/logrec"
)

// TestLogs proves what a Backing logs: nothing on commits, decommits and shares; a
// line for a trim or reclaim that releases handles, and one, the first time, for a
// driver that refuses read-only mappings.
func TestLogs(t *testing.T) {
	var rec logrec.Recorder
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	x := fakeBacking(t, cuda.FakeDriverOptions{}, cuda.Options{Authority: auth, Logger: rec.Logger()})
	g := int64(x.g)
	a, b, c := x.reserve(t, 2), x.reserve(t, 2), x.reserve(t, 2)
	require.NoError(t, x.b.Commit(a, 0, 2*x.g))
	require.NoError(t, x.b.Share(b, 0, a, 0, x.g, backing.ReadOnly))
	require.NoError(t, x.b.Decommit(b, 0, x.g))
	assert.Empty(t, rec.Records(), "nothing logged on commits, shares and decommits")

	// The driver refuses read-only access: the share falls back, and says so once.
	x.f.Fail("cuMemSetAccess", 1, cuda.CodeNotSupported)
	require.NoError(t, x.b.Share(b, 0, a, 0, x.g, backing.ReadOnly))
	require.NoError(t, x.b.Share(c, 0, a, 0, x.g, backing.ReadOnly))
	ro := rec.Find("cuda: the driver refuses read-only mappings; shares are mapped read-write and guarded on the Go side")
	require.Len(t, ro, 1)
	assert.Equal(t, float64(0), ro[0]["device"])
	assert.ErrorIs(t, x.b.CopyIn(c, 0, []byte{1}), cuda.ErrReadOnly, "the Go-side guard holds")

	// Trim.
	require.NoError(t, x.b.Decommit(b, 0, x.g))
	require.NoError(t, x.b.Decommit(c, 0, x.g))
	require.NoError(t, x.b.Decommit(a, 0, 2*x.g))
	n, err := x.b.Trim(1)
	require.NoError(t, err)
	require.Equal(t, g, n)
	_, err = x.b.Trim(1)
	require.NoError(t, err)
	trims := rec.Find("cuda: pool trim")
	require.Len(t, trims, 1, "a trim that releases nothing is not logged")
	assert.Equal(t, float64(g), trims[0]["gave_back_bytes"])

	// Reclaim: another ledger on the device waits for the idle handle's bytes.
	require.NoError(t, gov.SetLimit(accounting.GPU(0), g))
	other := gov.Authority("other", accounting.GPU(0))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, other.Acquire(ctx, g))
	other.Release(g)
	require.Eventually(t, func() bool { return len(rec.Find("cuda: pool reclaim")) == 1 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, float64(g), rec.Find("cuda: pool reclaim")[0]["gave_back_bytes"])
	for _, r := range []*cuda.Reservation{a, b, c} {
		require.True(t, x.b.Unreserve(r).OK())
	}
}

// TestQuarantineReported: a quarantined Unreserve reports its residual to the governor.
func TestQuarantineReported(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	x := newFx(t, cuda.FakeDriverOptions{}, cuda.Options{Authority: auth})
	r := x.reserve(t, 3)
	require.NoError(t, x.b.Commit(r, 0, 3*x.g))
	x.f.Fail("cuMemUnmap", 1, cuda.CodeUnknown)
	x.f.Fail("cuMemUnmap", 3, cuda.CodeUnknown)
	o := x.b.Unreserve(r)
	require.Equal(t, accounting.Quarantined, o.Status)
	c := gov.Stats(accounting.GPU(0)).Counters
	assert.Equal(t, int64(1), c.Quarantines)
	assert.Equal(t, o.Residual, c.QuarantinedBytes)
	assert.Equal(t, int64(x.g), c.QuarantinedBytes)
	require.Error(t, x.b.Close(), "the handle still mapped stays")
}
