package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// prefixTrace is a small Mooncake trace whose requests share prefixes: B and C extend
// A's blocks, D shares only its first block, E repeats C.
const prefixTrace = `{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}
{"timestamp": 2000, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 4]}
{"timestamp": 4000, "input_length": 1300, "output_length": 2, "hash_ids": [1, 2, 3]}
{"timestamp": 6000, "input_length": 700, "output_length": 5, "hash_ids": [1, 9]}
{"timestamp": 8000, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]}
`

func prefixWorkload(t *testing.T) PrefixWorkload {
	reqs, err := ReadAnyTrace([]byte(prefixTrace))
	require.NoError(t, err)
	return PrefixWorkload{Requests: reqs, Speed: 1, Step: 25 * time.Millisecond, PrefillRate: DefaultPrefillRate,
		Concurrency: 8, MaxTokens: 4096, TokenBytes: testModel.Groups[0].TokenBytes(), Layers: testModel.Layers}
}

func TestIdealHits(t *testing.T) {
	w := prefixWorkload(t)
	var lengths []int
	for _, r := range w.Requests {
		lengths = append(lengths, r.Context)
	}
	// A: none; B: blocks 1, 2 (1,024); C: A's 1,100 (its block 3 held 76 tokens);
	// D: block 1 (512); E: C's 1,300 less its last token (1,299).
	assert.Equal(t, int64(1024+1100+512+1299), IdealHits(w.Requests, lengths))
	assert.Equal(t, int64(0), IdealHits(w.Requests[:1], lengths[:1]))
	// The ideal cache: blocks 1 and 2 whole (B's, C's, D's and E's hits read them),
	// and of block 3 the 275 tokens E's hit reads (C's read A's 76).
	hits, tokens := IdealCache(w.Requests, lengths)
	assert.Equal(t, IdealHits(w.Requests, lengths), hits)
	assert.Equal(t, int64(512+512+275), tokens)
	_, tokens = IdealCache(w.Requests[:2], lengths[:2])
	assert.Equal(t, int64(1024), tokens)
	// Served again after themselves, every prompt but its last token is a hit.
	var again int64
	for _, l := range lengths {
		again += int64(l - 1)
	}
	w.MaxTokens = 1 << 20
	assert.Equal(t, again, idealHitsAfter(w, 1))
}

// replayWhole builds strategy name's replica of s, replays w on it, closes it and
// checks that every byte came back to the governor: what the prefix replay's tests
// share before their own assertions.
func replayWhole(t *testing.T, name string, s setup, w PrefixWorkload) PrefixResult {
	t.Helper()
	st, gov, err := buildPrefixReplica(name, s, 0)
	require.NoError(t, err)
	r, err := ReplayPrefix(context.Background(), st, w, func(int) {})
	require.NoError(t, err, name)
	require.NoError(t, st.Close())
	for _, d := range gov.AllStats() {
		assert.Zero(t, d.Used, "%s: every byte came back", name)
	}
	return r
}

// TestReplayPrefix replays the small trace with no budget: vmarena's prefix cache
// finds every token an unbounded cache would, the paged one the whole 16-token blocks
// of them, and with the cache off nothing is found; prefilling less shortens the time
// to first token.
func TestReplayPrefix(t *testing.T) {
	w := prefixWorkload(t)
	s := testSetup(0)
	s.maxTokens = w.MaxTokens
	res := map[string]PrefixResult{}
	for _, name := range prefixStrategies {
		r := replayWhole(t, name, s, w)
		assert.Equal(t, len(w.Requests), r.Completed, name)
		assert.Equal(t, r.IdealHits, int64(1024+1100+512+1299), name)
		assert.LessOrEqual(t, r.Hits, r.IdealHits, name)
		res[name] = r
	}
	assert.Equal(t, res[namePrefixOn].IdealHits, res[namePrefixOn].Hits, "token-exact matching finds the ideal")
	assert.Equal(t, int64(1024+1088+512+1296), res[namePagedPC].Hits, "whole 16-token blocks")
	assert.Zero(t, res[namePrefixOff].Hits)
	assert.Less(t, res[namePrefixOn].TTFTP99, res[namePrefixOff].TTFTP99+time.Nanosecond)
	assert.Positive(t, res[namePrefixOn].CachedAfter)
	assert.LessOrEqual(t, float64(res[namePrefixOn].After-res[namePrefixOn].Trimmed), 1.2*float64(res[namePrefixOn].FloorAfter)+float64(3*testGranule),
		"held after the load: the cached tokens, packed but for each entry's last granule")
	var out bytes.Buffer
	printPrefixTable(&out, []PrefixResult{res[namePrefixOn], res[namePagedPC]})
	assert.Contains(t, out.String(), namePrefixOn)
}

