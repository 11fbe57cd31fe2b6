package nodepool_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
)

// sockPath returns a socket path in a fresh directory, short enough for sun_path.
func sockPath(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "np")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return filepath.Join(dir, "node.sock")
}

// startOwner starts an owner that the test closes; at cleanup it checks that no
// granule is left.
func startOwner(t testing.TB, opts nodepool.OwnerOptions) *nodepool.Owner {
	t.Helper()
	o, err := nodepool.Listen(sockPath(t), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		settle(t, o, 0)
		assert.Zero(t, o.Governor().Stats(accounting.HostKey).Used, "the node's used bytes")
		assert.NoError(t, o.Close())
		_, err := os.Lstat(o.Path())
		assert.ErrorIs(t, err, os.ErrNotExist, "Close removes the socket")
	})
	return o
}

// settle waits until the owner holds granules granules and no client is waiting
// (a detach is noticed on the owner's goroutine).
func settle(t testing.TB, o *nodepool.Owner, granules int) nodepool.NodeStats {
	t.Helper()
	var s nodepool.NodeStats
	testutil.Await(func() bool { s = o.Stats(); return s.Granules == granules })
	require.Equal(t, granules, s.Granules, "granules the owner holds")
	return s
}

// attach attaches a client with an authority of its own and closes it at cleanup
// (unless the test did).
func attach(t testing.TB, o *nodepool.Owner) *nodepool.Client {
	t.Helper()
	c, err := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := c.Close(); !errors.Is(err, nodepool.ErrClosed) { // the test may have closed it
			assert.NoError(t, err)
		}
		a := c.Accounting().Authority()
		assert.Zero(t, a.Stats().Owned, "the client's owned bytes")
		assert.Zero(t, a.Stats().Mapped, "the client's mapped bytes")
	})
	return c
}

func TestRunSuite(t *testing.T) {
	for _, g := range []int{os.Getpagesize(), 2 << 20} {
		t.Run(backingtestName(g), func(t *testing.T) {
			o := startOwner(t, nodepool.OwnerOptions{Granularity: g})
			backingtest.Run(t, func(t *testing.T) backing.Backing[*nodepool.Reservation] { return attach(t, o) })
		})
	}
	// A client that keeps no pool: every granule a new memfd (CommitZeroes).
	t.Run("pool=off", func(t *testing.T) {
		o := startOwner(t, nodepool.OwnerOptions{Granularity: os.Getpagesize()})
		backingtest.Run(t, func(t *testing.T) backing.Backing[*nodepool.Reservation] {
			return attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
		})
	})
}

func backingtestName(g int) string {
	if g >= 1<<20 {
		return "granule=" + itoa(g>>20) + "MiB"
	}
	return "granule=" + itoa(g>>10) + "KiB"
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}
