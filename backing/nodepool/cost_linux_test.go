package nodepool_test

import (
	"bytes"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
)

// TestCostPerGranule measures what a granule costs: a descriptor in its holder and
// one in the owner, and a kernel mapping per place it is mapped, so that a process
// holds at most min(RLIMIT_NOFILE, vm.max_map_count) of them, and the owner (which
// keeps every granule's descriptor) at most RLIMIT_NOFILE for the whole node. The
// owner and the client share this process here, so a granule shows two descriptors.
func TestCostPerGranule(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	c := attach(t, o)
	const k = 32
	a, err := c.Reserve(k * pg)
	require.NoError(t, err)
	b, err := c.Reserve(k * pg)
	require.NoError(t, err)
	nodepool.WaitReady(o)
	fds0 := openFds(t)
	in := func(r *nodepool.Reservation) int {
		return len(testutil.Overlapping(testutil.Maps(t), c.Base(r), c.Base(r)+k*pg))
	}
	assert.Equal(t, 1, in(a), "a reservation is one mapping")
	require.NoError(t, c.Commit(a, 0, k*pg))
	settleFds(t, fds0+2*k) // after the owner's ready granules are made again
	assert.Equal(t, k, in(a), "mappings after committing %d granules: one per granule", k)
	require.NoError(t, c.Share(b, 0, a, 0, k*pg, backing.ReadOnly))
	assert.Equal(t, fds0+2*k, openFds(t), "Share takes no descriptor")
	assert.Equal(t, k, in(b), "Share maps each granule again")
	require.True(t, c.Unreserve(b).OK())
	require.True(t, c.Unreserve(a).OK())
	settleFds(t, fds0)

	var rl unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &rl))
	mm, err := os.ReadFile("/proc/sys/vm/max_map_count")
	require.NoError(t, err)
	maxMaps, err := strconv.Atoi(string(bytes.TrimSpace(mm)))
	require.NoError(t, err)
	t.Logf("per granule: 1 descriptor in the holder, 1 in the owner, 1 mapping per place mapped; "+
		"here RLIMIT_NOFILE %d (hard %d), vm.max_map_count %d: at 2 MiB a process maps at most %d GiB, the node holds at most %d GiB",
		rl.Cur, rl.Max, maxMaps, min(int(rl.Cur), maxMaps)*2>>10, int(rl.Cur)*2>>10)
}
