package nodepool_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
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

const pg = 4096

func TestListenBadInput(t *testing.T) {
	dir := filepath.Dir(sockPath(t))
	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	for _, tt := range []struct {
		name string
		path string
		opts nodepool.OwnerOptions
	}{
		{"empty path", "", nodepool.OwnerOptions{}},
		{"path too long", "/tmp/" + strings.Repeat("x", 120), nodepool.OwnerOptions{}},
		{"granule not a power of two", filepath.Join(dir, "a"), nodepool.OwnerOptions{Granularity: 3 * pg}},
		{"granule below the page", filepath.Join(dir, "a"), nodepool.OwnerOptions{Granularity: 512}},
		{"negative granule", filepath.Join(dir, "a"), nodepool.OwnerOptions{Granularity: -pg}},
		{"name too long", filepath.Join(dir, "a"), nodepool.OwnerOptions{Name: strings.Repeat("n", 250)}},
		{"path is a file", file, nodepool.OwnerOptions{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o, err := nodepool.Listen(tt.path, tt.opts)
			assert.ErrorIs(t, err, nodepool.ErrInvalidOption)
			assert.Nil(t, o)
		})
	}
	t.Run("a live owner on the path", func(t *testing.T) {
		o := startOwner(t, nodepool.OwnerOptions{})
		o2, err := nodepool.Listen(o.Path(), nodepool.OwnerOptions{})
		assert.ErrorIs(t, err, nodepool.ErrOwnerRunning)
		assert.Nil(t, o2)
		c := attach(t, o) // the first owner still serves
		_, err = c.Usage()
		assert.NoError(t, err)
	})
	t.Run("socket mode", func(t *testing.T) {
		o := startOwner(t, nodepool.OwnerOptions{})
		fi, err := os.Stat(o.Path())
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	})
}

func TestAttachBadInput(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	for _, tt := range []struct {
		name string
		path string
		opts nodepool.ClientOptions
		want error
	}{
		{"empty path", "", nodepool.ClientOptions{}, nodepool.ErrInvalidOption},
		{"path too long", "/tmp/" + strings.Repeat("x", 120), nodepool.ClientOptions{}, nodepool.ErrInvalidOption},
		{"no owner", filepath.Join(filepath.Dir(o.Path()), "none"), nodepool.ClientOptions{}, nodepool.ErrOwnerGone},
		{"authority off the host", o.Path(), nodepool.ClientOptions{Authority: accounting.NewGovernor().Authority("gpu", accounting.GPU(0))}, nodepool.ErrInvalidOption},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := nodepool.Attach(tt.path, tt.opts)
			assert.ErrorIs(t, err, tt.want)
			assert.Nil(t, c)
		})
	}
	t.Run("peer of another user", func(t *testing.T) {
		nodepool.ServeUID(o, uint32(os.Getuid())+1)
		defer nodepool.ServeUID(o, uint32(os.Getuid()))
		c, err := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
		assert.ErrorIs(t, err, nodepool.ErrPeerRefused)
		assert.Nil(t, c)
	})
}

// raw is a hostile peer: a bare connection that speaks bytes.
type raw struct {
	t        *testing.T
	c        *net.UnixConn
	reclaims int   // the owner's reclaim requests recv skipped
	err      error // the last read's error (a time-out: the connection is open)
}

func dialRaw(t *testing.T, o *nodepool.Owner, hello bool) *raw {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: o.Path(), Net: "unixpacket"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	r := &raw{t: t, c: c}
	if hello {
		r.send(nodepool.Encode(nodepool.OpHello, 0, 1, nodepool.ProtocolVersion, 0, 0, nil))
		op, code, _, _, _ := r.recv()
		require.Equal(t, nodepool.OpHello|nodepool.ReplyBit, op)
		require.Equal(t, nodepool.CodeOK, code)
	}
	return r
}

func (r *raw) send(p []byte, fds ...int) {
	r.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := r.c.WriteMsgUnix(p, oob, nil)
	require.NoError(r.t, err)
}

