package hosttier_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// BenchmarkColdStore stores a 2 MiB block into granules the tier has just given back
// to the OS (Delete and Trim, the timer stopped): a store's first use of its memory,
// where the pages are made (faulted in, or populated), against BenchmarkBlock's
// stores into resident granules. granule=64KiB is the default (small pages);
// granule=2MiB may take huge pages where the system gives them.
func BenchmarkColdStore(b *testing.B) {
	for _, g := range []struct {
		name string
		size int
	}{{"64KiB", 64 << 10}, {"2MiB", block}} {
		b.Run("granule="+g.name, func(b *testing.B) {
			tr, err := hosttier.New(hosttier.Options{Budget: 4 * block, Granule: g.size})
			require.NoError(b, err)
			defer tr.Close()
			src := content(1, block)
			fill := func(dst []byte) error { copy(dst, src); return nil }
			b.SetBytes(block)
			for b.Loop() {
				b.StopTimer()
				testutil.NoError(b, tr.Delete(bg, key(0)))
				_, err := tr.Trim()
				testutil.NoError(b, err)
				b.StartTimer()
				testutil.NoError(b, tr.Store(bg, key(0), block, fill))
			}
		})
	}
}
