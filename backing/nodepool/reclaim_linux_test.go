package nodepool_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
)

// hangGuard bounds a wait that must end on its own, so that a bug fails the test
// rather than hangs it; no test depends on how long the wait takes.
const hangGuard = time.Minute

// attachWith is attach with options.
func attachWith(t testing.TB, o *nodepool.Owner, opts nodepool.ClientOptions) *nodepool.Client {
	t.Helper()
	c, err := nodepool.Attach(o.Path(), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := c.Close(); !errors.Is(err, nodepool.ErrClosed) {
			assert.NoError(t, err)
		}
		a := c.Accounting().Authority()
		assert.Zero(t, a.Stats().Owned, "the client's owned bytes")
		assert.Zero(t, a.Stats().Mapped, "the client's mapped bytes")
	})
	return c
}

// clientStats returns what the owner holds for client number n (false if it is not
// attached).
func clientStats(o *nodepool.Owner, n uint64) (nodepool.ClientStats, bool) {
	for _, cs := range o.Stats().Clients {
		if cs.Number == n {
			return cs, true
		}
	}
	return nodepool.ClientStats{}, false
}

// checkLedger asserts that the node's used bytes are exactly what its clients are
// charged, and that the owner's ledgers mark idle exactly what the clients report.
func checkLedger(t *testing.T, o *nodepool.Owner) nodepool.NodeStats {
	t.Helper()
	s := o.Stats()
	var owned, idle int64
	reported := 0
	for _, cs := range s.Clients {
		owned += cs.Owned
		reported += cs.Idle
	}
	for _, as := range s.Device.Authorities {
		idle += as.Idle
	}
	assert.Equal(t, s.Device.Used, owned, "the node's used bytes are its clients'")
	assert.Equal(t, int64(reported*s.Granule), idle, "the owner's ledgers mark idle what the clients report")
	assert.Equal(t, int64(s.Granules*s.Granule), s.Device.Used, "every live granule is charged once")
	return s
}

// TestClientPool checks the client's pool on its own: a granule whose last mapping
// goes stays with the client, charged and idle on both ledgers, and serves the
// next commit with no new granule; past High, and with ClientNoPool, it goes back.
func TestClientPool(t *testing.T) {
	for _, tt := range []struct {
		name       string
		high       int
		idle, kept int // granules idle after 4 were decommitted; kept by the owner
	}{
		{"default", 0, 4, 4},
		{"high 2", 2, 2, 2},
		{"no pool", nodepool.ClientNoPool, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
			c := attachWith(t, o, nodepool.ClientOptions{High: tt.high, Decay: nodepool.ClientNoDecay})
			assert.Equal(t, tt.high < 0, c.CommitZeroes(), "only a client with no pool commits zeroes")
			r, err := c.Reserve(4 * pg)
			require.NoError(t, err)
			require.NoError(t, c.Commit(r, 0, 4*pg))
			require.NoError(t, c.Decommit(r, 0, 4*pg))
			ps := c.PoolStats()
			assert.Equal(t, int64(tt.idle*pg), ps.Idle, "idle granules")
			assert.Equal(t, ps.Idle, ps.Owned, "the idle granules stay owned")
			assert.Equal(t, ps.Owned, c.Accounting().Authority().Stats().Owned, "PoolStats.Owned is the authority's")
			assert.Equal(t, ps.Idle, c.Accounting().Authority().Stats().Idle, "and marked idle on it")
			testutil.WaitFor(t, "the owner sees the idle report and the frees", func() bool {
				cs, _ := clientStats(o, c.Number())
				return cs.Idle == tt.idle && cs.Granules == tt.kept
			})
			checkLedger(t, o)
			require.NoError(t, c.Commit(r, 0, 4*pg))
			if tt.high < 0 {
				assert.Zero(t, c.PoolStats(), "a client that keeps no pool has no PoolStats")
				assert.ErrorIs(t, c.Prefill(1), backing.ErrUnsupported)
				_, err := c.Trim(0)
				assert.ErrorIs(t, err, backing.ErrUnsupported)
			} else {
				assert.Equal(t, int64(4+4-tt.idle), c.PoolStats().Created, "the commit took the idle granules first")
			}
			require.True(t, c.Unreserve(r).OK())
		})
	}
}

