package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestFullLayersAlone: the comparison replay of a recurrent model keeps its
// full-attention layers alone, numbered in order, in their own shape: the same
// per-token bytes of K and V as the model's full group.
func TestFullLayersAlone(t *testing.T) {
	m := kv.Qwen3Next80B()
	s, w := fullLayersAlone(setup{budget: 1 << 30, groups: &m}, PrefixWorkload{Layers: m.Layers, Plan: planLayers(&m)}, m)
	assert.Nil(t, s.groups, "one full group: a uniform model")
	assert.Equal(t, int64(1<<30), s.budget, "at the same budget")
	require.NoError(t, s.model.Validate(0))
	var full kv.Group
	for _, g := range m.Groups {
		if g.Kind == kv.FullAttention {
			full = g
		}
	}
	assert.Equal(t, len(full.Layers), s.model.Layers)
	assert.Equal(t, full.BytesPerToken(), s.model.BytesPerToken())
	assert.Equal(t, len(full.Layers), w.Layers)
	assert.Equal(t, full.TokenBytes(), w.TokenBytes)
	assert.Nil(t, w.Plan)

	// A model of a window group beside recurrent and full ones keeps both, renumbered.
	mixed := kv.Model{Name: "mixed", Layers: 5, Groups: []kv.Group{
		{Kind: kv.Recurrent, Layers: []int{0, 3}, StateBytes: 64},
		{Kind: kv.SlidingWindow, Window: 8, Layers: []int{1, 4}, KVHeads: 1, HeadDim: 16, DType: m.Groups[1].DType},
		{Kind: kv.FullAttention, Layers: []int{2}, KVHeads: 1, HeadDim: 32, DType: m.Groups[1].DType},
	}}
	s, w = fullLayersAlone(setup{groups: &mixed}, PrefixWorkload{}, mixed)
	require.NotNil(t, s.groups)
	require.NoError(t, s.groups.Validate(0))
	assert.Equal(t, []int{0, 2}, s.groups.Groups[0].Layers)
	assert.Equal(t, []int{1}, s.groups.Groups[1].Layers)
	assert.Equal(t, 3, w.Layers)
	assert.Len(t, w.Plan, 3)
}

// TestFullLayersColour: the comparison's line has an opaque colour no other prefix
// strategy has.
func TestFullLayersColour(t *testing.T) {
	c, ok := prefixColors[nameFullLayers]
	require.True(t, ok)
	assert.Equal(t, uint8(255), c.A)
	for n, o := range prefixColors {
		if n != nameFullLayers {
			assert.NotEqual(t, o, c, "%s shares %s's colour", n, nameFullLayers)
		}
	}
}

// TestCheckpointReplay runs the prefix-cache replay of the Mooncake trace on
// qwen3-next-80b-a3b with -verify: the prefill records checkpoints at block
// boundaries, every hit token and state reads back as written for its prefix, the
// full-attention layers alone run at the same budget, and the line gives the ratio
// of the hit rates and the checkpoints' bytes.
func TestCheckpointReplay(t *testing.T) {
	if testing.Short() {
		t.Skip("replays 38 MiB states")
	}
	code, out, errOut := runArgs(t, "-model", "qwen3-next-80b-a3b", "-trace", "mooncake", "-requests", "6", "-max-tokens", "4096",
		"-budget", "1GiB", "-strategies", "vmarena+prefix-cache", "-verify", "-progress", "none", "-out", t.TempDir())
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errOut)
	assert.Contains(t, out, nameFullLayers)
	assert.Contains(t, out, "Checkpoints: vmarena+prefix-cache recorded")
	assert.Contains(t, out, "512-token block boundary")
	assert.Contains(t, out, "for the full-attention layers alone at the same budget")
	assert.Regexp(t, `vmarena\+prefix-cache: [1-9][0-9]* hit tokens read back`, out, "some hits, each read back")
	assert.False(t, strings.Contains(errOut, "kvcache:"), errOut)
}

// TestCheckpointReplayTiers runs the same replay with a host tier and Redis (a
// redis-server the example starts) under a device budget too small for its states:
// the blocks and the checkpoints' states go down into both tiers, none dropped (the
// Redis tier takes values of kv.TierValueSize, 40.7 MiB on the 1 MiB granule kv.New
// chooses for this model, above its default 8 MiB), every hit token and state read
// back as written (-verify), no value refused.
func TestCheckpointReplayTiers(t *testing.T) {
	if testing.Short() {
		t.Skip("replays 38 MiB states")
	}
	code, out, errOut := runArgs(t, "-model", "qwen3-next-80b-a3b", "-trace", "mooncake", "-requests", "4", "-max-tokens", "2048",
		"-budget", "320MiB", "-host-tier-budget", "1GiB", "-tiers", "host,redis", "-tier-wait", "30s",
		"-strategies", "vmarena+prefix-cache,vmarena+tiers", "-verify", "-progress", "none", "-out", t.TempDir())
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errOut)
	assert.Regexp(t, `vmarena\+tiers +[0-9.]+% +[0-9.]+% +[0-9.]+% +[0-9.]+% +[0-9.]+% +[1-9][0-9]* tokens +[1-9][0-9]*% / [1-9][0-9]*% +[1-9][0-9.]* [MG]iB +[0-9.]+ [KMG]?i?B +0 / 0 +0 / 0 +0 / 0`, out,
		"blocks evicted, written down and stored into both tiers, none dropped or refused")
	assert.Regexp(t, `(?m)^ *vmarena\+tiers .* [1-9][0-9]* tokens$`, out, "hits read back (checked)")
	assert.False(t, strings.Contains(errOut, "kvcache:"), errOut)
}
