package host_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
)

// BenchmarkSharedGranuleSize measures what a smaller granule costs host.Shared per
// byte: each iteration commits 2 MiB as granules of the size named (one 2 MiB granule,
// 32 of 64 KiB, 512 of 4 KiB) from the pool, writes every 4 KiB page of it (the page
// faults that build its page tables), and decommits it again. A smaller granule
// shares a model's tokens in smaller blocks (docs/benchmarks/sizing.md); this is its
// price on the commit path.
func BenchmarkSharedGranuleSize(b *testing.B) {
	const span = 2 << 20
	for _, g := range []int{2 << 20, 64 << 10, 4 << 10} {
		b.Run(fmt.Sprintf("granule=%dKiB", g>>10), func(b *testing.B) {
			auth := accounting.NewGovernor().Authority("bench", accounting.HostKey)
			s, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: auth, High: span / g, Decay: host.SharedNoDecay})
			require.NoError(b, err)
			r, err := s.Reserve(span)
			require.NoError(b, err)
			b.Cleanup(func() {
				require.True(b, s.Unreserve(r).OK())
				require.NoError(b, s.Close())
			})
			base := s.Base(r)
			// The pool's granules, made before the clock runs.
			require.NoError(b, s.Commit(r, 0, span))
			require.NoError(b, s.Decommit(r, 0, span))
			b.SetBytes(span)
			for b.Loop() {
				for off := 0; off < span; off += g {
					if err := s.Commit(r, off, g); err != nil {
						b.Fatal(err)
					}
				}
				mem := host.PrivateBytes(base, span)
				for k := 0; k < span; k += 4096 {
					mem[k]++
				}
				for off := 0; off < span; off += g {
					if err := s.Decommit(r, off, g); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
