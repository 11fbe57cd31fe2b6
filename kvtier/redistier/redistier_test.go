package redistier_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// slow is the per-call timeout of the tests of a server that answers: long enough for
// a loaded machine under -race, so that only the tests of a server down meet timeouts.
const slow = 10 * time.Second

func newTier(t testing.TB, c redis.UniversalClient, o redistier.Options) *redistier.Tier {
	t.Helper()
	tier, err := redistier.New(c, o)
	require.NoError(t, err)
	return tier
}

func TestConformanceServer(t *testing.T) {
	s := startServer(t, false)
	c := newClient(t, s.addr())
	tiertest.Run(t, func(t *testing.T) kv.Tier { return newTier(t, c, redistier.Options{Timeout: slow}) })
	assert.Equal(t, []int64{0}, dbsize(t, s), "the suite deletes every key it stores")
}

func TestConformanceCluster(t *testing.T) {
	nodes := startCluster(t)
	c := newClient(t, nodes[0].addr(), nodes[1].addr(), nodes[2].addr())
	tiertest.Run(t, func(t *testing.T) kv.Tier { return newTier(t, c, redistier.Options{Prefix: "cluster:", Timeout: slow}) })
	assert.Equal(t, []int64{0, 0, 0}, dbsize(t, nodes...), "the suite deletes every key it stores")
}

// TestClusterSpreadsKeys stores the blocks of one prefix (one namespace, a chain of
// hashes) and checks that every node holds some and that Contains sees them all.
func TestClusterSpreadsKeys(t *testing.T) {
	nodes := startCluster(t)
	c := newClient(t, nodes[0].addr(), nodes[1].addr(), nodes[2].addr())
	tier := newTier(t, c, redistier.Options{Timeout: slow})
	ctx := context.Background()
	keys := make([]tierval.Key, 60)
	for i := range keys {
		keys[i] = tierval.Key{Namespace: 77, Hash: uint64(i+1) * 0x9e3779b97f4a7c15}
		require.NoError(t, tier.Store(ctx, keys[i], 8, func(dst []byte) error { copy(dst, "block..."); return nil }))
	}
	for i, n := range dbsize(t, nodes...) {
		assert.Positive(t, n, "node %d holds none of the prefix's blocks", i)
	}
	n, err := tier.Contains(ctx, keys)
	require.NoError(t, err)
	assert.Equal(t, len(keys), n)
	require.NoError(t, tier.Delete(ctx, keys[40]))
	n, err = tier.Contains(ctx, keys)
	require.NoError(t, err)
	assert.Equal(t, 40, n, "the run ends at the deleted block")
	for _, k := range keys {
		require.NoError(t, tier.Delete(ctx, k))
	}
}

func TestStats(t *testing.T) {
	s := startServer(t, false)
	tier := newTier(t, newClient(t, s.addr()), redistier.Options{Timeout: slow})
	ctx := context.Background()
	a, b := tierval.Key{Namespace: 1, Hash: 1}, tierval.Key{Namespace: 1, Hash: 2}
	require.NoError(t, tier.Store(ctx, a, 1000, func([]byte) error { return nil }))
	require.NoError(t, tier.Store(ctx, b, 24, func([]byte) error { return nil }))
	boom := errors.New("fill failed")
	require.ErrorIs(t, tier.Store(ctx, a, 10, func([]byte) error { return boom }), boom)
	require.ErrorIs(t, tier.Store(ctx, a, tier.MaxValueSize()+1, nil), tierval.ErrSize)
	require.NoError(t, tier.Load(ctx, a, func([]byte) error { return nil }))
	require.ErrorIs(t, tier.Load(ctx, tierval.Key{Hash: 3}, nil), kv.ErrTierMiss)
	n, err := tier.Contains(ctx, []tierval.Key{a, b, {Hash: 3}, a})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, tier.Load(cancelled, a, nil), context.Canceled)
	assert.Equal(t, redistier.Stats{
		Hits: 1, Misses: 1, BytesLoaded: 1000,
		Stores: 2, BytesStored: 1024, DroppedStores: 1,
		Queries: 4, QueryHits: 2, Errors: 1,
	}, tier.Stats())
	require.NoError(t, tier.Delete(ctx, a))
	require.NoError(t, tier.Delete(ctx, b))
}

// TestCorruptValueIsRefused writes a value through the tier, damages it on the
// server, and checks that the value format refuses what Load returns.
func TestCorruptValueIsRefused(t *testing.T) {
	s := startServer(t, false)
	c := newClient(t, s.addr())
	tier := newTier(t, c, redistier.Options{Timeout: slow})
	ctx := context.Background()
	key := tierval.Key{Namespace: 5, Hash: 6}
	tokens := []int32{1, 2, 3, 4}
	block := bytes.Repeat([]byte("kv"), 5000)
	size := tierval.Size(len(tokens), len(block))
	require.NoError(t, tier.Store(ctx, key, size, func(dst []byte) error {
		return tierval.Encode(dst, key, tokens, len(block), func(p []byte) error { copy(p, block); return nil })
	}))
	check := func() error {
		return tier.Load(ctx, key, func(src []byte) error {
			got, err := tierval.Decode(src, key, tokens, len(block))
			if err == nil && !bytes.Equal(got, block) {
				return fmt.Errorf("decoded other bytes")
			}
			return err
		})
	}
	require.NoError(t, check())
	require.NoError(t, c.SetRange(ctx, tier.Key(key), int64(size-7), "X").Err())
	assert.ErrorIs(t, check(), tierval.ErrChecksum, "a byte changed on the server")
	require.NoError(t, c.Set(ctx, tier.Key(key), "short", 0).Err())
	assert.ErrorIs(t, check(), tierval.ErrTruncated, "a value cut short on the server")
	require.NoError(t, tier.Delete(ctx, key))
}

func TestNewBadInputs(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	for _, tt := range []struct {
		name   string
		client redis.UniversalClient
		opts   redistier.Options
	}{
		{"nil client", nil, redistier.Options{}},
		{"hash tag in the prefix", c, redistier.Options{Prefix: "kv{x}:"}},
		{"negative timeout", c, redistier.Options{Timeout: -time.Second}},
		{"negative MaxValueSize", c, redistier.Options{MaxValueSize: -1}},
		{"MaxValueSize above Redis's", c, redistier.Options{MaxValueSize: redistier.MaxValueSizeLimit + 1}},
		{"negative TTL", c, redistier.Options{TTL: -time.Second}},
	} {
		_, err := redistier.New(tt.client, tt.opts)
		assert.ErrorIs(t, err, redistier.ErrConfig, tt.name)
	}
	tier, err := redistier.New(c, redistier.Options{})
	require.NoError(t, err)
	assert.Equal(t, redistier.DefaultMaxValueSize, tier.MaxValueSize())
	assert.Equal(t, "vmkv:0000000000000001:00000000000000ff", tier.Key(tierval.Key{Namespace: 1, Hash: 255}))
}

func TestTTL(t *testing.T) {
	s := startServer(t, false)
	c := newClient(t, s.addr())
	tier := newTier(t, c, redistier.Options{TTL: time.Hour, Timeout: slow})
	ctx := context.Background()
	key := tierval.Key{Hash: 1}
	require.NoError(t, tier.Store(ctx, key, 1, func(dst []byte) error { dst[0] = 1; return nil }))
	ttl, err := c.TTL(ctx, tier.Key(key)).Result()
	require.NoError(t, err)
	assert.InDelta(t, time.Hour.Seconds(), ttl.Seconds(), 60)
	require.NoError(t, tier.Delete(ctx, key))
}
