package nodepool_test

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/backing/nodepool"
)

const benchGranule = 2 << 20

// BenchmarkMapGranule compares mapping a granule of the node's memory with sharing
// one in-process, per 2 MiB granule (us/granule), in one run:
//   - kind=shared: host.Shared's Share of one committed granule into another
//     reservation, then Decommit: the in-process baseline;
//   - kind=node/owner=process/op=commit: a Client's Commit of one granule from an owner in
//     another process (the request, a new sealed memfd passed by SCM_RIGHTS, the
//     map), then Decommit (the unmap and the free, a second round trip);
//   - kind=node/owner=process/batch=16: the same for 16 granules at once, one
//     message each way per step;
//   - kind=node/owner=process/op=borrow: a Client's Borrow of a granule another
//     client committed and lent (the request, a read-only descriptor of the
//     existing memfd, the map), then Decommit: the issue's "mapping a granule
//     another process owns";
//   - kind=node/owner=inproc: the owner in this process, over the same socket.
//
// NB: the node's figure includes creating the granule (memfd_create, ftruncate,
// seals) and giving it back, where Share maps a granule that exists; mapping a
// granule another process already owns would skip the creation.
func BenchmarkMapGranule(b *testing.B) {
	b.Run("kind=shared", func(b *testing.B) {
		s, err := host.NewShared(host.SharedOptions{Granularity: benchGranule,
			Authority: accounting.NewGovernor().Authority("bench", accounting.HostKey)})
		require.NoError(b, err)
		defer s.Close()
		src, err := s.Reserve(benchGranule)
		require.NoError(b, err)
		dst, err := s.Reserve(benchGranule)
		require.NoError(b, err)
		require.NoError(b, s.Commit(src, 0, benchGranule))
		for b.Loop() {
			if err := s.Share(dst, 0, src, 0, benchGranule, backing.ReadOnly); err != nil {
				b.Fatal(err)
			}
			if err := s.Decommit(dst, 0, benchGranule); err != nil {
				b.Fatal(err)
			}
		}
		perGranule(b, 1)
		require.True(b, s.Unreserve(dst).OK())
		require.True(b, s.Unreserve(src).OK())
	})
	node := func(b *testing.B, path string, batch int) {
		// NB: no pool, so that every commit asks the owner for new granules.
		c, err := nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
		require.NoError(b, err)
		defer c.Close()
		r, err := c.Reserve(batch * benchGranule)
		require.NoError(b, err)
		for b.Loop() {
			if err := c.Commit(r, 0, batch*benchGranule); err != nil {
				b.Fatal(err)
			}
			if err := c.Decommit(r, 0, batch*benchGranule); err != nil {
				b.Fatal(err)
			}
		}
		perGranule(b, batch)
		require.True(b, c.Unreserve(r).OK())
	}
	borrow := func(b *testing.B, path string, batch int) {
		lender, err := nodepool.Attach(path, nodepool.ClientOptions{})
		require.NoError(b, err)
		defer lender.Close()
		c, err := nodepool.Attach(path, nodepool.ClientOptions{})
		require.NoError(b, err)
		defer c.Close()
		src, err := lender.Reserve(batch * benchGranule)
		require.NoError(b, err)
		require.NoError(b, lender.Commit(src, 0, batch*benchGranule))
		ids, err := lender.Lend(src, 0, batch*benchGranule, c.Number())
		require.NoError(b, err)
		r, err := c.Reserve(batch * benchGranule)
		require.NoError(b, err)
		for b.Loop() {
			if err := c.Borrow(r, 0, ids); err != nil {
				b.Fatal(err)
			}
			if err := c.Decommit(r, 0, batch*benchGranule); err != nil {
				b.Fatal(err)
			}
		}
		perGranule(b, batch)
		require.True(b, c.Unreserve(r).OK())
		require.True(b, lender.Unreserve(src).OK())
	}
	b.Run("kind=node/owner=process", func(b *testing.B) {
		path := sockPath(b)
		startHelper(b, "owner", path, true, helperGranuleEnv+"="+strconv.Itoa(benchGranule))
		b.Run("op=commit/batch=1", func(b *testing.B) { node(b, path, 1) })
		b.Run("op=commit/batch=16", func(b *testing.B) { node(b, path, 16) })
		b.Run("op=borrow/batch=1", func(b *testing.B) { borrow(b, path, 1) })
		b.Run("op=borrow/batch=16", func(b *testing.B) { borrow(b, path, 16) })
	})
	b.Run("kind=node/owner=inproc", func(b *testing.B) {
		o, err := nodepool.Listen(sockPath(b), nodepool.OwnerOptions{Granularity: benchGranule})
		require.NoError(b, err)
		defer o.Close()
		b.Run("op=commit/batch=1", func(b *testing.B) { node(b, o.Path(), 1) })
	})
}

func perGranule(b *testing.B, n int) {
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n)/1e3, "us/granule")
}
