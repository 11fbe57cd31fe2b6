package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// conversationTrace is a Mooncake trace of convs conversations of turns turns each,
// interleaved: turn k of a conversation repeats its k+1 blocks of the turn before
// and adds one, so each request reuses its conversation's last prompt, which
// convs-1 other prompts came after.
func conversationTrace(convs, turns int) string {
	var b strings.Builder
	at := 0
	for k := range turns {
		for c := range convs {
			ids := make([]string, k+2)
			for i := range ids {
				ids[i] = fmt.Sprint(1000*(c+1) + i)
			}
			fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": 2, "hash_ids": [%s]}`+"\n",
				at, (k+2)*MooncakeBlockTokens, strings.Join(ids, ", "))
			at += 500
		}
	}
	return b.String()
}

// tierModel is the test model with two layers: every token is written and every
// hit read back token by token, which -race makes slow.
var tierModel = kv.Uniform(testModel.Name, 2, testModel.Groups[0].KVHeads, testModel.Groups[0].HeadDim, testModel.Groups[0].DType)

// tierWorkload is conversationTrace(4, 4) on tierModel.
func tierWorkload(t *testing.T) PrefixWorkload {
	reqs, err := ReadAnyTrace([]byte(conversationTrace(4, 4)))
	require.NoError(t, err)
	return PrefixWorkload{Requests: reqs, Speed: 1, Step: 25 * time.Millisecond, PrefillRate: DefaultPrefillRate,
		Concurrency: 4, MaxTokens: 4096, TokenBytes: tierModel.Groups[0].TokenBytes(), Layers: tierModel.Layers, Verify: true}
}

// tierTestSetup is the test setup at a third of w's ideal cache, with tiers (a
// host tier of the same budget) and the redis-server they start.
func tierTestSetup(t *testing.T, w PrefixWorkload, order []string, replicas, killAt int) setup {
	t.Helper()
	_, ideal := idealCacheBytes(w)
	s := testSetup(ideal / 3)
	s.model, s.maxTokens = tierModel, w.MaxTokens
	// A wait no loaded machine runs out of, so that what the tiers give does not
	// depend on the load (a server down fails at once, not at the wait).
	s.tiers = &tierSetup{order: order, replicas: replicas, killAt: killAt, wait: 10 * time.Second}
	if s.tiers.has(tierHost) {
		s.tiers.hostBudget = s.budget
	}
	require.NoError(t, s.tiers.connect())
	t.Cleanup(func() { assert.NoError(t, s.tiers.close()) })
	return s
}

// replayTiers replays w on replica r of name and checks what every replay must
// give: no request failed or refused, every byte read back right (the replay's own
// check), and the ledgers exact after Close (replayPrefixReplica's check, which
// covers the host tier's budget too).
func replayTiers(t *testing.T, name string, s setup, w PrefixWorkload, r int) PrefixResult {
	t.Helper()
	res, err := replayPrefixReplica(context.Background(), name, s, w, r)
	require.NoError(t, err, name)
	require.Equal(t, len(w.Requests), res.Completed, "%s: every request completed", name)
	assert.Zero(t, res.Rejected, name)
	assert.LessOrEqual(t, res.Hits, res.IdealHits, name)
	if res.Hits > 0 {
		assert.GreaterOrEqual(t, res.Verified, res.Hits, "%s: every hit token was read back and compared", name)
	}
	return res
}

// hostAndRedis returns the tier tests' workload and a set-up of replicas replicas
// over a host tier and Redis below it; the test is skipped without redis-server.
func hostAndRedis(t *testing.T, replicas int) (PrefixWorkload, setup) {
	t.Helper()
	testutil.NeedRedis(t)
	w := tierWorkload(t)
	return w, tierTestSetup(t, w, []string{tierHost, tierRedis}, replicas, 0)
}

// TestReplayTiers: at a third of the ideal cache the device alone loses hits; with
// a host tier and Redis below it the cache gets some back, each tier's share
// counted, and every token read back after a hit from either tier is the one
// written for it.
func TestReplayTiers(t *testing.T) {
	w, s := hostAndRedis(t, 1)
	off := replayTiers(t, namePrefixOn, s, w, 0)
	on := replayTiers(t, namePrefixTiers, s, w, 0)
	require.Less(t, off.Hits, off.IdealHits, "the device alone loses hits at this budget")
	assert.Nil(t, off.TierHits)
	require.Len(t, on.TierHits, 2)
	require.Len(t, on.Tiers, 2)
	assert.Greater(t, on.Hits, off.Hits, "the tiers give hits back")
	assert.Positive(t, on.TierHits[0]+on.TierHits[1])
	assert.Positive(t, on.EvictedTokens)
	for i, ts := range on.Tiers {
		assert.Equal(t, on.TierHits[i], ts.Hits, ts.Name)
		assert.Positive(t, on.WrittenTokens[i], ts.Name)
		assert.LessOrEqual(t, on.WrittenTokens[i], on.EvictedTokens, "%s: only evicted blocks are written down", ts.Name)
		assert.Positive(t, ts.StoreBytes, "%s: evictions were written down", ts.Name)
		assert.Zero(t, ts.Invalid, ts.Name)
	}
	assert.Zero(t, on.ForeignLoads, "one replica")
}