// TestReclaimIdle: a request that waits on a full node is served from another
// process's idle granules: the owner asks the client that keeps them, which gives
// back as many as the waiter needs and keeps the rest. Without the reclaim the
// waiter would wait for good (the idle client does not decay).
func TestReclaimIdle(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 8*pg))
	idler := attachWith(t, o, nodepool.ClientOptions{Decay: nodepool.ClientNoDecay})
	r, err := idler.Reserve(8 * pg)
	require.NoError(t, err)
	defer idler.Unreserve(r)
	require.NoError(t, idler.Commit(r, 0, 8*pg))
	require.NoError(t, idler.Decommit(r, 0, 8*pg))
	testutil.WaitFor(t, "the owner sees 8 idle granules", func() bool {
		cs, _ := clientStats(o, idler.Number())
		return cs.Idle == 8
	})
	checkLedger(t, o)

	waiter := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	wr, err := waiter.Reserve(3 * pg)
	require.NoError(t, err)
	defer waiter.Unreserve(wr)
	assert.ErrorIs(t, waiter.Commit(wr, 0, 3*pg), accounting.ErrBudgetExceeded, "a commit that does not wait is refused")
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	require.NoError(t, waiter.CommitCtx(ctx, wr, 0, 3*pg), "served from the idle client's granules")
	assert.Equal(t, int64(5*pg), idler.PoolStats().Idle, "the idle client gave back what the waiter needed")
	testutil.WaitFor(t, "the answer and the idle report", func() bool { // they follow the frees
		cs, _ := clientStats(o, idler.Number())
		return o.Stats().Reclaim.Given == int64(3*pg) && cs.Idle == 5 && cs.Granules == 5
	})
	s := checkLedger(t, o)
	assert.Equal(t, int64(8*pg), s.Device.Used, "the node stays within its budget")
	assert.GreaterOrEqual(t, s.Reclaim.Asked, uint64(1))
	assert.Zero(t, s.Reclaim.Short, "the idle client gave what it reported")
	assert.Zero(t, s.Reclaim.Unanswered)
}

// TestReclaimIdleAfterWait: while a request waits, a granule that goes idle in
// another process goes back to the owner rather than to that process's pool, and
// serves the waiter.
func TestReclaimIdleAfterWait(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 4*pg))
	busy := attachWith(t, o, nodepool.ClientOptions{Decay: nodepool.ClientNoDecay})
	r, err := busy.Reserve(4 * pg)
	require.NoError(t, err)
	defer busy.Unreserve(r)
	require.NoError(t, busy.Commit(r, 0, 4*pg))
	waiter := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	wr, err := waiter.Reserve(2 * pg)
	require.NoError(t, err)
	defer waiter.Unreserve(wr)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		done <- waiter.CommitCtx(ctx, wr, 0, 2*pg)
	}()
	waitWaiters(t, o, 1)
	require.NoError(t, busy.Decommit(r, 0, 2*pg)) // the last mapping of two granules
	require.NoError(t, <-done)
	assert.Zero(t, busy.PoolStats().Idle, "they did not stay idle")
	checkLedger(t, o)
}

// TestReclaimOwnWait: while a commit of a process waits on the node, a granule that
// goes idle in the same process goes back to the owner, which serves the commit with
// it, rather than wait in the pool while the commit waits.
func TestReclaimOwnWait(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 4*pg))
	c := attachWith(t, o, nodepool.ClientOptions{Decay: nodepool.ClientNoDecay})
	r, err := c.Reserve(4 * pg)
	require.NoError(t, err)
	defer c.Unreserve(r)
	require.NoError(t, c.Commit(r, 0, 4*pg))
	wr, err := c.Reserve(2 * pg)
	require.NoError(t, err)
	defer c.Unreserve(wr)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		done <- c.CommitCtx(ctx, wr, 0, 2*pg)
	}()
	waitWaiters(t, o, 1)
	require.NoError(t, c.Decommit(r, 0, 2*pg))
	require.NoError(t, <-done)
	checkLedger(t, o)
}

