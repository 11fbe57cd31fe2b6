package redistier_test

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// readBackCache returns a Blocked cache of soakModel on a backing of 64 KiB
// granules (host.Shared, or cuda over the fake driver), its ledger, and a check of
// what the backing still holds once the cache is closed.
func readBackCache(t *testing.T, onCUDA bool) (*kv.Cache, *accounting.Authority, func() error) {
	t.Helper()
	const gran = 64 << 10
	cfg := kv.Config{Model: soakModel, MaxTokens: 512, Layout: kv.Blocked}
	gov := accounting.NewGovernor()
	if onCUDA {
		auth := gov.Authority("gpu", accounting.GPU(0))
		f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: gran, Memory: 1 << 30})
		b, err := cuda.New(cuda.Options{Authority: auth, Driver: f.Driver()})
		require.NoError(t, err)
		c, err := kv.New(b, cfg)
		require.NoError(t, err)
		return c, auth, func() error { return errors.Join(b.Close(), f.CheckLeaks()) }
	}
	auth := gov.Authority("host", accounting.HostKey)
	b, err := host.NewShared(host.SharedOptions{Granularity: gran, Authority: auth, Name: fmt.Sprintf("redistier-%d", os.Getpid())})
	require.NoError(t, err)
	c, err := kv.New(b, cfg)
	require.NoError(t, err)
	return c, auth, b.Close
}

// TestPrefixCacheReadBack: a prefix cache's evicted blocks go down into a real
// redis-server and a lookup of the prompt loads them back; every token read back is
// the one written, on host memory (host.Shared) and through the CUDA fake's copies,
// and the device's ledger is exact once the cache is closed.
func TestPrefixCacheReadBack(t *testing.T) {
	for _, onCUDA := range []bool{false, true} {
		name := map[bool]string{false: "host.Shared", true: "cuda fake"}[onCUDA]
		t.Run(name, func(t *testing.T) {
			srv := startServer(t, false)
			c := newClient(t, srv.addr())
			cache, auth, closeBacking := readBackCache(t, onCUDA)
			tier := newTier(t, c, redistier.Options{Timeout: slow})
			pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: 4 * slow})
			require.NoError(t, err)
			s0, err := cache.NewSequence()
			require.NoError(t, err)
			tpb, blk := s0.BlockTokens(), s0.BlockStride()
			require.True(t, s0.Close().OK())
			ids := promptIDsFrom(int32(len(name)*1000), 3*tpb+5)

			s, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			require.Zero(t, m, "a cold cache and an empty server")
			require.NoError(t, s.Append(len(ids)))
			require.NoError(t, soakWrite(s, ids, 0, len(ids)))
			require.NoError(t, pc.Insert(s, ids))
			require.True(t, s.Close().OK())
			_, err = pc.Evict(1 << 40)
			require.NoError(t, err)
			require.Zero(t, pc.Stats().CachedTokens, "the entry left the device")
			st := pc.Stats().Tiers[0]
			require.EqualValues(t, 3*tierval.Size(tpb, blk), st.StoreBytes, "three whole blocks went down")
			require.Zero(t, st.Drops)
			require.Equal(t, []int64{3}, dbsize(t, srv), "one key a block")

			q, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			assert.Equal(t, 3*tpb, m, "the whole blocks below the last token, from Redis")
			require.NoError(t, soakCheck(q, ids, 0, m))
			require.NoError(t, q.Append(len(ids)-m))
			require.NoError(t, soakWrite(q, ids, m, len(ids)))
			require.NoError(t, soakCheck(q, ids, 0, len(ids)))
			require.True(t, q.Close().OK())
			st = pc.Stats().Tiers[0]
			assert.EqualValues(t, 3*tpb, st.Hits)
			assert.Equal(t, st.StoreBytes, st.LoadBytes)
			assert.Zero(t, st.Invalid)
			assert.Equal(t, int64(3), tier.Stats().Hits)
			require.NoError(t, pc.Close())
			require.NoError(t, cache.Close())
			assert.Zero(t, auth.Stats().Mapped, "the device's ledger: mappings left")
			require.NoError(t, closeBacking())
			assert.Zero(t, auth.Stats().Owned, "the device's ledger: owned bytes left")
		})
	}
}
