package host_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
)

func TestSharedConformance(t *testing.T) {
	for _, g := range []int{0, 64 << 10} {
		name := "granule=2MiB"
		if g != 0 {
			name = "granule=64KiB"
		}
		t.Run(name, func(t *testing.T) {
			backingtest.Run(t, func(t *testing.T) backing.Backing[*host.SharedReservation] {
				gov := accounting.NewGovernor()
				auth := gov.Authority("shared", accounting.HostKey)
				s, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: auth})
				require.NoError(t, err)
				t.Cleanup(func() {
					require.NoError(t, host.CheckShared(s))
					require.NoError(t, s.Close())
					st := auth.Stats()
					require.Zero(t, st.Owned)
					require.Zero(t, st.Mapped)
				})
				return s
			})
		})
	}
}
