package main

import (
	"bytes"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestReadingLine says what the main replay's tables mean from the run's own figures,
// and nothing where there is nothing to compare.
func TestReadingLine(t *testing.T) {
	cache := Result{Strategy: nameCache, PeakPhysical: 101, PeakNeeded: 100, IdleFor: 6 * time.Second, IdleEnd: 0}
	eager := Result{Strategy: nameEager, PeakPhysical: 224, PeakNeeded: 100}
	paged := Result{Strategy: namePaged, PeakPhysical: 101, PeakNeeded: 100, IdleFor: 6 * time.Second, IdleEnd: 3 << 30}
	line := readingLine([]Result{cache, eager, paged})
	assert.Contains(t, line, "vmarena 1.01x, eager 2.24x (a whole window per request), paged 1.01x")
	assert.Contains(t, line, "0 B left after 6s")
	assert.Contains(t, line, "paged keeps its pool (3 GiB)")
	assert.NotContains(t, line, "append", "no strategy that did not run")
	assert.Empty(t, readingLine([]Result{eager}), "nothing to compare vmarena with")

	groups := cache
	groups.IdleFor = 0
	groups.GroupPeak, groups.UniformPeak = []int64{1, 3}, []int64{3, 3}
	assert.Contains(t, readingLine([]Result{groups}), "uniform full-attention cache of the same sequences: 0.67x")

	var out bytes.Buffer
	cache.Verified = Verified{Sequences: 2, Tokens: 30, Reads: 120, States: 4}
	printTable(&out, []Result{cache}, testSetup(0))
	assert.Contains(t, out.String(), "Verified: vmarena read back 2 sequences before each closed, 30 tokens: 120 token reads (K, V or latent, one layer each) and 4 recurrent states, every byte as written")
	assert.Contains(t, out.String(), "Reading: ")
}

// TestPrefixReadingLine compares the hit rate with the ideal, and with tiers says what
// they added.
func TestPrefixReadingLine(t *testing.T) {
	on := PrefixResult{Strategy: namePrefixOn, Queries: 1000, Hits: 66, IdealHits: 130}
	tiers := PrefixResult{Strategy: namePrefixTiers, Queries: 1000, Hits: 99, IdealHits: 130}
	line := prefixReadingLine([]PrefixResult{on, tiers}, false)
	assert.Contains(t, line, "found 6.60% of the prompt tokens cached; an unbounded cache would find 13.00% (ideal), so the budget cost 49.2% of the possible hits")
	assert.NotContains(t, line, namePrefixTiers)
	assert.Contains(t, prefixReadingLine([]PrefixResult{on, tiers}, true), "vmarena+tiers found 9.90%")
	assert.Empty(t, prefixReadingLine([]PrefixResult{{Strategy: namePagedPC, Queries: 10}}, false))
}

// TestDefaultOut puts the plots under the current directory, one directory per kind of
// run.
func TestDefaultOut(t *testing.T) {
	for _, tt := range []struct {
		name string
		c    config
		s    setup
		want string
	}{
		{"default", config{model: "llama3-8b"}, setup{}, "azure-conv-llama3-8b"},
		{"mooncake with tiers", config{trace: mooncakeFlag, model: "tiny"}, setup{tiers: &tierSetup{}}, "mooncake-tiny-tiers"},
		{"a file and a KV type", config{trace: "/data/my.trace.csv", model: "gpt-oss-20b", kvDType: "fp8", set: map[string]bool{"kv-dtype": true}}, setup{}, "my.trace-gpt-oss-20b-fp8"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, filepath.Join(plotsDir, tt.want), defaultOut(&tt.c, tt.s))
		})
	}
}
