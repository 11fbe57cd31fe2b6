package redistier_test

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// soakRequests is the requests of TestPrefixCacheSoak; the normal run makes a short
// one (go test -run TestPrefixCacheSoak ./kvtier/redistier -args -soak.requests=20000
// for a long one).
var soakRequests = flag.Int("soak.requests", 240, "requests of TestPrefixCacheSoak")

var errInjected = errors.New("injected fault")

// soakModel is a small model: a block of 4 KiB granules.
var soakModel = kv.Uniform("soak", 3, 4, 64, arena.Float16)

// soakByte is the byte i of token pos (ID id) of layer's kind tensor: K and V depend
// on the token's ID and position, as a model's do on the prefix.
func soakByte(id int32, layer int, kind kv.Kind, pos, i int) byte {
	return byte(uint32(id)*2654435761>>13 + uint32(layer*31+int(kind)*7+pos*131+i))
}

// soakWrite writes tokens [from, to) of s with ids' patterns.
func soakWrite(s *kv.Sequence, ids []int32, from, to int) error {
	buf := make([]byte, soakModel.Groups[0].TokenBytes())
	for layer := range soakModel.Layers {
		for _, kind := range []kv.Kind{kv.K, kv.V} {
			for p := from; p < to; p++ {
				for i := range buf {
					buf[i] = soakByte(ids[p], layer, kind, p, i)
				}
				if err := s.WriteToken(layer, kind, p, buf); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// soakCheck checks tokens [from, to) of s against ids' patterns.
func soakCheck(s *kv.Sequence, ids []int32, from, to int) error {
	buf := make([]byte, soakModel.Groups[0].TokenBytes())
	for layer := range soakModel.Layers {
		for _, kind := range []kv.Kind{kv.K, kv.V} {
			for p := from; p < to; p++ {
				if err := s.ReadToken(layer, kind, p, buf); err != nil {
					return err
				}
				for i := range buf {
					if want := soakByte(ids[p], layer, kind, p, i); buf[i] != want {
						return fmt.Errorf("token %d (id %d) layer %d %v byte %d: %d, want %d", p, ids[p], layer, kind, i, buf[i], want)
					}
				}
			}
		}
	}
	return nil
}

// TestPrefixCacheSoak serves requests through a prefix cache whose tiers are host
// memory and a real redis-server, under a cap that keeps evicting into them: the
// server is killed a third of the way through and started again at two thirds, and
// commits fail (backingtest.Faulty) during lookups that load from the tiers. No
// request fails, no token read is wrong, and at the end the device's and the host
// tier's ledgers balance.
func TestPrefixCacheSoak(t *testing.T) {
	srv := startServer(t, false)
	rt := newTier(t, newClient(t, srv.addr()), redistier.Options{Timeout: 200 * time.Millisecond, Backoff: 50 * time.Millisecond})

	gov := accounting.NewGovernor()
	pool := gov.Authority("pool", accounting.HostKey)
	fake := backingtest.NewFake(backingtest.FakeOptions{Granularity: 4 << 10, Authority: pool})
	faulty := backingtest.NewFaulty(fake)
	c, err := kv.New(faulty, kv.Config{Model: soakModel, MaxTokens: 512, Layout: kv.Blocked})
	require.NoError(t, err)
	s0, err := c.NewSequence()
	require.NoError(t, err)
	tpb, blk := s0.BlockTokens(), s0.BlockStride()
	require.True(t, s0.Close().OK())

	hostAuth := gov.Authority("host tier", accounting.DeviceKey{Tier: accounting.HostTier})
	// Room for a few prompts only: the rest is found in Redis.
	ht, err := hosttier.New(hosttier.Options{Budget: 8 * int64(tierval.Size(tpb, blk)), Granule: 4 << 10, Authority: hostAuth})
	require.NoError(t, err)
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{
		Tiers: []kv.Tier{ht, rt}, TierPrefix: t.Name(), MaxBytes: 6 * int64(blk), TierWait: 2 * time.Second,
	})
	require.NoError(t, err)

	prompts := make([][]int32, 16)
	for i := range prompts {
		shared := []int32{int32(i % 4), 1, 2, 3}
		ids := make([]int32, 0, 4*tpb)
		for len(ids) < (1+i%3)*tpb+i%5 {
			ids = append(ids, shared[len(ids)%4]+int32(len(ids)/tpb*100))
		}
		ids = append(ids, promptIDsFrom(int32(1000*(i+1)), 2*tpb)...)
		prompts[i] = ids
	}
	serve := func(ids []int32, fault bool) int {
		t.Helper()
		if fault {
			faulty.FailOp(backingtest.OpCommit, 1, errInjected)
		}
		s, m, err := pc.Lookup(ids)
		faulty.Reset() // a fault the lookup did not reach fires nowhere else
		require.NoError(t, err, "a request failed")
		require.NoError(t, soakCheck(s, ids, 0, m), "a hit of %d tokens", m)
		require.NoError(t, s.Append(len(ids)-m))
		require.NoError(t, soakWrite(s, ids, m, len(ids)))
		require.NoError(t, pc.Insert(s, ids))
		require.True(t, s.Close().OK())
		return m
	}

	// A load whose commit fails is a drop of that tier: the next one serves it.
	serve(prompts[0], false)
	_, err = pc.Evict(1 << 40)
	require.NoError(t, err)
	before := pc.Stats().Tiers
	m := serve(prompts[0], true)
	after := pc.Stats().Tiers
	assert.Equal(t, before[0].Drops+1, after[0].Drops, "the host tier's load failed its commit")
	assert.Positive(t, m, "Redis served the blocks")
	assert.Equal(t, before[1].Hits+int64(m), after[1].Hits)

	r := rand.New(rand.NewPCG(28, 1))
	n := *soakRequests
	for i := range n {
		switch i {
		case n / 3:
			srv.kill()
		case 2 * n / 3:
			srv.start()
		}
		ids := prompts[r.IntN(len(prompts))]
		serve(ids, pc.Match(ids) == 0 && r.IntN(3) == 0)
		if r.IntN(8) == 0 {
			_, err := pc.Evict(int64(blk) * int64(1+r.IntN(4)))
			require.NoError(t, err)
		}
	}
	require.NoError(t, pc.Close())
	st := pc.Stats()
	t.Logf("hits %d of %d queried tokens; host %+v; redis %+v", st.Hits, st.Queries, st.Tiers[0], st.Tiers[1])
	for _, ts := range st.Tiers {
		assert.Zero(t, ts.Invalid, ts.Name)
		assert.Positive(t, ts.Hits, ts.Name)
		assert.Positive(t, ts.StoreBytes, ts.Name)
	}
	assert.Positive(t, st.Tiers[1].Drops, "stores and loads while the server was down")
	require.NoError(t, c.Close())
	assert.Zero(t, fake.LiveGranules(), "granules leaked")
	assert.Zero(t, fake.LiveReservations(), "reservations leaked")
	assert.Zero(t, pool.Stats().Owned, "the device's ledger")
	assert.Zero(t, pool.Stats().Mapped, "the device's ledger")
	require.NoError(t, ht.Close())
	assert.Zero(t, hostAuth.Stats().Owned, "the host tier's ledger")
}

// promptIDsFrom returns n token IDs from first on.
func promptIDsFrom(first int32, n int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = first + int32(i)
	}
	return ids
}
