package host_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/host"
)

// benchGranules is how many granules the benchmark reservation has; each iteration
// commits and decommits the next one, so that every commit splits a mapping as it
// does in a real buffer's middle.
const benchGranules = 16

// BenchmarkPrivateCommitDecommit measures one granule's commit and decommit:
//
//   - via=raw: the syscalls alone (mprotect RW; MADV_DONTNEED + mprotect NONE), the
//     floor;
//   - via=private: the same through *Private, with validation and the bitmap;
//   - via=private+touch: through *Private, writing one byte per page in between (what
//     a granule costs when it is used without populating);
//   - via=populate: through a Private with Populate (MADV_POPULATE_WRITE).
func BenchmarkPrivateCommitDecommit(b *testing.B) {
	for _, g := range []int{64 << 10, 2 << 20} {
		for _, via := range []string{"raw", "private", "private+touch", "populate"} {
			b.Run(fmt.Sprintf("granule=%s/via=%s", sizeName(g), via), func(b *testing.B) {
				p, err := host.NewPrivate(host.PrivateOptions{Granularity: g, Populate: via == "populate"})
				require.NoError(b, err)
				r, err := p.Reserve(benchGranules * g)
				require.NoError(b, err)
				defer p.Unreserve(r)
				base := p.Base(r)
				b.SetBytes(int64(g))
				i := 0
				for b.Loop() {
					off := (i % benchGranules) * g
					i++
					if via == "raw" {
						if err := host.PrivateRawCommit(base+uintptr(off), g); err != nil {
							b.Fatal(err)
						}
						if err := host.PrivateRawDecommit(base+uintptr(off), g); err != nil {
							b.Fatal(err)
						}
						continue
					}
					if err := p.Commit(r, off, g); err != nil {
						b.Fatal(err)
					}
					if via == "private+touch" {
						mem := host.PrivateBytes(base+uintptr(off), g)
						for k := 0; k < g; k += 4096 {
							mem[k] = 1
						}
					}
					if err := p.Decommit(r, off, g); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/(float64(g)/(1<<20)), "ns/MiB")
			})
		}
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}
