//go:build linux || windows

package arena_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
)

func TestBufferLeaveBehindHost(t *testing.T) {
	t.Run("Private", func(t *testing.T) {
		p, err := host.NewPrivate(host.PrivateOptions{Granularity: g})
		require.NoError(t, err)
		a := accounting.NewGovernor().Authority("buf", accounting.HostKey)
		testLeaveBehind(t, p, a, a)
		assert.Zero(t, a.Stats().Owned, "ledger does not balance")
	})
	t.Run("Shared", func(t *testing.T) {
		pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
		mem, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: pool})
		require.NoError(t, err)
		testLeaveBehind(t, mem, nil, pool)
		require.NoError(t, mem.Close())
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
	})
}
