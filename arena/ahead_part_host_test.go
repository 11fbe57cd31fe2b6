//go:build linux || windows

package arena_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
)

// onHost runs a generic Buffer test on host.Private (ByBuffer) and host.Shared
// (ByBacking), then checks that each gave everything back.
func onHost(t *testing.T, private bufferTest[*host.PrivateReservation, *host.Private], shared bufferTest[*host.SharedReservation, *host.Shared]) {
	t.Run("Private", func(t *testing.T) {
		p, err := host.NewPrivate(host.PrivateOptions{Granularity: g})
		require.NoError(t, err)
		a := accounting.NewGovernor().Authority("buf", accounting.HostKey)
		private(t, p, a, a)
		assert.Zero(t, a.Stats().Owned, "ledger does not balance")
	})
	t.Run("Shared", func(t *testing.T) {
		pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
		mem, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: pool})
		require.NoError(t, err)
		shared(t, mem, nil, pool)
		require.NoError(t, mem.Close())
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
	})
}

func TestBufferAdoptAheadInPartHost(t *testing.T) {
	onHost(t, testAdoptAheadInPart[*host.PrivateReservation, *host.Private], testAdoptAheadInPart[*host.SharedReservation, *host.Shared])
}
