package host_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

// TestSharedPrivateShareOneAtATime: a Share of k private granules takes no net
// memory, so it goes through while one granule of the budget is free, and at no
// time holds more than one granule beyond what it started with.
func TestSharedPrivateShareOneAtATime(t *testing.T) { forPrivate(t, testSharedPrivateShareOneAtATime) }

func testSharedPrivateShareOneAtATime(t *testing.T, m sharedMode) {
	const k = 4
	for _, free := range []int{1, 8} {
		e := privateEnv(t, m, host.SharedOptions{High: host.SharedNoPool})
		g := e.g
		dev := e.auth.Device()
		require.NoError(t, e.gov.SetLimit(dev, int64((k+free)*g)))
		x := e.reserve(k)
		y := e.reserve(k)
		e.commit(x, 0, k)
		for i := range k {
			e.tag(x, i, uint64(10+i))
		}
		e.gov.ResetPeak(dev)
		e.share(y, 0, x, 0, k, backing.ReadOnly)
		assert.LessOrEqual(t, e.gov.Stats(dev).Peak, int64((k+1)*g), "free=%d: one granule moves at a time", free)
		assert.Equal(t, int64(k*g), e.pool().Owned, "free=%d: the private granules' bytes went with them", free)
		assert.Zero(t, e.s.Stats().Private)
		for i := range k {
			assert.Equal(t, uint64(10+i), e.tagOf(x, i))
			assert.Equal(t, uint64(10+i), e.tagOf(y, i))
		}
		require.NoError(t, host.CheckShared(e.s))
	}
}
