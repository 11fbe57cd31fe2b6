//go:build linux || windows

package arena_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

func TestBufferWindowHost(t *testing.T) {
	t.Run("Private", func(t *testing.T) {
		p, err := host.NewPrivate(host.PrivateOptions{Granularity: g})
		require.NoError(t, err)
		a := accounting.NewGovernor().Authority("buf", accounting.HostKey)
		testDecommitBelow(t, windowEnv[*host.PrivateReservation, *host.Private]{b: p, auth: a, ledger: a})
		assert.Zero(t, a.Stats().Owned, "ledger does not balance")
	})
	t.Run("Shared", func(t *testing.T) {
		pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
		mem, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: pool})
		require.NoError(t, err)
		t.Cleanup(func() {
			assert.NoError(t, mem.Close())
			assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
		})
		e := windowEnv[*host.SharedReservation, *host.Shared]{b: mem, ledger: pool}
		t.Run("DecommitBelow", func(t *testing.T) { testDecommitBelow(t, e) })
		t.Run("ShareRange", func(t *testing.T) { testShareRange(t, e) })
	})
}

// TestBufferWindowHostFaults stores through host memory: below Start the range is
// Reserved again and a store faults, in the buffer that gave it back and in one that
// shares the window's middle.
func TestBufferWindowHostFaults(t *testing.T) {
	pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
	mem, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: pool})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, mem.Close()) })
	seq, err := arena.NewBuffer(mem, 8*g, nil)
	require.NoError(t, err)
	defer seq.Close()
	require.NoError(t, seq.Resize(4*g))
	assert.NoError(t, testutil.Touch(seq.Base()+g, true), "committed: the store lands")
	require.NoError(t, seq.DecommitBelow(2*g))
	assert.Error(t, testutil.Touch(seq.Base()+g, true), "below Start the store faults")
	assert.NoError(t, testutil.Touch(seq.Base()+2*g, true), "the window stays writable")
	assert.Equal(t, byte(1), seq.Bytes()[2*g])

	fork, err := arena.NewBuffer(mem, 8*g, nil)
	require.NoError(t, err)
	defer fork.Close()
	require.NoError(t, fork.ShareRange(seq, 2*g, 2*g, 2*g, backing.ReadWrite))
	assert.Equal(t, byte(1), fork.Bytes()[2*g], "the fork reads the window's bytes at the same offset")
	assert.Error(t, testutil.Touch(fork.Base()+g, true), "below the shared range the fork faults")
	assert.NoError(t, testutil.Touch(fork.Base()+3*g, true))
	assert.Equal(t, byte(1), seq.Bytes()[3*g], "a read-write share writes the same granule")
}
