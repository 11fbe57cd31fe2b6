package cuda_test

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/internal/testutil"
)

// BenchmarkExportImport hands committed granules from one Backing to another as
// descriptors, as a node pool would from its owner to a client: export (one
// descriptor per granule), import and map in the other Backing (one cuMemSetAccess
// for the run), close the descriptors; then the other Backing unmaps them (and
// releases its imported handles). Both Backings are in this process on one driver;
// between processes the descriptors also cross a socket. BenchmarkShare is the
// in-process mapping of one granule to compare with. The null driver has no
// export, so it is not run here.
func BenchmarkExportImport(b *testing.B) {
	for _, kind := range []string{"fake", "gpu"} {
		for _, n := range []int{1, 16} {
			b.Run(fmt.Sprintf("driver=%s/granules=%d", kind, n), func(b *testing.B) {
				d := benchDriver(b, kind)
				owner := gpuBacking(b, d, cuda.Options{Exportable: true})
				client := gpuBacking(b, d, cuda.Options{})
				g := owner.Granularity()
				src, err := owner.Reserve(n * g)
				testutil.NoError(b, err)
				defer owner.Unreserve(src)
				dst, err := client.Reserve(n * g)
				testutil.NoError(b, err)
				defer client.Unreserve(dst)
				testutil.NoError(b, owner.Commit(src, 0, n*g))
				b.ReportAllocs()
				lat := latencies{}
				for b.Loop() {
					var fds []int
					lat.time("export", func() {
						fds, err = owner.Export(src, 0, n*g)
						testutil.NoError(b, err)
					})
					lat.time("import", func() { testutil.NoError(b, client.Import(dst, 0, fds, backing.ReadOnly)) })
					for _, fd := range fds {
						testutil.NoError(b, unix.Close(fd))
					}
					lat.time("unimport", func() { testutil.NoError(b, client.Decommit(dst, 0, n*g)) })
				}
				lat.report(b)
			})
		}
	}
}