// TestReplayTierPolicies: the reuse threshold stores only the blocks of entries hit
// twice, fewer than write-back stores; each policy's every hit token reads back right
// and its ledgers are exact (replayTiers). NB: write-through runs in TestRunTierPolicy
// only: entries held busy by their background stores can not be evicted for a lone
// request's step, which the replay then refuses (docs/benchmarks/tiers.md: write-back,
// write-through and the reuse threshold), so that its requests do not all complete.
func TestReplayTierPolicies(t *testing.T) {
	w := tierWorkload(t)
	s := tierTestSetup(t, w, []string{tierHost}, 1, 0)
	back := replayTiers(t, namePrefixTiers, s, w, 0)
	s.tiers.minHits = 2
	twice := replayTiers(t, namePrefixTiers, s, w, 0)
	require.Positive(t, back.Tiers[0].StoreBytes)
	assert.Less(t, twice.Tiers[0].StoreBytes, back.Tiers[0].StoreBytes, "only entries hit twice go down")
	for _, r := range []PrefixResult{back, twice} {
		assert.Zero(t, r.Tiers[0].Invalid)
	}
}

// TestTierOptions: the tier flags reach the prefix cache's options.
func TestTierOptions(t *testing.T) {
	b := builtTiers{tiers: []kv.Tier{nil}}
	for _, ts := range []tierSetup{{}, {through: true}, {minHits: 3, wait: time.Second}, {through: true, minHits: 2}} {
		o := ts.options(b)
		assert.Equal(t, ts.through, o.TierWriteThrough)
		assert.Equal(t, ts.minHits, o.TierMinHits)
		assert.Equal(t, ts.wait, o.TierWait)
		assert.Equal(t, b.tiers, o.Tiers)
	}
}

// TestRunTierPolicy runs write-through and the reuse threshold through the command
// line: the header says the policy, and without write-through every request
// completes at the whole ideal cache. NB: with write-through a request may be
// refused, as the replay's write-through figures in BENCHMARKS.md show: how many
// depends on how long the background stores hold their entries busy.
func TestRunTierPolicy(t *testing.T) {
	path := t.TempDir() + "/conv.jsonl"
	require.NoError(t, writeFile(path, conversationTrace(4, 4)))
	for _, tc := range []struct {
		args   []string
		policy string
	}{
		{nil, "; write-back\n"},
		{[]string{"-tier-write-through"}, "; write-through\n"},
		{[]string{"-tier-write-through", "-tier-min-hits", "2"}, "; write-through, entries hit 2 times\n"},
		{[]string{"-tier-min-hits", "1"}, "; write-back, entries hit 1 times\n"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			args := append([]string{"-trace", path, "-model", "tiny", "-granule", "64KiB", "-max-tokens", "4096",
				"-budget-ideal", "1", "-tiers", "host", "-out", t.TempDir()}, tc.args...)
			code, out, errOut := runArgs(t, args...)
			require.Equal(t, 0, code, errOut)
			assert.Contains(t, out, tc.policy)
			if !slices.Contains(tc.args, "-tier-write-through") {
				assert.NotContains(t, out, "rejected")
				assert.Contains(t, out, "16/16")
			}
		})
	}
}

// TestReplayReplicas: replica B, with a cache and a host tier of its own, loads
// from Redis what replica A stored there.
func TestReplayReplicas(t *testing.T) {
	w, s := hostAndRedis(t, 2)
	a := replayTiers(t, namePrefixTiers, s, w, 0)
	b := replayTiers(t, namePrefixTiers, s, w, 1)
	assert.Zero(t, a.ForeignLoads, "A is first")
	assert.Positive(t, b.TierHits[1], "B's hits from Redis")
	assert.Positive(t, b.ForeignLoads, "B loaded blocks A stored")
	assert.Greater(t, b.Hits, a.Hits, "B starts where A left Redis")
}

