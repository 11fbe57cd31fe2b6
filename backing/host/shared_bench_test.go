//go:build linux

package host_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

const benchGranule = 2 << 20

func newBenchShared(b *testing.B, opts host.SharedOptions) *host.Shared {
	b.Helper()
	gov := accounting.NewGovernor()
	opts.Authority = gov.Authority("bench", accounting.HostKey)
	opts.Granularity = benchGranule
	s, err := host.NewShared(opts)
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, s.Close()) })
	return s
}

func benchReserve(b *testing.B, s *host.Shared, granules int) *host.SharedReservation {
	b.Helper()
	r, err := s.Reserve(granules * s.Granularity())
	require.NoError(b, err)
	b.Cleanup(func() { require.True(b, s.Unreserve(r).OK()) })
	return r
}

func reportGranule(b *testing.B) {
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "us/granule")
}

// sharedTouchPages writes one word per page.
func sharedTouchPages(words []uint64) {
	step := os.Getpagesize() / 8
	for i := 0; i < len(words); i += step {
		words[i]++
	}
}

// BenchmarkSharedCommit measures one commit and one decommit of a 2 MiB granule:
//   - new: a granule created for the commit and populated (SharedOptions.Populate,
//     MADV_POPULATE_WRITE), given back to the OS on decommit (no pool);
//   - pooled: a resident granule from the pool, moved out of the park with its page
//     tables and back (two mremaps and an mmap);
//   - pooled+touch: the same, plus a write to every page, which finds every page
//     table entry in place;
//   - pooled+touch+nopark: the same with granules mapped afresh instead of moved, as
//     on kernels before 5.13: the writes take a minor fault per page;
//   - granules=24/kind=pooled: a commit and a decommit of 24 pooled granules at once,
//     a KV sequence's worth, which move as one run each way (us/granule per granule);
//   - rewrite: the write to every page alone, of a granule that stays committed: the
//     floor of pooled+touch;
//   - floor: anonymous memory, mprotect RW + MADV_POPULATE_WRITE, then
//     MADV_DONTNEED + mprotect NONE: what a private backing pays per granule.
func BenchmarkSharedCommit(b *testing.B) {
	g := benchGranule
	b.Run("granule=2MiB/kind=new", func(b *testing.B) {
		s := newBenchShared(b, host.SharedOptions{High: host.SharedNoPool, Populate: true})
		r := benchReserve(b, s, 1)
		b.SetBytes(int64(g))
		for b.Loop() {
			if err := s.Commit(r, 0, g); err != nil {
				b.Fatal(err)
			}
			if err := s.Decommit(r, 0, g); err != nil {
				b.Fatal(err)
			}
		}
		reportGranule(b)
	})
	for _, kind := range []string{"pooled", "pooled+touch", "pooled+touch+nopark"} {
		b.Run("granule=2MiB/kind="+kind, func(b *testing.B) {
			touched := kind != "pooled"
			if kind == "pooled+touch+nopark" {
				old := host.SetSharedNoMove(true)
				defer host.SetSharedNoMove(old)
			}
			s := newBenchShared(b, host.SharedOptions{})
			require.NoError(b, s.Prefill(1))
			r := benchReserve(b, s, 1)
			b.SetBytes(int64(g))
			for b.Loop() {
				if err := s.Commit(r, 0, g); err != nil {
					b.Fatal(err)
				}
				if touched {
					sharedTouchPages(host.SharedWords(r, 0, g))
				}
				if err := s.Decommit(r, 0, g); err != nil {
					b.Fatal(err)
				}
			}
			reportGranule(b)
		})
	}
	b.Run("granule=2MiB/granules=24/kind=pooled", func(b *testing.B) {
		const n = 24
		s := newBenchShared(b, host.SharedOptions{High: n})
		require.NoError(b, s.Prefill(n))
		r := benchReserve(b, s, n)
		b.SetBytes(int64(n * g))
		for b.Loop() {
			if err := s.Commit(r, 0, n*g); err != nil {
				b.Fatal(err)
			}
			if err := s.Decommit(r, 0, n*g); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n/1e3, "us/granule")
	})
	b.Run("granule=2MiB/kind=rewrite", func(b *testing.B) {
		s := newBenchShared(b, host.SharedOptions{})
		r := benchReserve(b, s, 1)
		require.NoError(b, s.Commit(r, 0, g))
		require.NoError(b, s.Populate(r, 0, g))
		words := host.SharedWords(r, 0, g)
		b.SetBytes(int64(g))
		for b.Loop() {
			sharedTouchPages(words)
		}
		reportGranule(b)
		b.StopTimer()
		require.NoError(b, s.Decommit(r, 0, g))
	})
	b.Run("granule=2MiB/kind=floor", func(b *testing.B) {
		mem, err := unix.Mmap(-1, 0, g, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
		require.NoError(b, err)
		b.Cleanup(func() { require.NoError(b, unix.Munmap(mem)) })
		b.SetBytes(int64(g))
		floorCycles(b, mem)
		reportGranule(b)
	})
}

// BenchmarkSharedCommitOnly times the commit of a pooled resident granule alone:
// granules are committed one after another into a 64-granule reservation (each next
// to the last, so the kernel merges the mappings) and decommitted, untimed, when it
// is full.
func BenchmarkSharedCommitOnly(b *testing.B) {
	const n = 64
	g := benchGranule
	b.Run("granule=2MiB/kind=pooled", func(b *testing.B) {
		s := newBenchShared(b, host.SharedOptions{High: n})
		require.NoError(b, s.Prefill(n))
		r := benchReserve(b, s, n)
		b.SetBytes(int64(g))
		i := 0
		for b.Loop() {
			if i == n {
				b.StopTimer()
				require.NoError(b, s.Decommit(r, 0, n*g))
				i = 0
				b.StartTimer()
			}
			if err := s.Commit(r, i*g, g); err != nil {
				b.Fatal(err)
			}
			i++
		}
		reportGranule(b)
		b.StopTimer()
		require.NoError(b, s.Decommit(r, 0, i*g))
	})
}

// BenchmarkSharedShare compares the two ways a sequence can start with a 2 MiB
// prefix that another sequence holds:
//   - map+read: Share the granule read-only and read all of it once (the minor
//     faults of a first read through a new mapping), then decommit;
//   - map: Share and decommit only;
//   - copy: copy the 2 MiB into a resident granule of the sequence's own.
//
// owned-B/seq is the physical memory each sequence adds: none when it maps.
func BenchmarkSharedShare(b *testing.B) {
	g := benchGranule
	setup := func(b *testing.B) (*host.Shared, *host.SharedReservation, *host.SharedReservation) {
		s := newBenchShared(b, host.SharedOptions{})
		src := benchReserve(b, s, 1)
		dst := benchReserve(b, s, 1)
		require.NoError(b, s.Commit(src, 0, g))
		require.NoError(b, s.Populate(src, 0, g))
		words := host.SharedWords(src, 0, g)
		for i := range words {
			words[i] = uint64(i)
		}
		return s, src, dst
	}
	for _, read := range []bool{true, false} {
		name := "granule=2MiB/kind=map"
		if read {
			name += "+read"
		}
		b.Run(name, func(b *testing.B) {
			s, src, dst := setup(b)
			b.SetBytes(int64(g))
			for b.Loop() {
				if err := s.Share(dst, 0, src, 0, g, backing.ReadOnly); err != nil {
					b.Fatal(err)
				}
				if read {
					var sum uint64
					for _, w := range host.SharedWords(dst, 0, g) {
						sum += w
					}
					sharedSink += sum
				}
				if err := s.Decommit(dst, 0, g); err != nil {
					b.Fatal(err)
				}
			}
			reportGranule(b)
			b.ReportMetric(0, "owned-B/seq")
		})
	}
	b.Run("granule=2MiB/kind=copy", func(b *testing.B) {
		s, src, dst := setup(b)
		require.NoError(b, s.Commit(dst, 0, g))
		require.NoError(b, s.Populate(dst, 0, g))
		from, to := host.SharedWords(src, 0, g), host.SharedWords(dst, 0, g)
		b.SetBytes(int64(g))
		for b.Loop() {
			copy(to, from)
		}
		reportGranule(b)
		b.ReportMetric(float64(g), "owned-B/seq")
		b.StopTimer()
		require.NoError(b, s.Decommit(dst, 0, g))
	})
}

// sharedSink keeps the reads of map+read from being optimized away.
var sharedSink uint64

// floorCycles commits, populates and decommits mem, one granule of private
// anonymous memory, by raw system calls, b.N times: the floor the backings'
// commit-populate-decommit cycles are measured against.
func floorCycles(b *testing.B, mem []byte) {
	for b.Loop() {
		if err := unix.Mprotect(mem, unix.PROT_READ|unix.PROT_WRITE); err != nil {
			b.Fatal(err)
		}
		if err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE); err != nil {
			b.Fatal(err)
		}
		if err := unix.Madvise(mem, unix.MADV_DONTNEED); err != nil {
			b.Fatal(err)
		}
		if err := unix.Mprotect(mem, unix.PROT_NONE); err != nil {
			b.Fatal(err)
		}
	}
}
