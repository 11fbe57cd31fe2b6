package nodepool_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
)

// TestKillSoak kills client processes with SIGKILL at random points of their work
// (before, during and after attaching, mid-commit, waiting for the node's budget,
// mid-share, holding shared granules, borrowing the survivor's granules) while a surviving client in this process holds marked memory. After each
// kill the owner's ledger is exact (only the survivor's granules, the node's used
// bytes equal to them), no descriptor is left in the owner and the survivor's
// memory is bit-exact. NODEPOOL_SOAK_KILLS sets the number of kills (20; 5 with
// -short): NODEPOOL_SOAK_KILLS=1000 is the long soak.
func TestKillSoak(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	survivor := attach(t, o)
	const n = 16
	// Room for 12 granules beside the survivor's: the two helpers (up to 32 each)
	// contend, and some of their commits wait in the owner's queue when killed.
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, (n+12)*pg))
	r, err := survivor.Reserve(n * pg)
	require.NoError(t, err)
	defer survivor.Unreserve(r)
	require.NoError(t, survivor.Commit(r, 0, n*pg))
	want := make([]byte, n*pg)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	for i := range want {
		want[i] = byte(rng.Uint32())
	}
	require.NoError(t, survivor.CopyIn(r, 0, want))
	base := settle(t, o, n)
	nodepool.WaitReady(o)
	fds := openFds(t)
	kills := soakKills(t)
	holding := 0   // kills of a client that held granules at the time
	waiting := 0   // rounds where a helper waited for the budget when the first died
	borrowing := 0 // rounds where a helper mapped the survivor's granules then
	for k := range kills {
		// Two at a time, so that the owner serves and loses clients concurrently.
		a := startHelper(t, "client", o.Path(), rng.IntN(4) != 0)
		// b borrows 4 of the survivor's granules first: killing it must leave the
		// lender's memory and ledger as they were.
		b, number, in := startHelperIO(t, "client", o.Path(), true, helperBorrowEnv+"=1")
		ids, err := survivor.Lend(r, 4*pg, 4*pg, number)
		require.NoError(t, err)
		if k == 0 {
			fds += 4 // the lent granules' read-only descriptors, in the owner while they live
		}
		_, err = fmt.Fprintln(in, strings.Trim(fmt.Sprint(ids), "[]"))
		require.NoError(t, err)
		time.Sleep(time.Duration(rng.IntN(20_000)) * time.Microsecond)
		for _, c := range o.Stats().Clients {
			if c.Number != survivor.Number() && c.Granules > 0 {
				holding++
			}
			if c.Waiting > 0 {
				waiting++
			}
			if c.Borrowed > 0 {
				borrowing++
			}
		}
		kill(t, a)
		time.Sleep(time.Duration(rng.IntN(5_000)) * time.Microsecond)
		kill(t, b)
		s := settle(t, o, n)
		testutil.Await(func() bool { s = o.Stats(); return len(s.Clients) == 1 })
		require.Len(t, s.Clients, 1, "kill %d: only the survivor is attached", k)
		require.Equal(t, base.Device.Used, s.Device.Used, "kill %d: the node's used bytes", k)
		require.Equal(t, int64(n*pg), s.Clients[0].Owned, "kill %d: the survivor's ledger", k)
		require.Zero(t, s.Device.Waiters, "kill %d: waiters", k)
		settleFds(t, fds)
		got := make([]byte, n*pg)
		require.NoError(t, survivor.CopyOut(got, r, 0))
		require.True(t, bytes.Equal(want, got), "kill %d: the survivor's memory", k)
	}
	s := o.Stats()
	assert.GreaterOrEqual(t, s.Detached, uint64(kills), "clients that came and went")
	t.Logf("%d kills, %d clients detached (when the first of two died: %d holding granules, %d waiting for the budget, %d borrowing the survivor's), ledger exact after each",
		kills, s.Detached, holding, waiting, borrowing)
	if kills >= 20 {
		assert.Positive(t, holding, "some kills must find clients holding granules, or the soak tests nothing")
	}
}

// TestOwnerKilled kills the owner process with SIGKILL under a client that holds
// memory: the client's memory stays valid (no SIGBUS), its next call that needs the
// owner fails with ErrOwnerGone, a new owner starts on the same path, and nothing is
// left on disk or in /dev/shm.
func TestOwnerKilled(t *testing.T) {
	shm0 := dirNames(t, "/dev/shm")
	path := sockPath(t)
	owner := startHelper(t, "owner", path, true)
	c, err := nodepool.Attach(path, nodepool.ClientOptions{})
	require.NoError(t, err)
	r, err := c.Reserve(4 * pg)
	require.NoError(t, err)
	require.NoError(t, c.Commit(r, 0, 2*pg))
	require.NoError(t, c.CopyIn(r, pg-3, []byte("across")))
	r2, err := c.Reserve(4 * pg)
	require.NoError(t, err)
	require.NoError(t, c.Share(r2, 0, r, 0, 2*pg, 1))

	kill(t, owner)
	testutil.Await(func() bool { return c.Err() != nil })
	assert.ErrorIs(t, c.Err(), nodepool.ErrOwnerGone)
	assert.ErrorIs(t, c.Commit(r, 2*pg, pg), nodepool.ErrOwnerGone, "the next commit")
	_, err = c.Usage()
	assert.ErrorIs(t, err, nodepool.ErrOwnerGone)
	assert.Equal(t, "across", string(unsafeBytes(c.Base(r)+pg-3, 6)), "memory stays valid after the owner died")
	assert.Equal(t, "across", string(unsafeBytes(c.Base(r2)+pg-3, 6)), "and its shared mapping")
	copy(unsafeBytes(c.Base(r)+5, 3), "new")
	assert.Equal(t, "new", string(unsafeBytes(c.Base(r2)+5, 3)), "and writable")
	require.NoError(t, c.Decommit(r, 0, pg))
	assert.True(t, c.Unreserve(r).OK())
	assert.True(t, c.Unreserve(r2).OK())
	assert.Zero(t, c.Accounting().Authority().Stats().Owned)
	require.NoError(t, c.Close())

	o := startOwnerAt(t, path) // the killed owner's socket is stale: Listen replaces it
	c2 := attach(t, o)
	r3, err := c2.Reserve(pg)
	require.NoError(t, err)
	require.NoError(t, c2.Commit(r3, 0, pg))
	assert.True(t, c2.Unreserve(r3).OK())
	assert.Equal(t, shm0, dirNames(t, "/dev/shm"), "nothing left in /dev/shm")
	assert.Equal(t, []string{"node.sock"}, dirNames(t, filepath.Dir(path)), "only the live owner's socket on disk")
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}
