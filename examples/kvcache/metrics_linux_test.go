package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/testutil/promtest"
)

// TestMetricsPrefixReplay scrapes the prefix-cache replay: vLLM's token counters read
// what the replay's own table says.
func TestMetricsPrefixReplay(t *testing.T) {
	ms, err := startMetrics("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { assert.NoError(t, ms.Close()) }()
	w := prefixWorkload(t)
	s := testSetup(0)
	s.maxTokens = w.MaxTokens
	s.metrics = ms
	for _, name := range []string{namePrefixOn, namePrefixOff} {
		st, gov, err := buildPrefixReplica(name, s, 0)
		require.NoError(t, err)
		require.NoError(t, ms.watch(name, gov, accounting.HostKey, st))
		r, err := ReplayPrefix(context.Background(), st, w, func(int) {})
		require.NoError(t, err, name)
		got := promtest.Scrape(t, "http://"+ms.Addr()+"/metrics")
		require.NoError(t, st.Close())
		cache := "cache=" + name + ",strategy=" + name
		q, hasPC := got["vmarena_prefix_cache_queries_total{"+cache+"}"]
		if name == namePrefixOff {
			assert.False(t, hasPC, "no prefix cache, no prefix-cache series")
			continue
		}
		assert.Equal(t, float64(r.Queries), q)
		assert.Equal(t, float64(r.Hits), got["vmarena_prefix_cache_hits_total{"+cache+"}"])
		assert.Equal(t, float64(r.CachedAfter), got["vmarena_prefix_cache_cached_bytes{"+cache+"}"], "after the load: the table's cached bytes")
		assert.Zero(t, got["vmarena_kv_cache_usage_perc{"+cache+"}"], "no live sequence: nothing in use")
	}
}
