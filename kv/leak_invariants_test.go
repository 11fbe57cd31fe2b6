//go:build invariants

package kv_test

import (
	"slices"
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
	count := leaksOf(t, "kv_test.TestLeakedSequenceReported", []string{"kv.Sequence"}, func(l invariants.Leak) {
		if l.What == "kv.Sequence" {
			assert.Contains(t, l.Stack, "kv.(*Cache).NewSequence", "the report names the constructor")
			assert.Contains(t, l.String(), "kv.Sequence was garbage-collected without being closed")
		}
	})
	assert.Equal(t, 1, count["kv.Sequence"], "the leaked sequence is reported once")
	assert.NotZero(t, count["arena.Buffer"], "its ranges are reported")
	assert.Equal(t, count["arena.Buffer"], count["host.PrivateReservation"], "a reservation behind each range")
}

// leaksOf takes the invariants build's leak reports whose stack passes through fn (a
// test's name), calling each on every one, until each of want has been reported or 20
// collections have run (one finds the dropped owners unreachable; a few more allow for
// a pointer the runtime still held for a moment), then once more; it returns the
// count of reports by what leaked. The reports taken are not TestMain's to fail on.
func leaksOf(t *testing.T, fn string, want []string, each func(invariants.Leak)) map[string]int {
	t.Helper()
	ours := func(l invariants.Leak) bool { return strings.Contains(l.Stack, fn) }
	count := map[string]int{}
	take := func() {
		for _, l := range invariants.Leaks(ours) {
			count[l.What]++
			each(l)
		}
	}
	for range 20 {
		take()
		if !slices.ContainsFunc(want, func(w string) bool { return count[w] == 0 }) {
			break
		}
	}
	take()
	return count
}