func TestReplayPrefixBadWorkload(t *testing.T) {
	w := prefixWorkload(t)
	w.PrefillRate = 0
	st, _, err := buildPrefixReplica(namePagedPC, testSetup(0), 0)
	require.NoError(t, err)
	defer st.Close()
	_, err = ReplayPrefix(context.Background(), st, w, func(int) {})
	assert.ErrorContains(t, err, "prefill rate")
	_, _, err = buildPrefixReplica("nope", testSetup(0), 0)
	assert.ErrorContains(t, err, "unknown prefix-cache strategy")
}

// TestRunPrefixFlags: a Mooncake -trace selects the prefix-cache replay and its
// defaults; its strategies are checked against that replay's names.
func TestRunPrefixFlags(t *testing.T) {
	path := t.TempDir() + "/mooncake.jsonl"
	require.NoError(t, writeFile(path, prefixTrace))
	var out, errOut bytes.Buffer
	dir := t.TempDir()
	code := run(context.Background(), []string{"-trace", path, "-model", "tiny", "-budget", "0", "-progress", "none", "-out", dir}, &out, &errOut)
	require.Equal(t, 0, code, errOut.String())
	for _, f := range []string{"kvcache-prefix-memory.png", "kvcache-prefix-hits.png"} {
		fi, err := os.Stat(dir + "/" + f)
		require.NoError(t, err)
		assert.Positive(t, fi.Size())
	}
	for _, name := range prefixStrategies {
		assert.Contains(t, out.String(), name)
	}
	assert.Contains(t, out.String(), "prefix-cache replay")
	out.Reset()
	errOut.Reset()
	code = run(context.Background(), []string{"-trace", path, "-strategies", "eager"}, &out, &errOut)
	assert.Equal(t, 2, code)
	assert.True(t, strings.Contains(errOut.String(), "unknown strategy \"eager\""), errOut.String())
}

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o644) }

// TestReplayPrefixLoneRequestThatCanNotDecode: a request alone in the batch whose
// prompt fills the budget to the byte, so that its first decode step can never fit,
// is refused (and the replay ends) rather than preempted and waited on forever.
func TestReplayPrefixLoneRequestThatCanNotDecode(t *testing.T) {
	const prompt = 1024 // 32 granules of the test model, exactly
	reqs, err := ReadAnyTrace([]byte(fmt.Sprintf(`{"timestamp": 0, "input_length": %d, "output_length": 3, "hash_ids": [1, 2]}`+"\n", prompt)))
	require.NoError(t, err)
	w := PrefixWorkload{Requests: reqs, Speed: 1, Step: 25 * time.Millisecond, PrefillRate: DefaultPrefillRate,
		Concurrency: 4, MaxTokens: 4096, TokenBytes: testModel.Groups[0].TokenBytes(), Layers: testModel.Layers}
	s := testSetup(int64(prompt * testModel.BytesPerToken()))
	s.maxTokens = w.MaxTokens
	for _, name := range []string{namePrefixOn, namePrefixOff} {
		st, _, err := buildPrefixReplica(name, s, 0)
		require.NoError(t, err)
		// Not a timing check: a guard, so that the bug fails the test instead of
		// hanging it (the replay's model clock runs on with nothing to do).
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		res, err := ReplayPrefix(ctx, st, w, func(int) {})
		cancel()
		require.NoError(t, st.Close())
		require.NoError(t, err, name)
		assert.Equal(t, 1, res.Rejected, name)
		assert.Zero(t, res.Completed, name)
	}
}

