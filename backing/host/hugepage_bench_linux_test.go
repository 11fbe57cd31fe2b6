package host_test

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

// BenchmarkNewGranule measures a new 2 MiB granule, commit + first write of every
// page + decommit, against the floors of the same run:
//
//   - floor=anon4k: anonymous memory with small pages (MADV_NOHUGEPAGE): mprotect RW
//   - MADV_POPULATE_WRITE, then MADV_DONTNEED + mprotect NONE;
//   - floor=anonTHP: the same, 2 MiB-aligned with MADV_HUGEPAGE (one huge page);
//   - floor=memfd: fallocate + mmap MAP_SHARED|MAP_FIXED + populate, then a
//     reserved mapping over it + fallocate PUNCH_HOLE;
//   - via=private, private/nohuge: a Private backing (THP on, off);
//   - via=shared: a Shared backing with no pool (every granule new: private huge
//     pages where the system gives shmem none); shared/small: private granules of
//     small pages (NoHugePages, the default on a guest that reports free memory to
//     its host), faulted in by the touch, and shared/small/populate, populated on
//     commit; shared/memfd: memfd granules (NoPrivateGranules, NoHugePages),
//     populated on commit, the best memfd path;
//   - via=shared/pooled: a Shared backing with its default pool: the granule goes
//     idle and comes back with its pages (what a busy server pays).
func BenchmarkNewGranule(b *testing.B) {
	const g = 2 << 20
	touch := func(mem []byte) {
		for i := 0; i < len(mem); i += 4096 {
			mem[i] = 1
		}
	}
	floor := func(advice int) func(b *testing.B) {
		return func(b *testing.B) {
			base, err := host.PrivateRawReserve(g, g)
			require.NoError(b, err)
			b.Cleanup(func() { require.NoError(b, host.PrivateRawRelease(base, g)) })
			mem := host.PrivateBytes(base, g)
			require.NoError(b, unix.Madvise(mem, advice))
			b.SetBytes(g)
			floorCycles(b, mem)
			reportGranule(b)
		}
	}
	b.Run("granule=2MiB/floor=anon4k", floor(unix.MADV_NOHUGEPAGE))
	b.Run("granule=2MiB/floor=anonTHP", floor(unix.MADV_HUGEPAGE))
	b.Run("granule=2MiB/floor=memfd", func(b *testing.B) {
		fd, err := unix.MemfdCreate("bench", unix.MFD_CLOEXEC)
		require.NoError(b, err)
		b.Cleanup(func() { unix.Close(fd) })
		require.NoError(b, unix.Ftruncate(fd, g))
		base, err := host.PrivateRawReserve(g, g)
		require.NoError(b, err)
		b.Cleanup(func() { require.NoError(b, host.PrivateRawRelease(base, g)) })
		at := unsafe.Pointer(&host.PrivateBytes(base, g)[0])
		b.SetBytes(g)
		for b.Loop() {
			if err := unix.Fallocate(fd, 0, 0, g); err != nil {
				b.Fatal(err)
			}
			if _, err := unix.MmapPtr(fd, 0, at, g, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
				b.Fatal(err)
			}
			if err := unix.Madvise(host.PrivateBytes(base, g), unix.MADV_POPULATE_WRITE); err != nil {
				b.Fatal(err)
			}
			if _, err := unix.MmapPtr(-1, 0, at, g, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED); err != nil {
				b.Fatal(err)
			}
			if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, g); err != nil {
				b.Fatal(err)
			}
		}
		reportGranule(b)
	})
	for _, nohuge := range []bool{false, true} {
		name := "granule=2MiB/via=private"
		if nohuge {
			name += "/nohuge"
		}
		b.Run(name, func(b *testing.B) {
			p, err := host.NewPrivate(host.PrivateOptions{Granularity: g, NoHugePages: nohuge, AlwaysHugePages: !nohuge})
			require.NoError(b, err)
			r, err := p.Reserve(g)
			require.NoError(b, err)
			b.Cleanup(func() { p.Unreserve(r) })
			mem := host.PrivateBytes(p.Base(r), g)
			b.SetBytes(g)
			for b.Loop() {
				if err := p.Commit(r, 0, g); err != nil {
					b.Fatal(err)
				}
				touch(mem)
				if err := p.Decommit(r, 0, g); err != nil {
					b.Fatal(err)
				}
			}
			reportGranule(b)
		})
	}
	for _, kind := range []string{"shared", "shared/small", "shared/small/populate", "shared/memfd", "shared/pooled"} {
		b.Run("granule=2MiB/via="+kind, func(b *testing.B) {
			opts := host.SharedOptions{High: host.SharedNoPool, AlwaysHugePages: true}
			switch kind {
			case "shared/small":
				opts.NoHugePages, opts.AlwaysHugePages = true, false
			case "shared/small/populate":
				opts.NoHugePages, opts.AlwaysHugePages, opts.Populate = true, false, true
			case "shared/memfd":
				opts.NoPrivateGranules, opts.NoHugePages, opts.AlwaysHugePages, opts.Populate = true, true, false, true
			case "shared/pooled":
				opts.High = 0
			}
			s := newBenchShared(b, opts)
			st := s.Stats()
			b.Logf("huge pages: %q (%s); private granules: %v (%s)", st.HugePages, st.NoHugePages, st.PrivateGranules, st.NoPrivateGranules)
			r := benchReserve(b, s, 1)
			b.SetBytes(g)
			for b.Loop() {
				if err := s.Commit(r, 0, g); err != nil {
					b.Fatal(err)
				}
				touch(unsafe.Slice((*byte)(unsafe.Pointer(&host.SharedWords(r, 0, g)[0])), g))
				if err := s.Decommit(r, 0, g); err != nil {
					b.Fatal(err)
				}
			}
			reportGranule(b)
		})
	}
}

// BenchmarkSharedShareNew measures a new granule that becomes shared: commit, write
// every page, Share it into a second reservation, decommit both, with no pool (every
// granule new). With private granules (kind=private: huge pages; small: small
// pages) the Share copies the granule into a new memfd granule; with memfd the
// granule is a memfd granule from the start.
func BenchmarkSharedShareNew(b *testing.B) {
	const g = 2 << 20
	for _, kind := range []string{"private", "small", "memfd"} {
		b.Run("granule=2MiB/kind="+kind, func(b *testing.B) {
			opts := host.SharedOptions{High: host.SharedNoPool, AlwaysHugePages: true}
			switch kind {
			case "small":
				opts.NoHugePages, opts.AlwaysHugePages = true, false
			case "memfd":
				opts.NoPrivateGranules, opts.NoHugePages, opts.AlwaysHugePages, opts.Populate = true, true, false, true
			}
			s := newBenchShared(b, opts)
			x := benchReserve(b, s, 1)
			y := benchReserve(b, s, 1)
			b.SetBytes(g)
			for b.Loop() {
				if err := s.Commit(x, 0, g); err != nil {
					b.Fatal(err)
				}
				words := host.SharedWords(x, 0, g)
				for i := 0; i < len(words); i += 512 {
					words[i] = uint64(i)
				}
				if err := s.Share(y, 0, x, 0, g, backing.ReadOnly); err != nil {
					b.Fatal(err)
				}
				if err := s.Decommit(y, 0, g); err != nil {
					b.Fatal(err)
				}
				if err := s.Decommit(x, 0, g); err != nil {
					b.Fatal(err)
				}
			}
			reportGranule(b)
		})
	}
}
