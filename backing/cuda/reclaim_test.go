package cuda_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// Two pools under one governor: the idle handles of one are released to serve a
// waiting commit of the other.
func TestReclaimAcrossPools(t *testing.T) {
	const g = 64 << 10
	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: g, Memory: 64 << 20})
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.GPU(0), 4*g))
	pa := gov.Authority("a", accounting.GPU(0))
	pb := gov.Authority("b", accounting.GPU(0))
	ba, err := cuda.New(cuda.Options{Authority: pa, Driver: fake.Driver()})
	require.NoError(t, err)
	bb, err := cuda.New(cuda.Options{Authority: pb, Driver: fake.Driver()})
	require.NoError(t, err)

	rb, err := bb.Reserve(4 * g)
	require.NoError(t, err)
	require.NoError(t, bb.Commit(rb, 0, 4*g))
	require.NoError(t, bb.Decommit(rb, 0, 4*g))
	require.Equal(t, int64(4*g), bb.PoolStats().Idle, "b's handles wait idle in its pool")

	ra, err := ba.Reserve(4 * g)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, ba.CommitCtx(ctx, ra, 0, 4*g))
	assert.Zero(t, bb.PoolStats().Idle, "b released its idle handles")
	assert.Equal(t, int64(4*g), pa.Stats().Owned)
	assert.Zero(t, pb.Stats().Owned)

	assert.True(t, ba.Unreserve(ra).OK())
	assert.True(t, bb.Unreserve(rb).OK())
	require.NoError(t, ba.Close())
	require.NoError(t, bb.Close())
	assert.NoError(t, fake.CheckLeaks())
}