// TestReclaimNeverLive: a client whose memory is all in use is asked, and gives
// nothing: the waiter waits until its context ends, and the client's bytes are
// intact.
func TestReclaimNeverLive(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 4*pg))
	live := attachWith(t, o, nodepool.ClientOptions{})
	r, err := live.Reserve(4 * pg)
	require.NoError(t, err)
	defer live.Unreserve(r)
	require.NoError(t, live.Commit(r, 0, 4*pg))
	want := make([]byte, 4*pg)
	for i := range want {
		want[i] = byte(i*7 + 3)
	}
	require.NoError(t, live.CopyIn(r, 0, want))
	waiter := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	wr, err := waiter.Reserve(pg)
	require.NoError(t, err)
	defer waiter.Unreserve(wr)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- waiter.CommitCtx(ctx, wr, 0, pg) }()
	testutil.WaitFor(t, "both clients answered the reclaim", func() bool {
		return o.Stats().Reclaim.Answered == 2 && o.Governor().Stats(accounting.HostKey).Waiters == 1
	})
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled, "nothing came back: the waiter waited until its context ended")
	got := make([]byte, 4*pg)
	require.NoError(t, live.CopyOut(got, r, 0))
	assert.Equal(t, want, got, "the live client's bytes are intact")
	s := checkLedger(t, o)
	assert.Equal(t, uint64(2), s.Reclaim.Asked, "each client was asked once, for cached prefixes (no idle granule)")
	assert.Zero(t, s.Reclaim.Given, "nothing was given back")
	assert.Zero(t, s.Reclaim.Unanswered)
}

// TestReclaimHostile: a client that reports idle granules it does not give back,
// or never answers a reclaim, can not stall the owner: its report is bounded by
// the granules it holds, a short answer or none (after the bound) is counted, the
// shortfall is asked of every process's cached prefixes, and another client is
// served as soon as memory comes back.
func TestReclaimHostile(t *testing.T) {
	for _, tt := range []struct {
		name   string
		answer bool // answer reclaims, giving back nothing
	}{{"liar", true}, {"silent", false}} {
		t.Run(tt.name, func(t *testing.T) {
			o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
			require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 4*pg))
			r := dialRaw(t, o, true)
			r.send(nodepool.Encode(nodepool.OpAlloc, 0, 2, 4, 0, 0, nil))
			_, code, _, fds, ok := r.recv()
			require.True(t, ok)
			require.Equal(t, nodepool.CodeOK, code)
			for _, fd := range fds {
				require.NoError(t, unix.Close(fd))
			}
			r.send(nodepool.Encode(nodepool.OpIdle, 0, 3, 1<<40, 0, 0, nil)) // more than it holds
			testutil.WaitFor(t, "the report bounded by the granules it holds", func() bool {
				s := o.Stats()
				return len(s.Clients) == 1 && s.Clients[0].Idle == 4
			})
			checkLedger(t, o)
			answered := make(chan struct{})
			if tt.answer {
				go answerNothing(r.c, answered)
			}

			waiter := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
			wr, err := waiter.Reserve(pg)
			require.NoError(t, err)
			defer waiter.Unreserve(wr)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- waiter.CommitCtx(ctx, wr, 0, pg) }()
			testutil.WaitFor(t, "the lie counted", func() bool {
				s := o.Stats().Reclaim
				if tt.answer {
					return s.Short >= 1
				}
				return s.Unanswered >= 1
			})
			// The owner serves the others meanwhile.
			_, err = waiter.Usage()
			require.NoError(t, err)
			require.NoError(t, r.c.Close()) // the memory comes back with the connection
			require.NoError(t, <-done, "the waiter is served once the hostile client is gone")
			cancel()
			if tt.answer {
				<-answered
			}
			checkLedger(t, o)
			require.NoError(t, waiter.Decommit(wr, 0, pg))
		})
	}
}

// answerNothing answers every reclaim on c with nothing given back, until c closes.
func answerNothing(c *net.UnixConn, done chan<- struct{}) {
	defer close(done)
	buf := make([]byte, 4096)
	for {
		n, _, _, _, err := c.ReadMsgUnix(buf, nil)
		if err != nil || n == 0 {
			return
		}
		op, _, id, _, _, err := nodepool.Decode(buf[:n])
		if err == nil && op == nodepool.OpReclaim {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpReclaim|nodepool.ReplyBit, 0, id, 0, 0, 0, nil), nil, nil)
		}
	}
}