// recv reads one message; ok is false at the end of the connection.
func (r *raw) recv() (op, code uint8, ids []uint64, fds []int, ok bool) {
	r.t.Helper()
	buf := make([]byte, 4096)
	oob := make([]byte, 4096)
	require.NoError(r.t, r.c.SetReadDeadline(time.Now().Add(10*time.Second)))
	n, oobn, _, _, err := r.c.ReadMsgUnix(buf, oob)
	r.err = err
	if err != nil || n == 0 {
		return 0, 0, nil, nil, false
	}
	if oobn == 0 && buf[0] == nodepool.OpReclaim {
		// The owner's one request (a request of another waits): this peer never
		// answers it, and the owner must not wait for that.
		r.reclaims++
		return r.recv()
	}
	if oobn > 0 {
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		require.NoError(r.t, err)
		for _, cm := range cms {
			f, err := unix.ParseUnixRights(&cm)
			require.NoError(r.t, err)
			fds = append(fds, f...)
		}
	}
	op, code, _, _, ids, err = nodepool.Decode(buf[:n])
	require.NoError(r.t, err)
	return op, code, ids, fds, true
}

// closed asserts that the owner ends the connection, after at most a protocol reply.
func (r *raw) closed(what string) {
	r.t.Helper()
	for range 2 {
		_, code, _, fds, ok := r.recv()
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
		if !ok {
			// NB: a read that timed out is an open connection, not a closed one.
			assert.NotErrorIs(r.t, r.err, os.ErrDeadlineExceeded, "%s: the owner kept the connection open (no answer, no close)", what)
			return
		}
		assert.NotEqual(r.t, nodepool.CodeOK, code, "%s: the owner's answer", what)
	}
	r.t.Errorf("%s: the owner kept the connection open", what)
}

