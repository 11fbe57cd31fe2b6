package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// fx is a Backing on a fake driver, with what the tests look at.
type fx struct {
	b    *cuda.Backing
	f    *cudatest.FakeDriver
	auth *accounting.Authority
	g    int
}

// newFx returns a Backing on a fresh fake driver (no cleanup). A nil o.Authority gets
// a fresh unlimited governor.
func newFx(t testing.TB, fo cudatest.FakeDriverOptions, o cuda.Options) *fx {
	t.Helper()
	f := cudatest.NewFakeDriver(fo)
	if o.Authority == nil {
		o.Authority = gpuAuthority(o.Device)
	}
	o.Driver = f.Driver()
	b, err := cuda.New(o)
	require.NoError(t, err)
	return &fx{b: b, f: f, auth: o.Authority, g: b.Granularity()}
}

// fakeBacking is newFx with a Cleanup that closes the backing and checks that neither
// the driver nor the ledger leaks.
func fakeBacking(t testing.TB, fo cudatest.FakeDriverOptions, o cuda.Options) *fx {
	t.Helper()
	x := newFx(t, fo, o)
	t.Cleanup(func() {
		require.NoError(t, x.b.Close())
		x.checkClosed(t)
	})
	return x
}

// checkClosed asserts that nothing is left after Close.
func (x *fx) checkClosed(t testing.TB) {
	t.Helper()
	assert.NoError(t, x.f.CheckLeaks())
	s := x.auth.Stats()
	assert.Zero(t, s.Owned, "owned bytes after Close")
	assert.Zero(t, s.Mapped, "mapped bytes after Close")
}

// checkBooks asserts that the driver, the pool and the ledger agree: every handle the
// driver holds is owned by the pool and charged once; every mapping is attributed.
func (x *fx) checkBooks(t testing.TB, what string) {
	t.Helper()
	s := x.b.PoolStats()
	g := int64(x.g)
	as := x.auth.Stats()
	assert.Equal(t, s.Owned, as.Owned, "%s: pool owned vs ledger", what)
	assert.Equal(t, s.Mapped, as.Mapped, "%s: pool mapped vs ledger", what)
	assert.Equal(t, s.Owned/g, int64(x.f.UnreleasedHandles()), "%s: pool handles vs driver", what)
	assert.Equal(t, s.Owned, x.f.UsedMemory(0), "%s: pool owned vs driver memory", what)
	assert.Equal(t, s.Mapped/g, int64(x.f.LiveMappings()), "%s: pool mappings vs driver", what)
	assert.LessOrEqual(t, s.Idle+s.Mapped, s.Owned+s.Mapped, "%s", what)
}

func gpuAuthority(dev int) *accounting.Authority {
	return accounting.NewGovernor().Authority("test", accounting.GPU(dev))
}

func TestConformance(t *testing.T) {
	for _, tt := range []struct {
		name string
		fo   cudatest.FakeDriverOptions
		o    cuda.Options
	}{
		{"pool=none", cudatest.FakeDriverOptions{}, cuda.Options{}},
		{"pool=low2high4", cudatest.FakeDriverOptions{}, cuda.Options{Low: 2, High: 4}},
		{"granule=64KiB", cudatest.FakeDriverOptions{Granularity: 64 << 10}, cuda.Options{}},
		{"recommended=4MiB", cudatest.FakeDriverOptions{Recommended: 4 << 20}, cuda.Options{}},
		{"device=1", cudatest.FakeDriverOptions{Devices: 2}, cuda.Options{Device: 1}},
		{"no-read-only", cudatest.FakeDriverOptions{NoReadOnly: true}, cuda.Options{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			backingtest.Run(t, func(t *testing.T) backing.Backing[*cuda.Reservation] {
				return fakeBacking(t, tt.fo, tt.o).b
			})
		})
	}
}

// The conformance suite through the fault-injecting wrapper with no faults: the
// wrapper must be transparent, capabilities included.
func TestConformanceFaultyWrapper(t *testing.T) {
	backingtest.Run(t, func(t *testing.T) backing.Backing[*cuda.Reservation] {
		return backingtest.NewFaulty[*cuda.Reservation](fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{}).b)
	})
}

// FuzzBacking drives random operation sequences against the backing on the fake
// driver and the suite's model of what it must hold; the seed corpus runs in plain
// `go test`.
func FuzzBacking(f *testing.F) {
	for _, s := range backingtest.SeedOps() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{Granularity: 64 << 10}, cuda.Options{High: 4})
		backingtest.RunOps(t, x.b, ops)
		x.checkBooks(t, "after the sequence")
	})
}
