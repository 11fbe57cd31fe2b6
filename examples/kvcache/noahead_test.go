package main

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSplitAhead: a vmarena strategy's twin names it with map-ahead off; any other
// name is itself.
func TestSplitAhead(t *testing.T) {
	for _, tt := range []struct {
		name, base string
		off        bool
	}{
		{"vmarena", "vmarena", false},
		{"vmarena-noahead", "vmarena", true},
		{"vmarena+prefix-cache-noahead", "vmarena+prefix-cache", true},
		{"paged-noahead", "paged-noahead", false},
		{"vmarena+tiers-noahead", "vmarena+tiers-noahead", false},
		{"-noahead", "-noahead", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base, off := splitAhead(tt.name)
			assert.Equal(t, tt.base, base)
			assert.Equal(t, tt.off, off)
		})
	}
	assert.Equal(t, []string{"vmarena-noahead"}, aheadTwins(allStrategies))
	assert.Equal(t, []string{"vmarena+prefix-cache-noahead", "vmarena-noahead"}, aheadTwins(prefixStrategies))
}

// TestFairAheadTwins runs fair timing of map-ahead on against off: in the main
// replay, the prefix-cache replay (whose table has the decode step's p50 and p99)
// and on layer groups, where vmarena runs alone.
func TestFairAheadTwins(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		twin string
	}{
		{"main", small(t, "-rounds", "2", "-strategies", "vmarena,vmarena-noahead,paged"), "vmarena-noahead"},
		{"prefix cache", []string{"-trace", "mooncake", "-requests", "3", "-budget", "512MiB", "-rounds", "2",
			"-strategies", "vmarena+prefix-cache,vmarena+prefix-cache-noahead"}, "vmarena+prefix-cache-noahead"},
		{"layer groups", []string{"-model", "gpt-oss-20b", "-requests", "2", "-max-tokens", "2048", "-system-prompt", "64",
			"-idle", "0", "-rounds", "2", "-strategies", "vmarena,vmarena-noahead"}, "vmarena-noahead"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runArgs(t, tt.args...)
			require.Equal(t, 0, code, errOut)
			assert.Regexp(t, `(?m)^ +2 +`+regexp.QuoteMeta(tt.twin)+` +\S+`, out, "the twin's run in round 2")
			assert.Regexp(t, `over each strategy: [^\n]*\n +`+regexp.QuoteMeta(tt.twin)+`( |\n)`, out, "the first column of the ratios: on over off")
			for _, f := range []string{"memory", "step p50", "step p99"} {
				assert.Regexp(t, `(?m)^ *`+f+` +[0-9.]+x \[`, out, "%s: the ratio measured", f)
			}
		})
	}
}