// openFds counts this process's open descriptors.
func openFds(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// settleFds waits until this process has n descriptors open (the owner closes a
// connection's end on its own goroutine).
func settleFds(t *testing.T, n int) {
	t.Helper()
	testutil.Await(func() bool { return openFds(t) == n })
	assert.Equal(t, n, openFds(t), "descriptors open in this process (owner and clients)")
}

// TestHostile sends the owner every kind of bad message, after a victim client
// committed memory: each closes the hostile connection and changes nothing else.
func TestHostile(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	victim := attach(t, o)
	vr, err := victim.Reserve(2 * pg)
	require.NoError(t, err)
	defer victim.Unreserve(vr)
	require.NoError(t, victim.Commit(vr, 0, 2*pg)) // granule ids 1 and 2
	require.NoError(t, victim.CopyIn(vr, 100, []byte("victim")))
	base := settle(t, o, 2)
	p, q, err := os.Pipe()
	require.NoError(t, err)
	defer p.Close()
	defer q.Close()

	hello := func(id uint64) []byte {
		return nodepool.Encode(nodepool.OpHello, 0, id, nodepool.ProtocolVersion, 0, 0, nil)
	}
	tooMany := nodepool.Encode(nodepool.OpFree, 0, 9, 0, 0, 0, make([]uint64, nodepool.MaxBatch))
	tooMany[4] = nodepool.MaxBatch + 1
	for _, tt := range []struct {
		name  string
		hello bool   // send hello first
		own   int    // granules the hostile peer takes first
		msg   []byte // the bad message
		fd    bool   // attach a descriptor to it
	}{
		{"nothing but a byte", false, 0, []byte{1}, false},
		{"alloc before hello", false, 0, nodepool.Encode(nodepool.OpAlloc, 0, 2, 1, 0, 0, nil), false},
		{"hello of another version", false, 0, nodepool.Encode(nodepool.OpHello, 0, 1, 99, 0, 0, nil), false},
		{"hello with a descriptor", false, 0, hello(1), true},
		{"second hello", true, 0, hello(2), false},
		{"short", true, 0, make([]byte, 10), false},
		{"oversize", true, 0, make([]byte, 2*nodepool.MaxMsg), false},
		{"reserved byte", true, 0, func() []byte { m := hello(3); m[0], m[3] = nodepool.OpStats, 1; return m }(), false},
		{"unknown op", true, 0, nodepool.Encode(42, 0, 3, 0, 0, 0, nil), false},
		{"a reply", true, 0, nodepool.Encode(nodepool.OpStats|nodepool.ReplyBit, 0, 3, 0, 0, 0, nil), false},
		{"code on a request", true, 0, nodepool.Encode(nodepool.OpStats, 1, 3, 0, 0, 0, nil), false},
		{"too many ids", true, 0, append(tooMany, make([]byte, 8)...), false},
		{"alloc of none", true, 0, nodepool.Encode(nodepool.OpAlloc, 0, 3, 0, 0, 0, nil), false},
		{"alloc of too many", true, 0, nodepool.Encode(nodepool.OpAlloc, 0, 3, nodepool.MaxBatch+1, 0, 0, nil), false},
		{"alloc with ids", true, 0, nodepool.Encode(nodepool.OpAlloc, 0, 3, 1, 0, 0, []uint64{1}), false},
		{"alloc with a deadline past int64", true, 0, nodepool.Encode(nodepool.OpAlloc, 0, 3, 1, 1<<63+5, 0, nil), false},
		{"stats with a descriptor", true, 0, nodepool.Encode(nodepool.OpStats, 0, 3, 0, 0, 0, nil), true},
		{"stats with ids", true, 0, nodepool.Encode(nodepool.OpStats, 0, 3, 0, 0, 0, []uint64{1}), false},
		{"cancel with ids", true, 0, nodepool.Encode(nodepool.OpCancel, 0, 3, 1, 0, 0, []uint64{1}), false},
		{"free of nothing", true, 0, nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, nil), false},
		{"free of an unknown granule", true, 0, nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, []uint64{1 << 40}), false},
		{"free of the victim's granule", true, 0, nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, []uint64{1}), false},
		{"free of the victim's granules after its own", true, 1, nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, []uint64{0, 2}), false},
		{"free of its own granule twice", true, 1, nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, []uint64{0, 0}), false},
		{"free with fields", true, 1, nodepool.Encode(nodepool.OpFree, 0, 3, 1, 0, 0, []uint64{0}), false},
		{"a reclaim request from a client", true, 0, nodepool.Encode(nodepool.OpReclaim, 0, 3, pg, nodepool.StageIdle, 0, nil), false},
		{"a reclaim answer never asked for", true, 0, nodepool.Encode(nodepool.OpReclaim|nodepool.ReplyBit, 0, 7, pg, 0, 0, nil), false},
		{"a reclaim answer of id 0", true, 0, nodepool.Encode(nodepool.OpReclaim|nodepool.ReplyBit, 0, 0, 0, 0, 0, nil), false},
		{"idle with fields", true, 1, nodepool.Encode(nodepool.OpIdle, 0, 3, 1, 1, 0, nil), false},
		{"idle with ids", true, 1, nodepool.Encode(nodepool.OpIdle, 0, 3, 1, 0, 0, []uint64{0}), false},
		{"idle with a descriptor", true, 1, nodepool.Encode(nodepool.OpIdle, 0, 3, 1, 0, 0, nil), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			nodepool.WaitReady(o)
			fds0 := openFds(t)
			r := dialRaw(t, o, tt.hello)
			var own []uint64
			if tt.own > 0 {
				r.send(nodepool.Encode(nodepool.OpAlloc, 0, 2, uint64(tt.own), 0, 0, nil))
				_, code, ids, fds, ok := r.recv()
				require.True(t, ok)
				require.Equal(t, nodepool.CodeOK, code)
				require.Len(t, fds, tt.own)
				for _, fd := range fds {
					require.NoError(t, unix.Close(fd))
				}
				own = ids
			}
			m := clone(tt.msg)
			if len(own) > 0 && len(m) > nodepool.HeaderLen { // id 0 stands for its own granule
				for i := nodepool.HeaderLen; i+8 <= len(m); i += 8 {
					if m[i] == 0 && allZero(m[i:i+8]) {
						copy(m[i:], le(own[0]))
					}
				}
			}
			if tt.fd {
				r.send(m, int(p.Fd()))
			} else {
				r.send(m)
			}
			r.closed(tt.name)
			require.NoError(t, r.c.Close())
			s := settle(t, o, 2)
			assert.Len(t, s.Clients, 1, "only the victim is attached")
			assert.Equal(t, base.Device.Used, s.Device.Used, "the node's used bytes")
			got := make([]byte, 6)
			require.NoError(t, victim.CopyOut(got, vr, 100))
			assert.Equal(t, "victim", string(got), "the victim's memory")
			_, err := victim.Usage()
			assert.NoError(t, err, "the victim is still served")
			settleFds(t, fds0)
		})
	}
}

func allZero(p []byte) bool {
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}

func le(v uint64) []byte {
	p := make([]byte, 8)
	for i := range p {
		p[i] = byte(v >> (8 * i))
	}
	return p
}

