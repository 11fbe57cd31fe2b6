//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
)

// TestPrefixCacheCloseKeepsSharedTail: an entry got ranges of its own (a write into
// the tokens it holds), and the inserted sequence then froze a prefix whose whole
// blocks cover the entry's partly filled one. When the sequence closes, the entry must
// not copy its tail into the sequence's ranges to take them over: that block is the
// frozen prefix's too (read-only in the sequence on host.Shared, so the copy faulted),
// and the prefix's tokens there are not the entry's.
func TestPrefixCacheCloseKeepsSharedTail(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.HostKey)
	b := sharedPool(t, auth, "kv-pc-adopt-tail")
	c, err := kv.New(b, kv.Config{Geometry: tiny8, MaxTokens: 256})
	require.NoError(t, err)
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, pc.Close())
		assert.NoError(t, c.Close())
	})
	const n = 10
	ids := promptIDs(0, n+1)
	s, err := c.NewSequence()
	require.NoError(t, err)
	tpb := s.BlockTokens()
	require.Greater(t, tpb, n, "the entry holds a partly filled block only")
	require.NoError(t, s.Append(n))
	require.NoError(t, writeIDs(s, ids, 0, n))
	require.NoError(t, pc.Insert(s, ids[:n]))

	other := promptIDs(500, tpb)
	require.NoError(t, s.Append(tpb-n))
	require.NoError(t, writeIDs(s, other, n-1, tpb), "the entry copies its tokens first")
	pr, err := s.Freeze(tpb)
	require.NoError(t, err)
	defer pr.Release()
	require.NoError(t, faults(func() { require.True(t, s.Close().OK()) }), "Close wrote into a read-only block")

	f, err := c.NewSequenceFrom(pr)
	require.NoError(t, err)
	assert.NoError(t, checkIDs(f, ids, 0, n-1))
	assert.NoError(t, checkIDs(f, other, n-1, tpb), "the frozen prefix keeps its own tokens")
	require.True(t, f.Close().OK())
	q, m, err := pc.Lookup(ids)
	require.NoError(t, err)
	assert.Equal(t, n, m)
	assert.NoError(t, checkIDs(q, ids, 0, m), "the entry holds the tokens it was inserted with")
	require.True(t, q.Close().OK())
}
