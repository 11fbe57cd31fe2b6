//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// sizeTier records the largest value stored into it.
type sizeTier struct {
	*tiertest.Map
	mu  sync.Mutex
	max int
}

func (s *sizeTier) Store(ctx context.Context, key tierval.Key, size int, fill func([]byte) error) error {
	s.mu.Lock()
	s.max = max(s.max, size)
	s.mu.Unlock()
	return s.Map.Store(ctx, key, size, fill)
}

// TestTierValueSize: TierValueSize is the largest value a cache may store into its
// tiers, on a uniform model, one of window groups and one of recurrent groups (whose
// values with states are its largest): an entry with checkpoints at every tier
// block's end goes down by write-through as it is inserted, while it holds every
// window unit of its prefill (a value holds a window group's units that its entry
// still holds), and the largest store is that size, exactly.
func TestTierValueSize(t *testing.T) {
	for _, model := range []kv.Model{kv.Tiny(), tinyOSS, tinyNext} {
		t.Run(model.Name, func(t *testing.T) {
			e := openEnv(t, onShared, withLimit(1<<30), withConfig(kv.Config{Model: model, MaxTokens: 2048}))
			want, err := kv.TierValueSize(e.c.Config(), e.c.Granularity())
			require.NoError(t, err)
			tier := &sizeTier{Map: tiertest.NewMap(want)}
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: time.Minute, TierWriteThrough: true})
			require.NoError(t, err)
			closeAtCleanup(t, pc)
			bt := tierBlock(t, e.c)
			ids := promptIDs(3, 3*bt+1)
			var s *kv.Sequence
			if model.Name == tinyNext.Name {
				s, _ = serveStates(t, pc, ids, bt)
			} else {
				s, _, _, err = serveHybrid(pc, ids)
				require.NoError(t, err)
			}
			require.True(t, s.Close().OK())
			require.NoError(t, pc.Close(), "Close waits for the write-throughs")
			assert.Equal(t, 3, tier.Len(), "a value per tier block")
			assert.Zero(t, pc.Stats().Tiers[0].Drops, "a tier of values of that size takes them all")
			assert.Equal(t, want, tier.max, "the largest value stored")
		})
	}
}

// TestTierValueSizeBad: a configuration the cache can not be built from, or whose
// prefix cache would refuse tiers, is refused as New and NewPrefixCache refuse it.
func TestTierValueSizeBad(t *testing.T) {
	for _, tc := range []struct {
		cfg     kv.Config
		granule int
		want    error
	}{
		{kv.Config{Model: kv.Tiny(), MaxTokens: 64}, 3 << 20, kv.ErrConfig},
		{kv.Config{Model: kv.Tiny(), MaxTokens: 64, Layout: kv.PerLayer}, 64 << 10, kv.ErrConfig},
		{kv.Config{Model: tinyOSS, MaxTokens: 64, Layout: kv.PerLayer}, 64 << 10, kv.ErrConfig},
		{kv.Config{Model: tinyGemma, MaxTokens: 45}, 4 << 10, kv.ErrConfig}, // a tier block of 48 tokens past MaxTokens
		{kv.Config{Model: kv.Model{Name: "none"}, MaxTokens: 64}, 64 << 10, kv.ErrModel},
		{kv.Config{Model: kv.Tiny(), MaxTokens: 64, BlockTokens: -1}, 64 << 10, kv.ErrConfig},
	} {
		t.Run(fmt.Sprintf("%s/%v/%d", tc.cfg.Model.Name, tc.cfg.Layout, tc.granule), func(t *testing.T) {
			_, err := kv.TierValueSize(tc.cfg, tc.granule)
			require.ErrorIs(t, err, tc.want)
		})
	}
}
