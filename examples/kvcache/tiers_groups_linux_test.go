package main

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestRunTiersGroups runs the prefix-cache replay with a host tier on gpt-oss-20b
// and gemma-3-27b (shrunk) at a third of the ideal cache: every hit token of every
// layer a later step reads, from the device or the tier, is read back as written (the
// replay's own check with -tiers, which fails the run otherwise).
func TestRunTiersGroups(t *testing.T) {
	path := t.TempDir() + "/conv.jsonl"
	require.NoError(t, writeFile(path, conversationTrace(4, 4)))
	for _, tt := range []struct {
		model, shrink, granule string
		extra                  []string
	}{
		{"gpt-oss-20b", "32", "64KiB", nil},
		{"gemma-3-27b", "512", "4KiB", []string{"-strategies", namePrefixTiers}}, // the tiered strategy alone
	} {
		t.Run(tt.model, func(t *testing.T) {
			args := append([]string{"-trace", path, "-model", tt.model, "-kv-shrink", tt.shrink, "-granule", tt.granule,
				"-max-tokens", "4096", "-system-prompt", "0", "-budget-ideal", "0.3333", "-tiers", "host", "-tier-wait", "10s",
				"-idle", "0", "-out", t.TempDir()}, tt.extra...)
			code, out, errOut := runArgs(t, args...)
			require.Equal(t, 0, code, errOut)
			for _, s := range []string{"Model:   " + tt.model + "/" + tt.shrink, "Tiers:   host (kvtier/hosttier", "vmarena+tiers", "checked"} {
				assert.Contains(t, out, s)
			}
			// Every lookup whose loads all succeeded started on what Probe said
			// just before (the table's "probe exact": exact / asked).
			m := probeExact.FindStringSubmatch(out)
			require.NotNil(t, m, "the tier table's probe column:\n%s", out)
			assert.NotEqual(t, "0", m[2], "lookups asked")
			assert.Equal(t, m[2], m[1], "lookups that started where Probe said, of those asked")
		})
	}
}

// probeExact finds the tiered strategy's "probe exact" column in the tier table:
// the lookups that started on what Probe said, and those asked.
var probeExact = regexp.MustCompile(`(?m)^\s*vmarena\+tiers\s.*\s(\d+) / (\d+)\s+\d+ tokens\s*$`)

// TestKVShrink: -kv-shrink divides every group's K/V heads, then head dim, keeps the
// groups' blocks in tokens on a granule as many times smaller, and refuses what it
// does not divide.
func TestKVShrink(t *testing.T) {
	m := kv.GPTOSS20B()
	g, groups, err := lookupModel(m.Name)
	require.NoError(t, err)
	sg, sm, err := withShrink(g, groups, 32)
	require.NoError(t, err)
	require.NotNil(t, sm)
	assert.Equal(t, "gpt-oss-20b/32", sm.Name)
	for i := range m.Groups {
		assert.Equal(t, m.Groups[i].BytesPerToken()/32, sm.Groups[i].BytesPerToken(), "group %d", i)
		assert.Equal(t, m.Groups[i].Window, sm.Groups[i].Window)
		assert.Equal(t, m.Groups[i].Layers, sm.Groups[i].Layers)
	}
	assert.Equal(t, g.BytesPerToken()/32, sg.BytesPerToken())
	big, err := m.Size(2<<20, 0, 8192)
	require.NoError(t, err)
	small, err := sm.Size(64<<10, 0, 8192)
	require.NoError(t, err)
	for i := range big.Groups {
		assert.Equal(t, big.Groups[i].BlockTokens, small.Groups[i].BlockTokens, "group %d's block", i)
	}
	checkUsage(t, []usageCase{
		{"not a power of two", []string{"-model", "gpt-oss-20b", "-kv-shrink", "3"}, "-kv-shrink 3: want a power of two"},
		{"too much", []string{"-model", "gpt-oss-20b", "-kv-shrink", "4096"}, "-kv-shrink 4096: gpt-oss-20b group 0 (8 K/V heads × head dim 64) is not divided by it"},
	})
}
