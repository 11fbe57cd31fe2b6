package nodepool_test

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// FuzzHostile sends the owner arbitrary records after a hello, then closes the
// connection: whatever they were, the owner must end up holding nothing for that
// peer, and must still serve a well-behaved client.
func FuzzHostile(f *testing.F) {
	f.Add(nodepool.Encode(nodepool.OpAlloc, 0, 2, 3, 0, 0, nil), []byte{}, uint8(1))
	f.Add(nodepool.Encode(nodepool.OpAlloc, 0, 2, 1, 0, 0, nil), nodepool.Encode(nodepool.OpFree, 0, 3, 0, 0, 0, []uint64{1}), uint8(2))
	f.Add(nodepool.Encode(nodepool.OpAlloc, 0, 2, 1, ^uint64(0), 0, nil), nodepool.Encode(nodepool.OpCancel, 0, 3, 2, 0, 0, nil), uint8(3))
	f.Add(nodepool.Encode(nodepool.OpStats, 0, 2, 0, 0, 0, nil), []byte{1, 2, 3}, uint8(0))
	f.Add(nodepool.Encode(nodepool.OpAlloc, 0, 2, 2, 0, 0, nil), nodepool.Encode(nodepool.OpIdle, 0, 3, 5, 0, 0, nil), uint8(1))
	f.Add(nodepool.Encode(nodepool.OpIdle, 0, 2, 1<<40, 0, 0, nil), nodepool.Encode(nodepool.OpReclaim|nodepool.ReplyBit, 0, 1, 3, 0, 0, nil), uint8(2))
	f.Add(nodepool.Encode(nodepool.OpBorrow, 0, 2, 0, 0, 0, []uint64{1}), nodepool.Encode(nodepool.OpBorrow|nodepool.ReplyBit, nodepool.CodeGone, 3, 1, 0, 0, nil), uint8(2))
	o := startOwner(f, nodepool.OwnerOptions{Granularity: pg})
	attached := uint64(0) // clients this target attached to o, the hostile ones and cl
	// NB: with an unlimited budget an alloc that waits is served at once, so no
	// request outlives the connection by more than its own handling.
	f.Fuzz(func(t *testing.T, first, second []byte, repeat uint8) {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: o.Path(), Net: "unixpacket"})
		require.NoError(t, err)
		r := &raw{t: t, c: c}
		r.send(nodepool.Encode(nodepool.OpHello, 0, 1, nodepool.ProtocolVersion, 0, 0, nil))
		attached++ // the hello is valid: the owner attaches the peer, if only after the close
		for range repeat % 4 {
			for _, p := range [][]byte{first, second} {
				if len(p) == 0 || len(p) > 4*nodepool.MaxMsg {
					continue
				}
				if _, _, err := c.WriteMsgUnix(p, nil, nil); err != nil {
					break // the owner closed the connection
				}
			}
		}
		require.NoError(t, c.Close())
		// NB: not "until no client is listed": the owner may not have read the
		// hello yet, and list the peer later (corpus entry 2694a844a6e9a086).
		awaitDetached(t, o, attached)
		settle(t, o, 0)
		require.Zero(t, o.Governor().Stats(accounting.HostKey).Used, "the node's used bytes")
		cl, err := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
		require.NoError(t, err)
		attached++
		res, err := cl.Reserve(pg)
		require.NoError(t, err)
		require.NoError(t, cl.Commit(res, 0, pg))
		require.True(t, cl.Unreserve(res).OK())
		require.NoError(t, cl.Close())
	})
}