// TestGranuleSealed checks what a client can do with a granule's descriptor: map
// its one granule, and neither grow it to reach more memory nor shrink it under
// another mapping.
func TestGranuleSealed(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	r := dialRaw(t, o, true)
	r.send(nodepool.Encode(nodepool.OpAlloc, 0, 2, 2, 0, 0, nil))
	_, code, ids, fds, ok := r.recv()
	require.True(t, ok)
	require.Equal(t, nodepool.CodeOK, code)
	require.Len(t, fds, 2)
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	assert.NotEqual(t, ids[0], ids[1])
	var st0, st1 unix.Stat_t
	require.NoError(t, unix.Fstat(fds[0], &st0))
	require.NoError(t, unix.Fstat(fds[1], &st1))
	assert.NotEqual(t, st0.Ino, st1.Ino, "a file per granule")
	assert.Equal(t, int64(pg), st0.Size, "the file is one granule")
	assert.ErrorIs(t, unix.Ftruncate(fds[0], 2*pg), unix.EPERM, "grow")
	assert.ErrorIs(t, unix.Ftruncate(fds[0], 0), unix.EPERM, "shrink")
	seals, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GET_SEALS, 0)
	require.NoError(t, err)
	want := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	assert.Equal(t, want, seals&want)
	_, err = unix.FcntlInt(uintptr(fds[0]), unix.F_ADD_SEALS, unix.F_SEAL_WRITE)
	assert.ErrorIs(t, err, unix.EPERM, "no seal may be added past F_SEAL_SEAL")
	// A mapping past the granule maps nothing: its pages fault (SIGBUS) rather than
	// reach anyone's memory; mmap itself may succeed, so only the size is the check.
	b, err := unix.Mmap(fds[0], 0, pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	b[0] = 7
	require.NoError(t, unix.Munmap(b))
	r.send(nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, ids))
	settle(t, o, 0)
}

// TestTooManyWaiting checks the bound on one client's waiting allocations: the one
// past it closes the connection, and every wait it had goes with it.
func TestTooManyWaiting(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, pg))
	holder := attach(t, o)
	hr, err := holder.Reserve(pg)
	require.NoError(t, err)
	defer holder.Unreserve(hr)
	require.NoError(t, holder.Commit(hr, 0, pg))
	r := dialRaw(t, o, true)
	for i := range nodepool.MaxPending {
		r.send(nodepool.Encode(nodepool.OpAlloc, 0, uint64(10+i), 1, ^uint64(0), 0, nil))
	}
	waitWaiters(t, o, nodepool.MaxPending)
	r.send(nodepool.Encode(nodepool.OpAlloc, 0, 9, 1, ^uint64(0), 0, nil))
	for { // the waits end cancelled, then the connection
		_, code, _, fds, ok := r.recv()
		require.Empty(t, fds)
		if !ok {
			break
		}
		assert.NotEqual(t, nodepool.CodeOK, code)
	}
	waitWaiters(t, o, 0)
	s := settle(t, o, 1)
	assert.Equal(t, int64(pg), s.Device.Used, "only the holder's granule")
}

func TestNodeBudget(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, 2*pg))
	a, b, c := attach(t, o), attach(t, o), attach(t, o)
	ra, err := a.Reserve(4 * pg)
	require.NoError(t, err)
	defer a.Unreserve(ra)
	rb, err := b.Reserve(4 * pg)
	require.NoError(t, err)
	defer b.Unreserve(rb)
	rc, err := c.Reserve(4 * pg)
	require.NoError(t, err)
	defer c.Unreserve(rc)
	require.NoError(t, a.Commit(ra, 0, 2*pg))

	err = b.Commit(rb, 0, pg)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded, "Commit with the node's budget spent")
	assert.True(t, accounting.CanWait(err))
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	assert.ErrorIs(t, b.Commit(rb, 0, 3*pg), accounting.ErrExceedsLimit, "Commit over the node's limit")

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	err = b.CommitCtx(ctx, rb, 0, pg)
	cancel()
	assert.ErrorIs(t, err, context.DeadlineExceeded, "the deadline carried to the owner")

	// FIFO across processes: b queues first, then c; each freed granule serves the
	// next in line.
	bdone, cdone := make(chan error, 1), make(chan error, 1)
	go func() { bdone <- b.CommitCtx(context.Background(), rb, 0, pg) }()
	waitWaiters(t, o, 1)
	go func() { cdone <- c.CommitCtx(context.Background(), rc, 0, pg) }()
	waitWaiters(t, o, 2)
	require.NoError(t, a.Decommit(ra, 0, pg))
	require.NoError(t, <-bdone, "the first waiter is served first")
	waitWaiters(t, o, 1)
	select {
	case err := <-cdone:
		t.Fatalf("the second waiter returned %v with no memory for it", err)
	default:
	}
	require.NoError(t, a.Decommit(ra, pg, pg))
	require.NoError(t, <-cdone, "the second waiter is served next")

	// A cancelled wait leaves the queue and holds nothing.
	ctx, cancel = context.WithCancel(context.Background())
	adone := make(chan error, 1)
	go func() { adone <- a.CommitCtx(ctx, ra, 0, pg) }()
	waitWaiters(t, o, 1)
	cancel()
	assert.ErrorIs(t, <-adone, context.Canceled)
	waitWaiters(t, o, 0)

	s := settle(t, o, 2)
	assert.Equal(t, int64(2*pg), s.Device.Used)
	require.Len(t, s.Clients, 3)
	for i, want := range []int64{0, pg, pg} {
		assert.Equal(t, want, s.Clients[i].Owned, "client %d", i+1)
		assert.Equal(t, os.Getpid(), int(s.Clients[i].PID))
		assert.Equal(t, uint32(os.Getuid()), s.Clients[i].UID)
	}
	u, err := b.Usage()
	require.NoError(t, err)
	assert.Equal(t, nodepool.Usage{NodeUsed: 2 * pg, NodeLimit: 2 * pg, Owned: pg}, u)
	assert.Equal(t, int64(pg), b.Accounting().Authority().Stats().Owned, "the process's own ledger")
}