// tinyWindowModel is gpt-oss's pattern in small: sliding-window layers (a window of
// 128) beside full ones.
var tinyWindowModel = kv.Model{Name: "tiny-oss", Layers: 4, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 128, Layers: []int{0, 2}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{1, 3}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
}}

// TestReplayPrefixGroups: on a model of window groups beside full ones, vmarena's
// prefix cache with no budget finds every hit an unbounded cache finds (its entries
// keep every window unit their prompts held), every hit token of every layer reads
// back as written for its prefix (a window layer's from what the step after the hit
// reads), and under a budget it finds no more; every byte comes back.
func TestReplayPrefixGroups(t *testing.T) {
	w := prefixWorkload(t)
	m := tinyWindowModel
	w.Plan, w.Layers, w.TokenBytes, w.Verify = planLayers(&m), m.Layers, m.Groups[0].TokenBytes(), true
	for _, budget := range []int64{0, 4 << 20} {
		t.Run(fmt.Sprint("budget=", budget), func(t *testing.T) {
			s := testSetup(budget)
			s.maxTokens = w.MaxTokens
			s.model = kv.Uniform(m.Name, m.Layers, 2, 32, arena.Float16)
			s.groups = &m
			r := replayWhole(t, namePrefixOn, s, w)
			assert.Equal(t, len(w.Requests), r.Completed)
			assert.Equal(t, int64(1024+1100+512+1299), r.IdealHits)
			if budget == 0 {
				assert.Equal(t, r.IdealHits, r.Hits, "an unbounded cache under hybrid rules finds the ideal")
			} else {
				assert.LessOrEqual(t, r.Hits, r.IdealHits)
			}
			assert.Equal(t, r.Hits, r.Verified, "every hit token was read back")
		})
	}
}

// TestRunPrefixGroups runs the prefix-cache replay from the command line on
// gpt-oss-20b with no budget: vmarena with its cache finds the unbounded ideal, and
// -verify reads every hit token back.
func TestRunPrefixGroups(t *testing.T) {
	code, out, errOut := runArgs(t, "-trace", "mooncake", "-model", "gpt-oss-20b", "-kv-dtype", "fp8", "-requests", "6",
		"-max-tokens", "2048", "-budget", "0", "-verify", "-progress", "none", "-out", t.TempDir())
	require.Equal(t, 0, code, errOut)
	row := regexp.MustCompile(`(?m)^ *vmarena\+prefix-cache +([0-9.]+%) +([0-9.]+%) .* 6/6 *$`).FindStringSubmatch(out)
	require.Len(t, row, 3, out)
	assert.Equal(t, row[2], row[1], "the hit rate is the unbounded cache's")
	assert.NotEqual(t, "0.00%", row[1], "some prompt was hit")
	assert.Regexp(t, `vmarena\+prefix-cache: [1-9][0-9]* hit tokens read back`, out)
	assert.Contains(t, out, "Groups:  2 groups: sliding-window 128 ×12, full ×12;")

	// -uniform: the same model with every layer full attention, for comparison.
	code, out, errOut = runArgs(t, "-trace", "mooncake", "-model", "gpt-oss-20b", "-uniform", "-kv-dtype", "fp8", "-requests", "6",
		"-max-tokens", "2048", "-budget", "0", "-progress", "none", "-out", t.TempDir())
	require.Equal(t, 0, code, errOut)
	assert.Contains(t, out, "Groups:  2 groups: full ×12, full ×12;")
	uni := regexp.MustCompile(`(?m)^ *vmarena\+prefix-cache +([0-9.]+%) +([0-9.]+%) .* 6/6 *$`).FindStringSubmatch(out)
	require.Len(t, uni, 3, out)
	assert.Equal(t, row[1], uni[1], "unbounded, both find the ideal")
}