// TestReplayRedisKilled kills the redis-server in the middle of the replay: no
// request fails, no byte read back is wrong, the stores after it are dropped and
// counted, and the ledgers are exact at the end.
func TestReplayRedisKilled(t *testing.T) {
	testutil.NeedRedis(t)
	w := tierWorkload(t)
	killAt := len(w.Requests) / 2
	s := tierTestSetup(t, w, []string{tierRedis}, 1, killAt)
	res := replayTiers(t, namePrefixTiers, s, w, 0)
	require.True(t, s.tiers.server.killed(), "the server was killed")
	require.Len(t, res.Tiers, 1)
	assert.Positive(t, res.Tiers[0].Drops, "stores and loads after the kill are dropped, counted")
	assert.Zero(t, res.Tiers[0].Invalid)
}

// TestRunTiers runs -tiers through the command line: both replicas, the tier table,
// and a redis-server started and stopped by the example.
func TestRunTiers(t *testing.T) {
	testutil.NeedRedis(t)
	path := t.TempDir() + "/conv.jsonl"
	require.NoError(t, writeFile(path, conversationTrace(4, 4)))
	code, out, errOut := runArgs(t, "-trace", path, "-model", "tiny", "-granule", "64KiB", "-max-tokens", "4096",
		"-budget-ideal", "1", "-tiers", "host,redis", "-replicas", "2", "-redis-kill-at", "12", "-tier-wait", "1s", "-out", t.TempDir())
	require.Equal(t, 0, code, errOut)
	for _, s := range []string{"Budget:  1 of the ideal cache", "Tiers:   host (kvtier/hosttier", "redis-server started here",
		"vmarena+tiers/A", "vmarena+tiers/B", "from another replica", "written down", "redis-server was killed once 12 requests"} {
		assert.Contains(t, out, s)
	}
	assert.NotContains(t, out, "vmarena  ", "the cache-off strategy is not run by default with -tiers")
}

// TestRunTierFlags: the tier flags' bad inputs are refused with what is wrong, and
// nothing is replayed.
func TestRunTierFlags(t *testing.T) {
	path := t.TempDir() + "/mooncake.jsonl"
	require.NoError(t, writeFile(path, prefixTrace))
	mc := []string{"-trace", path}
	tests := []usageCase{
		{"unknown tier", append(mc, "-tiers", "host,disk"), `-tiers "host,disk": unknown tier "disk" (known: host, redis, file)`},
		{"tier twice", append(mc, "-tiers", "redis,redis"), `-tiers "redis,redis": redis twice`},
		{"empty tier", append(mc, "-tiers", "host,"), `unknown tier ""`},
		{"tiers without token IDs", []string{"-tiers", "host"}, "-tiers needs a trace with token IDs (-trace mooncake)"},
		{"tiers per-layer", append(mc, "-tiers", "host", "-layout", "per-layer"), "-tiers stores whole blocks, which only -layout blocked"},
		{"tiers with rounds", append(mc, "-tiers", "host", "-rounds", "2"), "-tiers can not be used with -rounds 2"},
		{"host budget without tiers", append(mc, "-host-tier-budget", "1GiB"), "-host-tier-budget needs -tiers"},
		{"host budget without host", append(mc, "-tiers", "redis", "-host-tier-budget", "1GiB"), "-host-tier-budget needs host in -tiers"},
		{"host tier without a budget", append(mc, "-tiers", "host", "-budget", "0"), "-tiers host needs a budget"},
		{"bad host budget", append(mc, "-tiers", "host", "-host-tier-budget", "lots"), `"lots" is not a size`},
		{"redis without tiers", append(mc, "-redis", "127.0.0.1:6379"), "-redis needs -tiers"},
		{"redis without redis", append(mc, "-tiers", "host", "-redis", "127.0.0.1:6379"), "-redis needs redis in -tiers"},
		{"redis not host:port", append(mc, "-tiers", "redis", "-redis", "localhost"), `-redis "localhost": want host:port`},
		{"negative kill", append(mc, "-tiers", "redis", "-redis-kill-at", "-1"), "-redis-kill-at -1 is negative"},
		{"negative tier wait", append(mc, "-tiers", "redis", "-tier-wait", "-1s"), "-tier-wait -1s is negative"},
		{"tier wait without tiers", append(mc, "-tier-wait", "1s"), "-tier-wait needs -tiers"},
		{"write-through without tiers", append(mc, "-tier-write-through"), "-tier-write-through needs -tiers"},
		{"min hits without tiers", append(mc, "-tier-min-hits", "2"), "-tier-min-hits needs -tiers"},
		{"negative min hits", append(mc, "-tiers", "host", "-tier-min-hits", "-1"), "-tier-min-hits -1 is negative"},
		{"min hits not a number", append(mc, "-tiers", "host", "-tier-min-hits", "two"), `invalid value "two" for flag -tier-min-hits`},
		{"write-through not a bool", append(mc, "-tiers", "host", "-tier-write-through=maybe"), `invalid boolean value "maybe" for -tier-write-through`},
		{"kill without redis", append(mc, "-tiers", "host", "-redis-kill-at", "2"), "-redis-kill-at needs redis in -tiers"},
		{"kill a given server", append(mc, "-tiers", "redis", "-redis", "127.0.0.1:6379", "-redis-kill-at", "2"), "-redis-kill-at kills the redis-server the example starts"},
		{"kill past the end", append(mc, "-tiers", "redis", "-redis-kill-at", "6"), "-redis-kill-at 6: the replay has only 5 requests"},
		{"replicas without tiers", append(mc, "-replicas", "2"), "-replicas needs -tiers"},
		{"three replicas", append(mc, "-tiers", "host,redis", "-replicas", "3"), "-replicas 3: want 1 or 2"},
		{"replicas without redis", append(mc, "-tiers", "host", "-replicas", "2"), "-replicas 2 share a Redis: -tiers must name redis"},
		{"tiers strategy without tiers", append(mc, "-strategies", namePrefixTiers), `unknown strategy "vmarena+tiers"`},
		{"negative ideal budget", append(mc, "-budget-ideal", "-0.5"), "-budget-ideal -0.5: want a positive fraction"},
		{"NaN ideal budget", append(mc, "-budget-ideal", "NaN"), "-budget-ideal NaN: want a positive fraction"},
		{"ideal budget and budget", append(mc, "-budget-ideal", "0.3", "-budget", "1GiB"), "-budget-ideal 0.3 and -budget 1 GiB both set the budget"},
		{"ideal budget without token IDs", []string{"-budget-ideal", "0.3"}, "-budget-ideal needs a trace with token IDs"},
	}
	checkUsage(t, tests)
}

