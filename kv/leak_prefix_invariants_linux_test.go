//go:build invariants

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/kv"
)

// TestLeakedPrefixReported drops a frozen prefix and a prefix cache, with their cache
// and pool, without closing them (the sequence they came from is closed), and checks
// that the invariants build reports each once, naming its constructor and this test.
func TestLeakedPrefixReported(t *testing.T) {
	func() {
		gov := accounting.NewGovernor()
		// NB: no decay: its goroutine would hold the pool, and through its authority
		// and the governor the prefix cache's reclaimer, reachable for seconds.
		mem, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Decay: host.SharedNoDecay,
			Authority: gov.Authority("kv", accounting.HostKey)})
		require.NoError(t, err)
		m := kv.Model{Name: "leak", Layers: 2, Groups: []kv.Group{
			{Kind: kv.FullAttention, Layers: []int{0, 1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
		}}
		c, err := kv.New(mem, kv.Config{Model: m, MaxTokens: 4096})
		require.NoError(t, err)
		_, err = kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
		require.NoError(t, err)
		s, err := c.NewSequence()
		require.NoError(t, err)
		require.NoError(t, s.Append(40))
		_, err = s.Freeze(40)
		require.NoError(t, err)
		require.True(t, s.Close().OK())
	}()
	count := leaksOf(t, "kv_test.TestLeakedPrefixReported", []string{"kv.Prefix", "kv.PrefixCache"}, func(l invariants.Leak) {
		switch l.What {
		case "kv.Prefix":
			assert.Contains(t, l.Stack, "kv.(*Sequence).Freeze", "the report names the constructor")
		case "kv.PrefixCache":
			assert.Contains(t, l.Stack, "kv.NewPrefixCache", "the report names the constructor")
		}
	})
	assert.Equal(t, 1, count["kv.Prefix"], "the leaked prefix is reported once")
	assert.Equal(t, 1, count["kv.PrefixCache"], "the leaked prefix cache is reported once")
	assert.Zero(t, count["kv.Sequence"], "the closed sequence is not reported")
}
