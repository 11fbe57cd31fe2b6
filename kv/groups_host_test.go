//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// hostHybrid is tinyHybrid with tokens large enough to cross 4 KiB granules in a few
// tokens: a window token of 1 KiB per tensor, a 1,152-byte latent.
var hostHybrid = kv.Model{Name: "host-hybrid", Layers: 6, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 5, Layers: []int{0, 3}, KVHeads: 8, HeadDim: 64, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 4, HeadDim: 128, DType: arena.Float16},
	{Kind: kv.ChunkedLocal, Window: 9, Layers: []int{2}, KVHeads: 8, HeadDim: 64, DType: arena.Float16},
	{Kind: kv.MLALatent, Layers: []int{4}, KVHeads: 1, HeadDim: 576, DType: arena.Float16},
	{Kind: kv.Recurrent, Layers: []int{5}, StateBytes: 5000},
}}

// sharedGroups are the options of the group tests' env on host.Shared of the env's
// granules (4 KiB, or the 64 KiB that Windows maps views at): real shared memory,
// read by the CPU through views, runs and Bytes too.
var sharedGroups = []envOption{onShared}

// TestGroupOpsHost is TestGroupOps on real shared memory, every held token read
// back by copy, View, Run and (PerLayer) Bytes.
func TestGroupOpsHost(t *testing.T) {
	seen := runGroupOps(t, sharedGroups, hostHybrid, 0, randomOps(7, 80))
	assert.Positive(t, seen.forks)
	assert.Positive(t, seen.dropped)
}

// TestGroupOpsMapAheadHost is TestGroupOpsHost with map-ahead: runs ahead and what
// windows leave behind for the worker, the worker held off through about half the
// ops. After every op the worker is let rest and the ledger maps exactly what the
// sequences and prefixes commit and the runs ahead.
func TestGroupOpsMapAheadHost(t *testing.T) {
	env := []envOption{onShared, envFunc(func(sp *envSpec) { sp.cfg.MapAhead = true })}
	seen := runGroupOps(t, env, hostHybrid, 0, randomOps(11, 80))
	assert.Positive(t, seen.forks)
	assert.Positive(t, seen.dropped)
	seen = runGroupOps(t, env, withoutRecurrent(hostHybrid, "host-windows"), 1, randomOps(12, 80))
	assert.Positive(t, seen.frozen, "prefixes")
}

// TestGroupWindowPoolHost: on a pooling backing, the granules a window leaves go
// idle in the pool, where the next growth takes them: a long sequence of a window
// model owns no more than a short one, and the ledger stays exact (it owns what the
// sequence maps plus the pool's idle granules).
func TestGroupWindowPoolHost(t *testing.T) {
	pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
	e := openEnv(t, onShared, withGranule(64<<10), withAuthority(pool), withName("kv-window"), noCache)
	b := e.shared
	m := kv.Model{Name: "window", Layers: 2, Groups: []kv.Group{
		{Kind: kv.SlidingWindow, Window: 64, Layers: []int{0}, KVHeads: 8, HeadDim: 64, DType: arena.Float16},
		{Kind: kv.MLALatent, Layers: []int{1}, KVHeads: 1, HeadDim: 64, DType: arena.Float16},
	}}
	c := e.cache(t, kv.Config{Model: m, MaxTokens: 4096})
	s, err := c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	exact := func(n int) {
		st, ps := c.Stats(), b.PoolStats()
		l := pool.Stats()
		require.Equal(t, st.Committed, l.Mapped, "at %d tokens: the ledger maps what the sequence commits", n)
		require.Equal(t, l.Mapped+ps.Idle, l.Owned, "at %d tokens: it owns that and the idle granules", n)
	}
	maxIdle := int64(0)
	for n := 1; n <= 4096; n++ {
		require.NoError(t, s.Append(1))
		maxIdle = max(maxIdle, b.PoolStats().Idle)
		if n%512 == 0 {
			exact(n)
		}
	}
	// 2 KiB window tokens: 32 a 64 KiB granule, so the window's 64 tokens hold 2 or 3
	// granules; the latent (128 bytes) grows by one granule per 512 tokens, 8 in all.
	st := c.Stats()
	assert.LessOrEqual(t, st.Committed, int64((3+8)*64<<10))
	assert.Positive(t, b.PoolStats().Idle, "the granules the window left are idle in the pool")
	assert.LessOrEqual(t, maxIdle, int64(64<<10), "and taken by the next growth: they never pile up")
}

// hostWindows is hostHybrid without its recurrent group (its layer 5 is full
// attention): a model a prefix can be frozen from.
var hostWindows = withoutRecurrent(hostHybrid, "host-windows")

// TestGroupFreezeOpsHost is TestGroupOps on tinyWindows, on real shared memory: the sequences
// started on prefixes read back by copy, View, Run and (PerLayer) Bytes.
func TestGroupFreezeOpsHost(t *testing.T) {
	seen := runGroupOps(t, sharedGroups, hostWindows, 1, randomOps(9, 80))
	assert.Positive(t, seen.frozen)
	assert.Positive(t, seen.dropped)
}
