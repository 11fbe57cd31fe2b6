package hosttier_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

func TestConformance(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		tr, _ := newTier(t, hosttier.Options{Budget: 4 * tiertest.MinValueSize})
		return tr
	})
}

// The suite on a tier that refuses rather than evicts.
func TestConformanceNoEvict(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		tr, _ := newTier(t, hosttier.Options{Budget: 4 * tiertest.MinValueSize, NoEvict: true})
		return tr
	})
}

// The suite on a CUDA tier on the fake driver: fill gets pinned memory.
func TestConformanceCUDA(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		x := newGPU(t, 1)
		// 64 KiB granules: the suite's ~70 small values all stay, as in the host tier.
		tr, _ := newTier(t, hosttier.Options{Budget: 4 * tiertest.MinValueSize, CUDA: x.b})
		require.NoError(t, tr.WaitPinned(bg))
		return tr
	})
}
