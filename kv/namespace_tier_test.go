package kv_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

// nsTier is a tier in a map. Blind, it keys its values by the block hash alone, as a
// tier that dropped tierval.Key's Namespace would: asked for a block of one
// namespace it hands back another's of the same tokens.
type nsTier struct {
	blind bool
	mu    sync.Mutex
	vals  map[tierval.Key][]byte
	loads int
}

func (t *nsTier) key(k tierval.Key) tierval.Key {
	if t.blind {
		k.Namespace = 0
	}
	return k
}

func (t *nsTier) Name() string { return "ns-map" }

func (t *nsTier) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	buf := make([]byte, size)
	if err := fill(buf); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.vals == nil {
		t.vals = map[tierval.Key][]byte{}
	}
	t.vals[t.key(key)] = buf
	return nil
}

func (t *nsTier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	v, ok := t.vals[t.key(key)]
	t.loads++
	t.mu.Unlock()
	if !ok {
		return kv.ErrTierMiss
	}
	return use(v)
}

func (t *nsTier) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, k := range keys {
		if _, ok := t.vals[t.key(k)]; !ok {
			return i, nil
		}
	}
	return len(keys), nil
}

func (t *nsTier) Delete(ctx context.Context, key tierval.Key) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	delete(t.vals, t.key(key))
	t.mu.Unlock()
	return nil
}

// TestNamespaceTierRefused: a prompt of adapter a goes down into a tier by eviction.
// Looked up under salt t1, a tier that keys by the namespace too holds nothing of it
// (a miss, no load); a blind one hands back adapter a's value, which the cache
// refuses by its header's namespace (TierStats.Invalid) and never maps: the lookup
// starts on nothing. Under adapter a both load it, and its tokens are a's K/V.
func TestNamespaceTierRefused(t *testing.T) {
	for _, blind := range []bool{false, true} {
		name := map[bool]string{false: "keyed", true: "blind"}[blind]
		t.Run(name, func(t *testing.T) {
			tier := &nsTier{blind: blind}
			e := newNSCache(t, kv.Config{MaxTokens: 64}, 0, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}})
			ids := nsIDs(300, 33)
			s, _, err := nsServe(e.pc, 1, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			_, err = e.pc.Evict(1 << 30)
			require.NoError(t, err)
			st := e.pc.Stats()
			require.Zero(t, st.Entries)
			require.Positive(t, st.Tiers[0].StoreBytes, "the prompt's blocks went down")

			other, m, err := e.pc.LookupIn(nsSpaces[2], ids)
			require.NoError(t, err)
			assert.Zero(t, m, "another namespace's blocks are no hit")
			assert.Zero(t, other.Len())
			require.True(t, other.Close().OK())
			st = e.pc.Stats()
			assert.Zero(t, st.Tiers[0].Hits)
			if blind {
				assert.Equal(t, int64(1), st.Tiers[0].Invalid, "the value of adapter a refused by its namespace")
			} else {
				assert.Zero(t, st.Tiers[0].Invalid)
				assert.Zero(t, tier.loads, "nothing of salt t1 is held: nothing loaded")
			}

			own, m, err := e.pc.LookupIn(nsSpaces[1], ids)
			require.NoError(t, err)
			defer own.Close()
			assert.Equal(t, len(ids)-1, m, "adapter a's blocks load under adapter a")
			assert.NoError(t, nsCheck(own, 1, ids, 0, m))
			assert.Equal(t, int64(m), e.pc.Stats().Tiers[0].Hits)
		})
	}
}
