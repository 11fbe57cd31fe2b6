//go:build linux || windows

package kv_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// slowStores is a tier whose stores wait until open is closed (or their context ends),
// counting the stores that wait at once.
type slowStores struct {
	*tiertest.Map
	open    chan struct{}
	waiting atomic.Int64
}

func (h *slowStores) Store(ctx context.Context, key tierval.Key, size int, fill func([]byte) error) error {
	h.waiting.Add(1)
	defer h.waiting.Add(-1)
	select {
	case <-h.open:
	case <-ctx.Done():
		return ctx.Err()
	}
	return h.Map.Store(ctx, key, size, fill)
}

// TestPrefixCacheTierThroughQueue: when the tier's stores are slower than the
// inserts, write-throughs wait in a bounded queue for the store workers instead of a
// goroutine each: the goroutines stay bounded whatever the inserts, those past the
// queue are counted deferred (nothing dropped), and their blocks still go down, at
// eviction (here Close's): every block is stored once the tier is fast again.
func TestPrefixCacheTierThroughQueue(t *testing.T) {
	for _, stores := range []int{1, kv.DefaultTierStores} {
		t.Run(map[int]string{1: "stores=1", kv.DefaultTierStores: "stores=default"}[stores], func(t *testing.T) {
			c := openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c
			tpb, _ := blockTokens(t, c)
			h := &slowStores{Map: tiertest.NewMap(4 << 20), open: make(chan struct{})}
			opts := kv.PrefixCacheOptions{Tiers: []kv.Tier{h}, TierWait: time.Minute, TierWriteThrough: true}
			if stores != kv.DefaultTierStores {
				opts.TierStores = stores
			}
			pc, err := kv.NewPrefixCache(c, opts)
			require.NoError(t, err)
			closed := false
			t.Cleanup(func() {
				if !closed {
					close(h.open)
					assert.NoError(t, pc.Close())
				}
			})
			queue := kv.TierThroughQueue * stores
			inserts := 4 * (queue + stores) // far more than the workers and their queue take
			before := runtime.NumGoroutine()
			for i := range inserts {
				s, _, err := serve(pc, promptIDs(i<<16, 2*tpb+1))
				require.NoError(t, err)
				require.True(t, s.Close().OK(), "its entry takes over its ranges: written through")
			}
			require.Eventually(t, func() bool { return h.waiting.Load() == int64(stores) }, time.Minute, time.Millisecond,
				"every worker waits in a store")
			// The workers, and nothing per insert; a generous bound for the runtime's own.
			assert.LessOrEqual(t, runtime.NumGoroutine()-before, stores+8, "goroutines that wait on the tier")
			st := pc.Stats()
			require.Len(t, st.Tiers, 1)
			assert.Zero(t, st.Tiers[0].Drops, "a full queue drops nothing")
			require.Zero(t, st.Tiers[0].Deferred%2, "whole entries of two blocks")
			taken := inserts - int(st.Tiers[0].Deferred/2)
			// The queue's, and those the workers took off it (each waits in a store).
			assert.GreaterOrEqual(t, taken, queue, "write-throughs queued or running")
			assert.LessOrEqual(t, taken, queue+stores, "write-throughs queued or running")
			assert.EqualValues(t, inserts*(2*tpb+1), st.CachedTokens, "nothing was evicted")

			close(h.open)
			closed = true
			require.NoError(t, pc.Close())
			st = pc.Stats()
			assert.Zero(t, st.Tiers[0].Drops)
			assert.Equal(t, 2*inserts, h.Len(), "every block went down: written through, or at Close's eviction")
		})
	}
}
