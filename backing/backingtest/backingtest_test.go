package backingtest_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
)

// newFake returns a factory of fakes that checks, when each property ends, that the
// suite left no reservation or granule behind and that the authority owns nothing.
func newFake(opts backingtest.FakeOptions, byBacking bool) func(t *testing.T) *backingtest.Fake {
	return func(t *testing.T) *backingtest.Fake {
		o := opts
		if byBacking {
			o.Authority = accounting.NewGovernor().Authority("fake", o.Device)
		}
		f := backingtest.NewFake(o)
		t.Cleanup(func() {
			assert.Zero(t, f.LiveReservations(), "reservations left behind")
			assert.Zero(t, f.LiveGranules(), "granules left behind")
			if o.Authority != nil {
				assert.Zero(t, o.Authority.Stats().Owned, "owned bytes left behind")
				assert.Zero(t, o.Authority.Stats().Mapped, "mapped bytes left behind")
				assert.Equal(t, accounting.Unlimited, o.Authority.Governor().Limit(o.Device), "the suite restores the limit")
			}
		})
		return f
	}
}

func TestRunFake(t *testing.T) {
	for _, tt := range []struct {
		name      string
		opts      backingtest.FakeOptions
		byBacking bool
	}{
		{"ByBuffer", backingtest.FakeOptions{}, false},
		{"ByBacking", backingtest.FakeOptions{}, true},
		{"ByBacking/wait", backingtest.FakeOptions{Wait: true}, true},
		{"ByBuffer/wait", backingtest.FakeOptions{Wait: true}, false},
		{"ByBacking/granule=2MiB/device", backingtest.FakeOptions{Granularity: 2 << 20, Device: accounting.GPU(0)}, true},
		{"ByBuffer/granule=4KiB", backingtest.FakeOptions{Granularity: 4 << 10}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			mk := newFake(tt.opts, tt.byBacking)
			backingtest.Run(t, func(t *testing.T) backing.Backing[*backingtest.FakeReservation] { return mk(t) })
		})
	}
}

func TestRunFaultyNoFaults(t *testing.T) {
	for _, byBacking := range []bool{false, true} {
		name := "ByBuffer"
		if byBacking {
			name = "ByBacking"
		}
		t.Run(name, func(t *testing.T) {
			mk := newFake(backingtest.FakeOptions{Wait: true}, byBacking)
			backingtest.Run(t, func(t *testing.T) backing.Backing[*backingtest.FakeReservation] {
				return backingtest.NewFaulty[*backingtest.FakeReservation](mk(t))
			})
		})
	}
}
