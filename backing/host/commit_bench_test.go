//go:build linux || windows

package host_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
)

// BenchmarkGranuleCommit measures one commit and one decommit of a 2 MiB granule on
// each host backing the same way on every system that has both, so that the two can
// be compared where only a run under Wine is to be had:
//
//   - backing=private: host.Private (mprotect, MADV_DONTNEED; on Windows
//     VirtualAlloc MEM_COMMIT, VirtualFree MEM_DECOMMIT);
//   - backing=shared: host.Shared with a granule idle in its pool (on Linux moved out
//     of the park and back; on Windows a section mapped into the placeholder with
//     MapViewOfFile3 and unmapped again, placeholders split and joined);
//   - touch=true: the same, with a write to every 4 KiB page in between, which is
//     what a granule costs when it is used.
func BenchmarkGranuleCommit(b *testing.B) {
	const g = 2 << 20
	for _, kind := range []string{"private", "shared"} {
		for _, touch := range []bool{false, true} {
			name := "backing=" + kind + "/touch=false"
			if touch {
				name = "backing=" + kind + "/touch=true"
			}
			b.Run(name, func(b *testing.B) {
				var commit, decommit func(off int) error
				var base uintptr
				switch kind {
				case "private":
					p, err := host.NewPrivate(host.PrivateOptions{Granularity: g})
					require.NoError(b, err)
					r, err := p.Reserve(benchGranules * g)
					require.NoError(b, err)
					b.Cleanup(func() { require.True(b, p.Unreserve(r).OK()) })
					base = p.Base(r)
					commit = func(off int) error { return p.Commit(r, off, g) }
					decommit = func(off int) error { return p.Decommit(r, off, g) }
				case "shared":
					auth := accounting.NewGovernor().Authority("bench", accounting.HostKey)
					s, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: auth, High: 2, Decay: host.SharedNoDecay})
					require.NoError(b, err)
					r, err := s.Reserve(benchGranules * g)
					require.NoError(b, err)
					b.Cleanup(func() {
						require.True(b, s.Unreserve(r).OK())
						require.NoError(b, s.Close())
					})
					base = s.Base(r)
					commit = func(off int) error { return s.Commit(r, off, g) }
					decommit = func(off int) error { return s.Decommit(r, off, g) }
					// The pool's first granule, made before the clock runs.
					require.NoError(b, commit(0))
					require.NoError(b, decommit(0))
				}
				b.SetBytes(g)
				i := 0
				for b.Loop() {
					off := (i % benchGranules) * g
					i++
					if err := commit(off); err != nil {
						b.Fatal(err)
					}
					if touch {
						mem := host.PrivateBytes(base+uintptr(off), g)
						for k := 0; k < g; k += 4096 {
							mem[k]++
						}
					}
					if err := decommit(off); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "us/granule")
			})
		}
	}
}
