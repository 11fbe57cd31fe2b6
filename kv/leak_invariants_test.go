//go:build invariants

package kv_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/kv"
)

// TestLeakedSequenceReported drops a sequence, and its cache, without closing them,
// and checks that the invariants build reports the sequence, its ranges and their
// reservations as collected unclosed, each naming this test as where it was made. The
// reports are taken here, so that TestMain does not fail the package for them.
func TestLeakedSequenceReported(t *testing.T) {
	func() {
		mem, err := host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10})
		require.NoError(t, err)
		gov := accounting.NewGovernor()
		m := kv.Model{Name: "leak", Layers: 2, Groups: []kv.Group{
			{Kind: kv.FullAttention, Layers: []int{0, 1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
		}}
		c, err := kv.New(mem, kv.Config{Model: m, MaxTokens: 4096, Authority: gov.Authority("kv", accounting.HostKey)})
		require.NoError(t, err)
		s, err := c.NewSequence()
		require.NoError(t, err)
		require.NoError(t, s.Append(10))
	}()
	ours := func(l invariants.Leak) bool {
		return strings.Contains(l.Stack, "kv_test.TestLeakedSequenceReported")
	}
	count := map[string]int{}
	// One collection finds the dropped owners unreachable; a few more are allowed
	// for a pointer the runtime still held for a moment. Each Leaks collects.
	for range 20 {
		for _, l := range invariants.Leaks(ours) {
			count[l.What]++
			if l.What == "kv.Sequence" {
				assert.Contains(t, l.Stack, "kv.(*Cache).NewSequence", "the report names the constructor")
				assert.Contains(t, l.String(), "kv.Sequence was garbage-collected without being closed")
			}
		}
		if count["kv.Sequence"] > 0 {
			break
		}
	}
	for _, l := range invariants.Leaks(ours) {
		count[l.What]++
	}
	assert.Equal(t, 1, count["kv.Sequence"], "the leaked sequence is reported once")
	assert.NotZero(t, count["arena.Buffer"], "its ranges are reported")
	assert.Equal(t, count["arena.Buffer"], count["host.PrivateReservation"], "a reservation behind each range")
}