// waitWaiters polls until n requests wait on the node's budget.
func waitWaiters(t *testing.T, o *nodepool.Owner, n int) {
	t.Helper()
	testutil.WaitFor(t, fmt.Sprintf("%d waiters on the node's budget", n), func() bool {
		return o.Governor().Stats(accounting.HostKey).Waiters == n
	})
}

func TestClientClose(t *testing.T) {
	o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
	c, err := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
	require.NoError(t, err)
	r, err := c.Reserve(pg)
	require.NoError(t, err)
	require.NoError(t, c.Commit(r, 0, pg))
	assert.ErrorIs(t, c.Close(), nodepool.ErrBusy, "Close with a live reservation")
	require.True(t, c.Unreserve(r).OK())
	require.NoError(t, c.Close())
	require.ErrorIs(t, c.Close(), nodepool.ErrClosed, "a second Close changes nothing")
	_, err = c.Reserve(pg)
	assert.ErrorIs(t, err, nodepool.ErrClosed)
	_, err = c.Usage()
	assert.ErrorIs(t, err, nodepool.ErrClosed)
	assert.ErrorIs(t, c.Err(), nodepool.ErrClosed)
}

// TestOwnerClose closes the owner under a client that holds memory: the memory
// stays readable, the next call that needs the owner says it is gone, and a new
// owner starts on the same path.
func TestOwnerClose(t *testing.T) {
	path := sockPath(t)
	o, err := nodepool.Listen(path, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, err)
	c, err := nodepool.Attach(path, nodepool.ClientOptions{})
	require.NoError(t, err)
	r, err := c.Reserve(3 * pg)
	require.NoError(t, err)
	require.NoError(t, c.Commit(r, 0, 2*pg))
	require.NoError(t, c.CopyIn(r, pg+5, []byte("kept")))
	require.NoError(t, o.Close())
	assert.Zero(t, o.Governor().Stats(accounting.HostKey).Used, "the owner's ledger after Close")
	assert.ErrorIs(t, o.Close(), nodepool.ErrClosed, "a second Close changes nothing")

	testutil.Await(func() bool { return c.Err() != nil })
	assert.ErrorIs(t, c.Err(), nodepool.ErrOwnerGone)
	assert.ErrorIs(t, c.Commit(r, 2*pg, pg), nodepool.ErrOwnerGone)
	got := make([]byte, 4)
	require.NoError(t, c.CopyOut(got, r, pg+5))
	assert.Equal(t, "kept", string(got), "memory stays valid while mapped")
	assert.Equal(t, "kept", string(unsafeBytes(c.Base(r)+pg+5, 4)), "read in place")
	require.NoError(t, c.Decommit(r, 0, pg), "Decommit needs no owner")
	require.True(t, c.Unreserve(r).OK())
	assert.Zero(t, c.Accounting().Authority().Stats().Owned)
	require.NoError(t, c.Close())

	o2 := startOwnerAt(t, path)
	c2 := attach(t, o2)
	_, err = c2.Usage()
	assert.NoError(t, err, "a new owner serves")
}

func startOwnerAt(t *testing.T, path string) *nodepool.Owner {
	o, err := nodepool.Listen(path, nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close()) })
	return o
}
