//go:build linux || windows

package kv_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// newDefaultShared returns a cache of cfg on host.Shared with its default options
// (no Granularity, no ShareUnit), as a newcomer writes it, and that backing; both
// are closed when the test ends.
func newDefaultShared(t *testing.T, cfg kv.Config) (*kv.Cache, *host.Shared) {
	t.Helper()
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 1<<30))
	pool, err := host.NewShared(host.SharedOptions{Authority: gov.Authority("kv", accounting.HostKey)})
	if errors.Is(err, errors.ErrUnsupported) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, pool.Close()) })
	c, err := kv.New(pool, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c, pool
}

// TestDefaultSharedGranule: on host.Shared with its defaults, kv.New chooses the
// granule for the model's smallest token (host.SharedOptions.ShareUnit's rule: at most
// 64 tokens a granule, 64 KiB to 2 MiB), without the caller passing it.
func TestDefaultSharedGranule(t *testing.T) {
	gptOSS20B, err := kv.Preset("gpt-oss-20b")
	require.NoError(t, err)
	for _, tt := range []struct {
		name   string
		cfg    kv.Config
		want   int
		tokens int // the default block's tokens on that granule (-1: not checked)
	}{
		// 4 layers × K and V × 2 heads × 64 × bf16: 2 KiB a token.
		{"small", kv.Config{Model: kv.Uniform("small", 4, 2, 64, arena.BFloat16), MaxTokens: 2048}, 128 << 10, 64},
		// PerLayer shares one tensor's granules: 256-byte tokens, 64 KiB at least.
		{"small/per-layer", kv.Config{Model: kv.Uniform("small", 4, 2, 64, arena.BFloat16), MaxTokens: 2048, Layout: kv.PerLayer}, 64 << 10, 0},
		// 128 KiB a token: 16 a 2 MiB granule already, the granule the example keeps.
		{"llama3-8b", kv.Config{Model: kv.Llama3_8B(), MaxTokens: 2048}, 2 << 20, 16},
		// Two groups of 24 KiB tokens: 42 a 1 MiB granule (their blocks: blocks_test.go).
		{"gpt-oss-20b", kv.Config{Model: gptOSS20B, MaxTokens: 2048}, 1 << 20, -1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, pool := newDefaultShared(t, tt.cfg)
			assert.Equal(t, tt.want, pool.Granularity())
			assert.Equal(t, tt.want, c.Granularity())
			s, err := c.NewSequence()
			require.NoError(t, err)
			defer s.Close()
			if tt.tokens >= 0 {
				assert.Equal(t, tt.tokens, s.BlockTokens())
			}
		})
	}
}

// TestDefaultSharedPromptMapped: a 300-token prompt of the small model, frozen and
// started on, is mapped and not copied on host.Shared's defaults: its 4 whole blocks
// of 64 tokens are shared (Stats.Shared, Writable), only the 44 tokens after them
// copied. On the 2 MiB granule chosen before, one block held 1,024 tokens and the
// prompt was copied whole.
func TestDefaultSharedPromptMapped(t *testing.T) {
	const prompt = 300
	m := kv.Uniform("small", 4, 2, 64, arena.BFloat16)
	c, _ := newDefaultShared(t, kv.Config{Model: m, MaxTokens: 2048})
	tb := m.Groups[0].TokenBytes()
	sys, err := c.NewSequence()
	require.NoError(t, err)
	defer sys.Close()
	require.NoError(t, sys.Append(prompt))
	want := make([]byte, prompt*tb)
	for i := range want {
		want[i] = byte(i*7 + i/tb)
	}
	for layer := range m.Layers {
		require.NoError(t, sys.WriteTokens(layer, kv.K, 0, prompt, want))
		require.NoError(t, sys.WriteTokens(layer, kv.V, 0, prompt, want))
	}
	p, err := sys.Freeze(prompt)
	require.NoError(t, err)
	defer p.Release()
	q, err := c.NewSequenceFrom(p)
	require.NoError(t, err)
	defer q.Close()

	assert.Equal(t, 4*64, q.Writable(), "the tokens of the 4 whole blocks are shared, read-only")
	blk := int64(c.Granularity()) // a block of the small model is one granule
	assert.Equal(t, 4*blk, c.Stats().Shared, "4 blocks mapped, not copied")
	got := make([]byte, prompt*tb)
	for layer := range m.Layers {
		for _, k := range []kv.Kind{kv.K, kv.V} {
			require.NoError(t, q.ReadTokens(layer, k, 0, prompt, got))
			require.Equal(t, want, got, "layer %d %v: the mapped and copied prompt reads back", layer, k)
		}
	}
}
