package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
)

// fakeBacking returns a Backing on a fresh fake driver, with a Cleanup that closes it
// and checks that neither the driver nor the ledger leaks.
func fakeBacking(t testing.TB, fo cuda.FakeDriverOptions, o cuda.Options) (*cuda.Backing, *cuda.FakeDriver, *accounting.Authority) {
	t.Helper()
	f := cuda.NewFakeDriver(fo)
	if o.Authority == nil {
		g := accounting.NewGovernor()
		o.Authority = g.Authority("cuda pool", accounting.GPU(o.Device))
	}
	o.Driver = f.Driver()
	b, err := cuda.New(o)
	require.NoError(t, err)
	auth := o.Authority
	t.Cleanup(func() {
		require.NoError(t, b.Close())
		require.NoError(t, f.CheckLeaks())
		s := auth.Stats()
		require.Zero(t, s.Owned, "owned bytes after Close")
		require.Zero(t, s.Mapped, "mapped bytes after Close")
	})
	return b, f, auth
}

func TestConformance(t *testing.T) {
	for _, tt := range []struct {
		name string
		fo   cuda.FakeDriverOptions
		o    cuda.Options
	}{
		{"pool=none", cuda.FakeDriverOptions{}, cuda.Options{}},
		{"pool=low2high4", cuda.FakeDriverOptions{}, cuda.Options{Low: 2, High: 4}},
		{"granule=64KiB", cuda.FakeDriverOptions{Granularity: 64 << 10}, cuda.Options{}},
		{"recommended=4MiB", cuda.FakeDriverOptions{Recommended: 4 << 20}, cuda.Options{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			backingtest.Run(t, func(t *testing.T) backing.Backing[*cuda.Reservation] {
				b, _, _ := fakeBacking(t, tt.fo, tt.o)
				return b
			})
		})
	}
}
