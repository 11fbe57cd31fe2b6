package nodepool_test

import (
	"context"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// TestOwnerGoneWhileWaiting closes the owner under a commit that waits for the
// node's budget: the commit fails with ErrOwnerGone and holds nothing.
func TestOwnerGoneWhileWaiting(t *testing.T) {
	o, err := nodepool.Listen(sockPath(t), nodepool.OwnerOptions{Granularity: pg})
	require.NoError(t, err)
	require.NoError(t, o.Governor().SetLimit(accounting.HostKey, pg))
	holder, err := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
	require.NoError(t, err)
	waiter, err := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
	require.NoError(t, err)
	hr, err := holder.Reserve(pg)
	require.NoError(t, err)
	require.NoError(t, holder.Commit(hr, 0, pg))
	wr, err := waiter.Reserve(pg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- waiter.CommitCtx(context.Background(), wr, 0, pg) }()
	waitWaiters(t, o, 1)
	require.NoError(t, o.Close())
	assert.ErrorIs(t, <-done, nodepool.ErrOwnerGone)
	assert.Zero(t, waiter.Accounting().Authority().Stats().Owned, "the waiter's ledger")
	assert.True(t, waiter.Unreserve(wr).OK())
	assert.True(t, holder.Unreserve(hr).OK())
	assert.NoError(t, waiter.Close())
	assert.NoError(t, holder.Close())
}

// fakeOwner accepts one connection on a socket of its own, answers hello with
// granule pg, and hands the connection to serve.
func fakeOwner(t *testing.T, serve func(c *net.UnixConn)) string {
	t.Helper()
	path := sockPath(t)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { _ = ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 4096)
		if _, _, _, _, err := c.ReadMsgUnix(buf, nil); err != nil {
			return
		}
		_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpHello|nodepool.ReplyBit, 0, 0, pg, 1, 0, nil), nil, nil)
		serve(c)
	}()
	return path
}

// TestHostileOwner plays an owner that breaks the protocol: the client fails its
// calls with ErrProtocol, closes whatever descriptors came, and commits nothing.
func TestHostileOwner(t *testing.T) {
	// The test sends read ends of pipes; once the client and the test have closed
	// theirs, a write to the pipe fails with EPIPE, which is how the test sees that
	// the client closed the descriptors it was sent.
	type pipe struct{ p, q *os.File }
	for _, tt := range []struct {
		name  string
		pipes int
		reply func(c *net.UnixConn, id uint64, fds []int)
	}{
		{"fewer descriptors than ids", 1, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpAlloc|nodepool.ReplyBit, 0, id, 0, 0, 0, []uint64{1, 2}), unix.UnixRights(fds...), nil)
		}},
		{"descriptors on an error", 1, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpAlloc|nodepool.ReplyBit, 1, id, 0, 0, 0, nil), unix.UnixRights(fds...), nil)
		}},
		{"a reply to nothing", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpStats|nodepool.ReplyBit, 0, id+100, 0, 0, 0, nil), nil, nil)
		}},
		{"garbage", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix([]byte("not a message"), nil, nil)
		}},
		{"a request", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpAlloc, 0, id, 1, 0, 0, nil), nil, nil)
		}},
		{"a reclaim of an unknown stage", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpReclaim, 0, 1, pg, 3, 0, nil), nil, nil)
		}},
		{"a reclaim of nothing", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpReclaim, 0, 1, 0, nodepool.StageIdle, 0, nil), nil, nil)
		}},
		{"a reclaim with ids", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpReclaim, 0, 1, pg, nodepool.StageIdle, 0, []uint64{1}), nil, nil)
		}},
		{"a reclaim with a descriptor", 1, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpReclaim, 0, 1, pg, nodepool.StagePrefix, 0, nil), unix.UnixRights(fds...), nil)
		}},
		{"a borrow's code on an alloc", 0, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpAlloc|nodepool.ReplyBit, nodepool.CodeGone, id, 1, 0, 0, nil), nil, nil)
		}},
		{"more granules than asked", 2, func(c *net.UnixConn, id uint64, fds []int) {
			_, _, _ = c.WriteMsgUnix(nodepool.Encode(nodepool.OpAlloc|nodepool.ReplyBit, 0, id, 0, 0, 0, []uint64{1, 2}), unix.UnixRights(fds...), nil)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var pipes []pipe
			var fds []int
			for range tt.pipes {
				p, q, err := os.Pipe()
				require.NoError(t, err)
				t.Cleanup(func() { _ = p.Close(); _ = q.Close() })
				pipes = append(pipes, pipe{p, q})
				fds = append(fds, int(p.Fd()))
			}
			path := fakeOwner(t, func(c *net.UnixConn) {
				buf := make([]byte, 4096)
				n, _, _, _, err := c.ReadMsgUnix(buf, nil)
				if err != nil {
					return
				}
				_, _, id, _, _, err := nodepool.Decode(buf[:n])
				if err != nil {
					return
				}
				tt.reply(c, id, fds)
				_, _, _, _, _ = c.ReadMsgUnix(buf, nil) // until the client hangs up
			})
			c, err := nodepool.Attach(path, nodepool.ClientOptions{})
			require.NoError(t, err)
			r, err := c.Reserve(pg)
			require.NoError(t, err)
			err = c.Commit(r, 0, pg)
			assert.ErrorIs(t, err, nodepool.ErrProtocol)
			assert.ErrorIs(t, c.Err(), nodepool.ErrProtocol)
			assert.Zero(t, c.Accounting().Authority().Stats().Owned)
			assert.True(t, c.Unreserve(r).OK())
			require.NoError(t, c.Close())
			for _, pp := range pipes {
				require.NoError(t, pp.p.Close())
				_, err := pp.q.Write([]byte{1})
				assert.ErrorIs(t, err, syscall.EPIPE, "a descriptor the client was sent is still open")
			}
		})
	}
}
