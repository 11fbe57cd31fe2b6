package host_test

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing/host"
)

// BenchmarkMoveBesidePopulate measures what a commit of a pooled granule costs (a
// 2 MiB mremap, as host.Shared moves a granule out of its park) while another thread
// populates fresh 2 MiB granules with MADV_POPULATE_WRITE, as a prefill beside the
// token path does: beside=none alone, beside=whole one populate per granule,
// beside=pieces in pieces of host.SharedPopulatePiece (what Prefill does). The
// populate holds the mmap lock that the move needs for writing. It reports the
// move's median and p99 (move-p50-ns, move-p99-ns) and what populating a granule
// took the other thread (populate-ns/granule, the price of the pieces): compare them
// within one run.
func BenchmarkMoveBesidePopulate(b *testing.B) {
	const g = 2 << 20
	for _, beside := range []struct {
		name  string
		piece int
	}{{"none", 0}, {"whole", g}, {"pieces", host.SharedPopulatePiece}} {
		b.Run("beside="+beside.name, func(b *testing.B) {
			var stop atomic.Bool
			var wg sync.WaitGroup
			var populated int
			var populating time.Duration
			if beside.piece > 0 {
				pop, err := unix.Mmap(-1, 0, 16*g, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
				require.NoError(b, err)
				defer unix.Munmap(pop)
				require.NoError(b, unix.Madvise(pop, unix.MADV_NOHUGEPAGE))
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; !stop.Load(); i = (i + 1) % 16 {
						gr := pop[i*g : (i+1)*g]
						t0 := time.Now()
						for off := 0; off < g; off += beside.piece {
							if err := unix.Madvise(gr[off:off+beside.piece], unix.MADV_POPULATE_WRITE); err != nil {
								panic(fmt.Sprintf("populate: %v", err))
							}
						}
						populating += time.Since(t0)
						populated++
						if err := unix.Madvise(gr, unix.MADV_DONTNEED); err != nil {
							panic(fmt.Sprintf("dontneed: %v", err))
						}
					}
				}()
			}
			m, err := unix.Mmap(-1, 0, 2*g, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			require.NoError(b, err)
			defer unix.Munmap(m)
			require.NoError(b, unix.Madvise(m, unix.MADV_NOHUGEPAGE))
			require.NoError(b, unix.Madvise(m[:g], unix.MADV_POPULATE_WRITE))
			at, to := unsafe.Pointer(&m[0]), unsafe.Pointer(&m[g])
			var moves []time.Duration
			for b.Loop() {
				t0 := time.Now()
				if _, err := unix.MremapPtr(at, g, to, g, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED|unix.MREMAP_DONTUNMAP); err != nil {
					b.Fatal(err)
				}
				moves = append(moves, time.Since(t0))
				at, to = to, at
				time.Sleep(20 * time.Microsecond) // a step's other work
			}
			stop.Store(true)
			wg.Wait()
			slices.Sort(moves)
			b.ReportMetric(float64(moves[len(moves)/2].Nanoseconds()), "move-p50-ns")
			b.ReportMetric(float64(moves[len(moves)*99/100].Nanoseconds()), "move-p99-ns")
			if populated > 0 {
				b.ReportMetric(float64(populating.Nanoseconds())/float64(populated), "populate-ns/granule")
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}
