package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/internal/testutil/promtest"
)

// TestMetricsDuringReplay scrapes /metrics over localhost at every progress report of
// a replay under a budget, and after it, and checks what it reads against the
// replay's own samples and results.
func TestMetricsDuringReplay(t *testing.T) {
	ms, err := startMetrics("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { assert.NoError(t, ms.Close()) }()
	url := "http://" + ms.Addr() + "/metrics"
	w := testWorkload(t, 40)
	free, err := replayOne(context.Background(), nameCache, testSetup(0), w, nopProgress{}, nil)
	require.NoError(t, err)
	budget := free.PeakPhysical * 6 / 10 // memory refuses some requests for a while
	s := testSetup(budget)
	s.metrics = ms

	for _, name := range []string{nameCache, namePaged} {
		scrapes := 0
		watch := func(st baseline.Strategy, smp Sample) {
			got := promtest.Scrape(t, url)
			scrapes++
			dev := "device=host:0,strategy=" + name
			assert.Equal(t, float64(budget), got["vmarena_governor_limit_bytes{"+dev+"}"], name)
			// NB: the replay waits for this report, but the pool's decay runs beside it
			// and may give idle granules back between the sample and the scrape (a slow
			// run leaves some unused for the decay period): the governor only falls
			// meanwhile, so what the scrape read lies between the sample and a reading
			// after it, and equals both when nothing decayed.
			after := st.Stats().Physical
			used := got["vmarena_governor_used_bytes{"+dev+"}"]
			assert.LessOrEqual(t, used, float64(smp.Physical), "%s: used bytes <= the sample's physical", name)
			assert.GreaterOrEqual(t, used, float64(after), "%s: used bytes >= the physical after the scrape", name)
			if after == smp.Physical {
				assert.Equal(t, float64(smp.Physical), used, "%s: used bytes = the sample's physical", name)
			}
			if name != nameCache {
				_, ok := got["vmarena_kv_sequences{cache="+name+",strategy="+name+"}"]
				assert.False(t, ok, "a baseline has no kv cache")
				return
			}
			cache := "cache=" + name + ",strategy=" + name
			assert.Equal(t, float64(smp.Live), got["vmarena_kv_sequences{"+cache+"}"], "live sequences")
			assert.Equal(t, float64(smp.Saved), got["vmarena_kv_saved_by_sharing_bytes{"+cache+"}"], "saved by sharing")
			usage := got["vmarena_kv_cache_usage_perc{"+cache+"}"]
			assert.Greater(t, usage, 0.0)
			assert.LessOrEqual(t, usage, float64(smp.Physical)/float64(budget), "usage leaves idle pool granules out")
		}
		r, err := replayOne(context.Background(), name, s, w, nopProgress{}, watch)
		require.NoError(t, err, name)
		checkEnd(t, r)
		assert.Equal(t, r.Requests, scrapes, "one scrape per progress report: per request done")

		// After the run the strategy's series stay: they say how it ended.
		got := promtest.Scrape(t, url)
		dev := "device=host:0,strategy=" + name
		assert.Equal(t, float64(r.PeakPhysical), got["vmarena_governor_peak_bytes{"+dev+"}"], "%s: peak = the table's", name)
		assert.Equal(t, float64(r.GovernorAfter), got["vmarena_governor_used_bytes{"+dev+"}"], name)
		t.Logf("%s: %d requests refused by memory, %v governor refusals, %v waits", name, r.MemoryRefused,
			got["vmarena_governor_refusals_total{"+dev+"}"], got["vmarena_governor_wait_seconds_count{"+dev+"}"])
		require.Positive(t, r.MemoryRefused, "%s: the budget refused some requests", name)
		if name == namePaged {
			// The paged baseline asks the governor for every chunk.
			assert.Positive(t, got["vmarena_governor_refusals_total{"+dev+"}"], "the paged run's refusals were the governor's")
		} else {
			// vmarena's cache refuses what can not fit before it asks the governor.
			cache := "cache=" + name + ",strategy=" + name
			assert.GreaterOrEqual(t, got["vmarena_kv_refusals_total{"+cache+"}"], float64(r.MemoryRefused), "a refused request was refused once at least")
			assert.Zero(t, got["vmarena_kv_sequences{"+cache+"}"])
			assert.Zero(t, got["vmarena_kv_unreleased_bytes{"+cache+"}"])
		}
		if name == nameCache && r.PoolAfter != nil {
			pool := "device=host:0,pool=" + name + ",strategy=" + name
			assert.GreaterOrEqual(t, got["vmarena_pool_granules_created_total{"+pool+"}"], float64(r.PoolAfter.Created))
			assert.Zero(t, got["vmarena_pool_mapped_bytes{"+pool+"}"])
			assert.Zero(t, got["vmarena_pool_owned_bytes{"+pool+"}"], "Close gave every granule back")
			assert.Equal(t, got["vmarena_pool_granules_created_total{"+pool+"}"], got["vmarena_pool_granules_given_back_total{"+pool+"}"])
		}
		for k := range got {
			if strings.Contains(k, "strategy=") {
				assert.Contains(t, k, "strategy="+name, "only the strategy replaying now is served")
			}
		}
	}
}

func TestRunMetricsFlag(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"-metrics", "127.0.0.1:0", "-requests", "5", "-strategies", "vmarena",
		"-model", "tiny", "-max-tokens", "2048", "-system-prompt", "64", "-progress", "none", "-out", t.TempDir()}, &out, &errb)
	require.Equal(t, 0, code, errb.String())
	assert.Regexp(t, `Serving metrics at http://127\.0\.0\.1:\d+/metrics`, out.String())

	code = run(context.Background(), []string{"-metrics", "127.0.0.1:notaport", "-requests", "5", "-progress", "none"}, &out, &errb)
	assert.Equal(t, 1, code)
	assert.Contains(t, errb.String(), `kvcache: -metrics "127.0.0.1:notaport"`)
}
