package main

import (
	"bytes"
	"io"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv/blockhash"
)

func loadTrace(t *testing.T, n int) []request {
	t.Helper()
	f, err := os.Open(testTrace)
	require.NoError(t, err)
	defer f.Close()
	reqs, err := readTrace(f, n)
	require.NoError(t, err)
	return reqs
}

// cachedKeys returns the router's keys of the blocks replica r's cache holds whole:
// of each replayed prompt, the full blocks of the prefix the cache holds, asked of
// the cache itself. Everything a replica caches is a prefix of a prompt it was sent.
func cachedKeys(c *cluster, r int, reqs []request) map[blockhash.Hash]bool {
	out := map[blockhash.Hash]bool{}
	for i := range reqs {
		tokens, _ := reqs[i].prompt(c.cfg.MaxTokens)
		// Match never counts a prompt's last token: one more makes it count them all.
		n := c.reps[r].pc.Match(append(slices.Clip(tokens), 0))
		for _, k := range c.idx.Keys(tokens[:n]) {
			out[k] = true
		}
	}
	return out
}

const testTrace = "../kvcache/testdata/mooncake-fast25-conversation.jsonl"

// diffKeys returns how many keys of want got lacks, and how many it has beyond them.
func diffKeys(want, got map[blockhash.Hash]bool) (missing, extra int) {
	for k := range want {
		if !got[k] {
			missing++
		}
	}
	for k := range got {
		if !want[k] {
			extra++
		}
	}
	return missing, extra
}

// TestIndexMatchesReplicas replays the start of the Mooncake trace across 4 replicas
// whose budgets make them evict, routed by prefix over ZMQ on loopback, and checks
// that the router's index then equals each replica's cache block for block, and so
// does the index of a router that subscribes only after the replay and catches up
// through the replay sockets.
func TestIndexMatchesReplicas(t *testing.T) {
	reqs := loadTrace(t, 80)
	cfg := simConfig{Replicas: 4, Budget: 6 << 20, Concurrency: 8, PrefillRate: 50000, Step: 25 * time.Millisecond, MaxTokens: 16384, BlockSize: 16}
	for _, mode := range []string{modePrefix, modeRoundRobin} {
		t.Run(mode, func(t *testing.T) {
			c, err := newCluster(cfg, mode, transportZMQ)
			require.NoError(t, err)
			defer func() { assert.NoError(t, c.close()) }()
			res, err := simulate(reqs, c.reps, c.policy(Scorer{PrefixWeight: 1, LoadWeight: 2, QueueThreshold: 8}), c.cfg)
			require.NoError(t, err)
			require.NoError(t, c.settle())
			assert.Positive(t, res.Hits)
			st := c.counts.stats()
			require.Positive(t, st.Removed, "the budgets made the replicas evict")

			late, err := NewIndex(cfg.Replicas, cfg.BlockSize, "router")
			require.NoError(t, err)
			var subs []*subscription
			for i, pub := range c.pubs {
				s, err := subscribe(late, i, pub, true)
				require.NoError(t, err)
				subs = append(subs, s)
			}
			require.NoError(t, caughtUp(subs, c.pubs, syncTimeout))
			for _, s := range subs {
				require.NoError(t, s.close())
			}
			total := 0
			for r := range c.reps {
				want := cachedKeys(c, r, reqs)
				total += len(want)
				missing, extra := diffKeys(want, c.idx.Held(r))
				assert.Zero(t, missing+extra, "replica %d: the router's index is its cache: %d blocks missing, %d extra of %d", r, missing, extra, len(want))
				missing, extra = diffKeys(want, late.Held(r))
				assert.Zero(t, missing+extra, "replica %d: so is a late router's, caught up by replay: %d blocks missing, %d extra", r, missing, extra)
			}
			assert.Positive(t, total)
			assert.Zero(t, c.idx.Errors())
			assert.Zero(t, late.Errors())
			assert.Positive(t, c.wire.bytes())
		})
	}
}

// TestModesReplay runs the command's three modes on a short replay, in process and
// over ZMQ, which must agree: the same events reach the index either way, so the
// same routing.
func TestModesReplay(t *testing.T) {
	reqs := loadTrace(t, 30)
	o := options{prefixWeight: 1, loadWeight: 2, queueThreshold: 8}
	cfg := simConfig{Replicas: 4, Budget: 8 << 20, Concurrency: 8, PrefillRate: 50000, Step: 25 * time.Millisecond, MaxTokens: 16384, BlockSize: 16}
	for _, mode := range []string{modePrefix, modeRoundRobin, modeSingle} {
		o.transport = transportDirect
		direct, err := runMode(reqs, cfg, mode, o)
		require.NoError(t, err, mode)
		o.transport = transportZMQ
		wired, err := runMode(reqs, cfg, mode, o)
		require.NoError(t, err, mode)
		assert.Equal(t, direct.simResult, wired.simResult, mode)
		assert.Equal(t, direct.events.Stored, wired.events.Stored, mode)
		assert.Positive(t, wired.events.Bytes, mode)
		assert.Positive(t, direct.Hits, mode)
	}
}

func TestRunShort(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run([]string{"-trace", testTrace, "-requests", "20", "-budget-mib", "32", "-transport", "direct"}, &out, io.Discard))
	for _, want := range []string{"by prefix", "round-robin", "one cache", "hit rate"} {
		assert.Contains(t, out.String(), want)
	}
}
