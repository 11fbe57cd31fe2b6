package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestShareForkTruncateOnEachBacking runs the sharing, fork and truncate checks
// (shareForkTruncate) on each backing that shares, in each layout, at 64 KiB
// granules: real shared memory (host.Shared), the CUDA backing over the fake driver,
// which enforces the driver's VMM rules (K/V written and read through the driver's
// copies, prefixes mapping one handle into many reservations), and backingtest.Fake.
// A host sequence's own PerLayer tail is writable through its slice; device memory
// is never handed out as a slice, only as a Base.
func TestShareForkTruncateOnEachBacking(t *testing.T) {
	onEachSharing(t, []envOption{withGranule(64 << 10), withConfig(kv.Config{MaxTokens: 512})}, func(t *testing.T, e *env) {
		shareForkTruncate(t, e.c)
		s, err := e.c.NewSequence()
		require.NoError(t, err)
		assert.NotZero(t, s.Base(0, kv.K), "a new sequence's range is reserved")
		require.NoError(t, s.Append(3))
		k, err := s.Bytes(0, kv.K)
		switch {
		case e.c.Config().Layout != kv.PerLayer:
			assert.ErrorIs(t, err, kv.ErrLayout, "only PerLayer tensors are contiguous")
		case e.kind == onShared:
			require.NoError(t, err)
			k[len(k)-1] = 0xff
		default:
			assert.ErrorIs(t, err, kv.ErrLayout, "device memory is never handed out as a slice")
		}
		assert.True(t, s.Close().OK())
	})
}