// TestClientDecay: idle granules go back to the owner by the decay rule, all of
// those above Low within Decay after the load stops; Trim and Prefill move the
// pool by hand.
func TestClientDecay(t *testing.T) {
	const decay = 200 * time.Millisecond
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	c := attachWith(t, o, nodepool.ClientOptions{Decay: decay, Low: 1})
	r, err := c.Reserve(6 * pg)
	require.NoError(t, err)
	defer c.Unreserve(r)
	require.NoError(t, c.Commit(r, 0, 6*pg))
	require.NoError(t, c.Decommit(r, 0, 6*pg))
	start := time.Now()
	testutil.WaitFor(t, "the pool decays to Low", func() bool {
		cs, _ := clientStats(o, c.Number())
		return c.PoolStats().Idle == pg && cs.Granules == 1 && cs.Idle == 1
	})
	t.Logf("6 idle granules decayed to Low (1) in %v (Decay %v)", time.Since(start).Round(time.Millisecond), decay)
	s := checkLedger(t, o)
	assert.Equal(t, int64(pg), s.Device.Used, "the owner took the decayed granules back")
	assert.Equal(t, int64(5), c.PoolStats().GivenBack)

	require.NoError(t, c.Prefill(3))
	assert.Equal(t, int64(3*pg), c.PoolStats().Idle)
	assert.Equal(t, int64(3*pg), c.PoolStats().Resident, "Prefill populates")
	n, err := c.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(3*pg), n)
	testutil.WaitFor(t, "the owner sees the pool empty", func() bool {
		cs, _ := clientStats(o, c.Number())
		return cs.Granules == 0 && cs.Idle == 0
	})
	checkLedger(t, o)
}

// TestReclaimPrefix: a request that waits on a full node, with no idle granule
// anywhere, is served from another process's cached prefix that no live sequence
// maps: the owner asks every process, the helper's kv.PrefixCache evicts through
// its reclaimer, and the granules come back. A request that only live tokens could
// serve waits until its context ends, and the helper's live sequence reads as it
// was written.
func TestReclaimPrefix(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	h := startPrefixHelper(t, o.Path())
	require.Positive(t, h.cached, "the helper caches a prompt no live sequence maps")
	testutil.WaitFor(t, "the owner charges what the helper holds", func() bool {
		return o.Governor().Stats(accounting.HostKey).Used == h.owned
	})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, h.owned)) // the node is full
	waiter := attachWith(t, o, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	need := max(int(h.cached)/2/pg, 1)
	wr, err := waiter.Reserve(int(h.owned))
	require.NoError(t, err)
	defer waiter.Unreserve(wr)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	require.NoError(t, waiter.CommitCtx(ctx, wr, 0, need*pg), "served from the helper's cached prefix")
	intact, evicted := h.check(t)
	assert.True(t, intact, "the helper's live sequence is intact")
	assert.GreaterOrEqual(t, evicted, int64(need*pg), "the helper's prefix cache evicted what the waiter needed")
	testutil.WaitFor(t, "the helper's answer", func() bool { return o.Stats().Reclaim.Given >= int64(need*pg) })
	checkLedger(t, o)

	// Everything the helper holds but the live sequence's would not cover this.
	before := o.Stats().Reclaim.Answered
	wctx, wcancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	rest := int(h.owned)/pg - need
	go func() { done <- waiter.CommitCtx(wctx, wr, need*pg, rest*pg) }()
	testutil.WaitFor(t, "both processes answered", func() bool { return o.Stats().Reclaim.Answered >= before+2 })
	wcancel()
	assert.ErrorIs(t, <-done, context.Canceled, "live tokens are never taken: the waiter waits until its context ends")
	intact, _ = h.check(t)
	assert.True(t, intact, "the helper's live sequence is intact")
	cs, ok := clientStats(o, h.number)
	require.True(t, ok)
	assert.Positive(t, cs.Granules, "the helper keeps its live sequence's granules")
	checkLedger(t, o)
}
