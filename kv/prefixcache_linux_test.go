package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheOwnedOnceByPss: 64 requests that share a 1,024-token prompt prefix,
// served through the prefix cache, hold it once in physical memory, as the kernel
// counts it (Pss of the memfd), not 64 times.
func TestPrefixCacheOwnedOnceByPss(t *testing.T) {
	const name = "kv-prefixcache-pss-test"
	e := openEnv(t, onShared, withGranule(64<<10), withName(name), withConfig(kv.Config{MaxTokens: 2048, Layout: kv.PerLayer}))
	c, pool := e.c, e.auth
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	defer func() { assert.NoError(t, pc.Close()) }()
	system := make([]int32, 1024)
	for i := range system {
		system[i] = int32(i % 7)
	}
	first, m, err := serve(pc, append(system, -1))
	require.NoError(t, err)
	require.Zero(t, m)
	require.True(t, first.Close().OK())

	prefixBytes := int64(1024 * tiny8.BytesPerToken()) // 3 MiB: 8 granules per range
	var seqs []*kv.Sequence
	for i := range 64 {
		s, m, err := serve(pc, append(system, int32(-2-i)))
		require.NoError(t, err)
		require.Equal(t, 1024, m)
		seqs = append(seqs, s)
		touchPages(t, s)
	}
	require.NoError(t, checkIDs(seqs[63], system, 0, 1024))
	st := pc.Stats()
	pss, hi := pssOf(t, name)
	// Each sequence holds one granule per range of its own, the one past the prefix
	// where its last token lies, and so does the first entry (it took over the first
	// sequence's ranges); the 64 other entries, lazy, hold their live origins' (see
	// pcEntry). One page of each at most is resident.
	tails := int64(64+1) * int64(2*tiny8.Layers)
	own := tails * (64 << 10)
	t.Logf("Pss of 64 sequences on a %d KiB cached prefix: %d KiB (mapped %d KiB)", prefixBytes>>10, pss>>10, pool.Stats().Mapped>>10)
	assert.Equal(t, 65, st.Entries)
	assert.Equal(t, prefixBytes+own, pool.Stats().Owned, "the governor: the prefix owned once")
	assert.Equal(t, prefixBytes+int64(st.Entries)*int64(2*tiny8.Layers)*(64<<10), st.CachedBytes, "the cache counts the prefix once too")
	assert.Equal(t, prefixBytes+64*int64(2*tiny8.Layers)*(64<<10), st.PinnedBytes, "the live sequences map the prefix, and their tails their entries hold")
	// The kernel: the prefix resident once, not 64 times (192 MiB), and at most one
	// page of each tail.
	assert.GreaterOrEqual(t, hi, prefixBytes*9/10, "the prefix is resident (Pss %d KiB, less than %d KiB)", pss>>10, hi>>10)
	assert.LessOrEqual(t, pss, prefixBytes+tails*4096+prefixBytes/10, "resident once, not 64 times")
	for _, s := range seqs {
		assert.True(t, s.Close().OK())
	}
}
