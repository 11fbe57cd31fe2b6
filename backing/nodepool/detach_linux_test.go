package nodepool_test

import (
	"net"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
)

// awaitDetached waits until the owner has detached n clients in all, and checks
// that it lists none. NB: "no client listed" alone proves nothing about a peer
// that has just hung up: the owner reads its hello on a goroutine of its own,
// possibly after the hang-up, and lists it only then. Every peer whose hello
// the owner accepted is detached exactly once, so the count is what to wait for.
func awaitDetached(t testing.TB, o *nodepool.Owner, n uint64) {
	t.Helper()
	testutil.Await(func() bool { return o.Stats().Detached >= n })
	s := o.Stats()
	require.Equal(t, n, s.Detached, "clients the owner detached")
	require.Empty(t, s.Clients, "clients the owner still lists")
}

// TestHungUpPeerDetached has a peer send its hello and more, then hang up, all
// before the owner's goroutines run (one P, and the peer never blocks): the owner
// attaches it only after the hang-up, and must detach it and hold nothing for it.
// This is the interleaving in which FuzzHostile once saw an empty client list
// before the owner had read the hello, then the peer listed (corpus entry
// 2694a844a6e9a086).
func TestHungUpPeerDetached(t *testing.T) {
	short := []byte("\x18\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00" +
		"\x00\x00\x00\x00\x00\x00\xff\xff\xff\x7f\x00\x00\x00\x00\x00\x00\x00\x00")
	tests := []struct {
		name    string
		records [][]byte
	}{
		{"hello only", nil},
		{"short records", [][]byte{short, {0x18}, short, {0x18}}},
		{"alloc then garbage", [][]byte{nodepool.Encode(nodepool.OpAlloc, 0, 2, 3, 0, 0, nil), {1, 2, 3}}},
		{"waiting alloc", [][]byte{nodepool.Encode(nodepool.OpAlloc, 0, 2, 1, ^uint64(0), 0, nil)}},
		{"stats unread", [][]byte{nodepool.Encode(nodepool.OpStats, 0, 2, 0, 0, 0, nil)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := startOwner(t, nodepool.OwnerOptions{Granularity: pg})
			// NB: from here to the first look at the owner's figures (in
			// awaitDetached) this goroutine never blocks, and it holds the only P.
			prev := runtime.GOMAXPROCS(1)
			t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
			c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: o.Path(), Net: "unixpacket"})
			require.NoError(t, err)
			_, _, err = c.WriteMsgUnix(nodepool.Encode(nodepool.OpHello, 0, 1, nodepool.ProtocolVersion, 0, 0, nil), nil, nil)
			require.NoError(t, err)
			for _, p := range tt.records {
				if _, _, err := c.WriteMsgUnix(p, nil, nil); err != nil {
					break // the owner closed the connection
				}
			}
			require.NoError(t, c.Close())
			awaitDetached(t, o, 1)
			settle(t, o, 0)
			require.Zero(t, o.Governor().Stats(accounting.HostKey).Used, "the node's used bytes")
		})
	}
}