// TestRunTiersNoRedisServer: -tiers redis with no -redis and no redis-server to
// start fails with what to install, before anything replays.
func TestRunTiersNoRedisServer(t *testing.T) {
	path := t.TempDir() + "/mooncake.jsonl"
	require.NoError(t, writeFile(path, prefixTrace))
	t.Setenv("PATH", t.TempDir())
	code, out, errOut := runArgs(t, "-trace", path, "-tiers", "redis", "-out", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "apt-get install redis-server")
	assert.NotContains(t, out, namePrefixTiers+" ...")
}

// TestRunTiersRedisDown: a -redis address nothing answers on is refused at the
// start, not counted as misses through the whole replay.
func TestRunTiersRedisDown(t *testing.T) {
	path := t.TempDir() + "/mooncake.jsonl"
	require.NoError(t, writeFile(path, prefixTrace))
	code, _, errOut := runArgs(t, "-trace", path, "-tiers", "redis", "-redis", "127.0.0.1:1", "-out", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "-redis 127.0.0.1:1:")
}

// corrupting reads back a byte flipped at one token of every hit.
type corrupting struct{ pstrategy }

func (c corrupting) readToken(s pseq, layer, v, token int, dst []byte) error {
	err := c.pstrategy.readToken(s, layer, v, token, dst)
	if layer == 1 && v == 1 && token == 3 {
		dst[len(dst)/2] ^= 1
	}
	return err
}

// TestVerifyCatchesWrongBytes: the replay's check of the bytes it reads back fails
// the replay when one byte of a hit differs, and passes it otherwise.
func TestVerifyCatchesWrongBytes(t *testing.T) {
	w := prefixWorkload(t)
	w.Verify = true
	s := testSetup(0)
	s.maxTokens = w.MaxTokens
	for _, bad := range []bool{false, true} {
		st, _, err := buildPrefixReplica(namePrefixOn, s, 0)
		require.NoError(t, err)
		if bad {
			st = corrupting{st}
		}
		res, err := ReplayPrefix(context.Background(), st, w, func(int) {})
		require.NoError(t, st.Close())
		if bad {
			assert.ErrorIs(t, err, errWrongBytes)
			assert.ErrorContains(t, err, "token 3 of layer 1 (V)")
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, res.IdealHits, res.Verified, "every hit token compared")
	}
}
