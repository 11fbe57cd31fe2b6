package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

func TestModelFlagBadInputs(t *testing.T) {
	hybrid := []string{"-model", "gpt-oss-20b", "-requests", "2", "-idle", "0", "-out", t.TempDir()}
	tests := []usageCase{
		{"unknown model lists both kinds", []string{"-model", "gpt-5"}, `unknown model preset "gpt-5" (known: llama3-8b,`},
		{"MLA with a baseline", []string{"-model", "deepseek-v3", "-strategies", "eager"}, "-model deepseek-v3 (1 groups: mla-latent ×61): strategy eager models full attention only"},
		{"recurrent with a baseline", []string{"-model", "qwen3-next-80b-a3b", "-strategies", "vmarena,append"}, "strategy append models full attention only"},
		{"a full-attention baseline", append(hybrid, "-strategies", "vmarena,paged,eager"),
			"-model gpt-oss-20b (2 groups: sliding-window 128 ×12, full ×12): strategy eager models full attention only, and would hold every token of the window layers; run -strategies vmarena,paged"},
		{"paged on chunked-local layers", []string{"-model", "llama-4-scout", "-strategies", "vmarena,paged"},
			"-model llama-4-scout (2 groups: chunked-local 8192 ×36, full ×12): strategy paged models full attention only, and would hold every token of the window layers; run -strategies vmarena"},
		{"paged on MLA latents", []string{"-model", "deepseek-v3", "-strategies", "paged"}, "-model deepseek-v3 (1 groups: mla-latent ×61): strategy paged models full attention only"},
		{"paged on a recurrent model", []string{"-model", "qwen3-next-80b-a3b", "-strategies", "paged"}, "strategy paged models full attention only"},
		{"per-layer", append(hybrid, "-layout", "per-layer"), "-layout per-layer: the per-group figures read the Blocked layout's blocks"},
		{"prefix replay with paged", append(hybrid, "-trace", "mooncake", "-strategies", "vmarena+prefix-cache,paged+prefix-cache"),
			"strategy paged+prefix-cache models full attention only, and would hold every token of the window layers; run -strategies vmarena+prefix-cache,vmarena"},
		{"uniform of a uniform model", []string{"-model", "llama3-8b", "-uniform"}, "-uniform: -model llama3-8b is uniform, every layer full attention already"},
		{"window past the context", []string{"-model", "gemma-3-27b", "-max-tokens", "1000", "-system-prompt", "0"}, "window of 1024 tokens is larger than MaxTokens 1000"},
	}
	checkUsage(t, tests)
}

// TestModelFlagPresets resolves every name -model knows: the one-group full-attention
// models as themselves, every other model as itself beside a uniform model in the
// shape of its largest per-token tensor.
func TestModelFlagPresets(t *testing.T) {
	for _, m := range kv.Presets() {
		t.Run(m.Name, func(t *testing.T) {
			g, groups, err := lookupModel(m.Name)
			require.NoError(t, err)
			assert.Equal(t, m.Name, g.Name)
			assert.Equal(t, m.Layers, g.Layers)
			for _, gr := range m.Groups {
				assert.LessOrEqual(t, gr.TokenBytes(), g.Groups[0].TokenBytes(), "the uniform model has the largest token")
			}
			var plan int64
			for _, p := range planLayers(&m) {
				plan += int64(len(p.kinds) * p.tokenBytes)
			}
			assert.Equal(t, int64(m.BytesPerToken()), plan, "the plan writes every group's bytes per token")
			if len(m.Groups) == 1 && m.Groups[0].Kind == kv.FullAttention {
				assert.Equal(t, m, g)
				assert.Nil(t, groups, "one full-attention group is uniform")
				return
			}
			require.NotNil(t, groups)
			assert.Equal(t, m, *groups)
		})
	}
}

// meteredCache checks, at every sample, that the group meter's figures add up to
// what the cache itself reports committed.
type meteredCache struct {
	*cacheStrategy
	mismatch []string
}

func (m *meteredCache) readGroups() (groupUse, bool, error) {
	u, has, err := m.cacheStrategy.readGroups()
	var sum int64
	for _, b := range u.Committed {
		sum += b
	}
	if got := m.c.Stats().Committed; sum != got && len(m.mismatch) < 3 {
		m.mismatch = append(m.mismatch, fmt.Sprintf("groups %v sum to %d, the cache committed %d", u.Committed, sum, got))
	}
	return u, has, err
}

// TestReplayHybridWindowStaysFlat replays short requests of gpt-oss-20b: its window
// group's committed bytes stay within what kv.Config.Size says a sequence's window
// holds, one block more for the step's give-back lag (kv gives back below FirstLive
// of the length a step grows from), per live sequence, while its full group grows
// with the tokens as in the uniform cache.
func TestReplayHybridWindowStaysFlat(t *testing.T) {
	replayHybrid(t, defaultBacking, 0, false)
}

// replayHybrid is TestReplayHybridWindowStaysFlat's replay on backing, with a system
// prompt of system tokens, with map-ahead on where ahead is set. The prompt's held
// sequence is forked (a backing that shares) and keeps a window like the others.
func replayHybrid(t *testing.T, backing string, system int, ahead bool) {
	g, groups, err := lookupModel("gpt-oss-20b")
	require.NoError(t, err)
	require.NotNil(t, groups)
	s := testSetup(0)
	s.model, s.groups, s.maxTokens, s.backing, s.mapAhead = g, groups, 1024, backing, ahead
	b, err := build(nameCache, s)
	require.NoError(t, err)
	mc := &meteredCache{cacheStrategy: b.st.(*cacheStrategy)}
	var reqs []Request
	for i := range 3 {
		reqs = append(reqs, Request{ID: i, Arrival: time.Duration(i) * 100 * time.Millisecond, Context: 150 + 40*i, Generated: 200})
	}
	w := Workload{Requests: reqs, Speed: 1, Step: 25 * time.Millisecond, Concurrency: 4, SystemPrompt: system,
		Layers: g.Layers, TokenBytes: g.Groups[0].TokenBytes(), MaxTokens: s.maxTokens}
	res, err := Replay(context.Background(), mc, w, nil)
	require.NoError(t, err)
	require.NoError(t, mc.Close())
	assert.Empty(t, mc.mismatch)
	assert.Equal(t, 3, res.Completed)

	const window, full = 0, 1
	require.Equal(t, kv.SlidingWindow, groups.Groups[window].Kind)
	require.Equal(t, kv.FullAttention, groups.Groups[full].Kind)
	cfg := kv.Config{Model: *groups, MaxTokens: s.maxTokens}
	var most, block int64
	for n := range s.maxTokens + 1 {
		sz, err := cfg.Size(mc.c.Granularity(), n)
		require.NoError(t, err)
		most, block = max(most, sz.Groups[window].Committed), int64(sz.Groups[window].BlockBytes)
	}
	bound := most + block
	held := int64(0)
	if system > 0 {
		held = 1 // the prompt's own sequence
	}
	var fullPeak int64
	for _, smp := range res.Samples {
		if smp.Live == 0 {
			continue
		}
		require.Len(t, smp.Groups, 2)
		assert.LessOrEqual(t, smp.Groups[window], (int64(smp.Live)+held)*bound, "the window group at %v holds at most a window per sequence", smp.At)
		assert.Equal(t, smp.Uniform[full], smp.Groups[full], "a full group is the uniform cache's")
		fullPeak = max(fullPeak, smp.Groups[full])
	}
	assert.Greater(t, fullPeak, 3*bound, "the full group grew past what the window holds")
	assert.Greater(t, res.UniformPeak[window], res.GroupPeak[window], "the uniform cache holds every token of the window layers")
	assert.Equal(t, res.UniformPeak[full], res.GroupPeak[full])
	if system > 0 {
		assert.Positive(t, res.MaxSaved, "the requests map the prompt's granules")
	}
}

func TestRunHybridModel(t *testing.T) {
	dir := t.TempDir()
	code, out, errOut := runArgs(t, "-model", "gpt-oss-20b", "-requests", "4", "-max-tokens", "1024", "-system-prompt", "200", "-idle", "0",
		"-progress", "none", "-granule", "64KiB", "-out", dir)
	require.Equal(t, 0, code, errOut)
	assert.Contains(t, out, "Groups:  2 groups: sliding-window 128 ×12, full ×12")
	assert.Contains(t, out, "eager and append model full attention only: vmarena and paged run, paged with a block table per layer group")
	assert.Contains(t, out, "the system prompt is a sequence of its own that every request forks from")
	assert.Regexp(t, `sliding-window 128 ×12 +[0-9.]+ [KM]iB`, out)
	assert.Regexp(t, `(?m)^ +paged +[0-9.]+ [KM]iB +[0-9.]+x`, out, "paged's memory row")
	assert.Regexp(t, `(?m)^ +paged +[0-9.]+[µm]?s .* 4/4$`, out, "paged's time row")
	assert.NotRegexp(t, `(?m)^ +(eager|append) +[0-9]`, out, "eager and append do not run")
	assert.Contains(t, out, "Plot of each layer group's memory over time: "+filepath.Join(dir, "kvcache-groups.png"))
	assert.FileExists(t, filepath.Join(dir, "kvcache-groups.png"))
}

// TestWriteGroupPlot draws a run on layer groups in both formats, and refuses a run
// without them.
func TestWriteGroupPlot(t *testing.T) {
	g, groups, err := lookupModel("gpt-oss-20b")
	require.NoError(t, err)
	s := testSetup(0)
	s.model, s.groups = g, groups
	r := Result{Strategy: nameCache, GroupPeak: []int64{3 << 20, 9 << 20}, UniformPeak: []int64{9 << 20, 9 << 20}}
	for i := range 10 {
		b := int64(i) << 20
		r.Samples = append(r.Samples, Sample{At: time.Duration(i) * time.Second, Groups: []int64{min(b, 3<<20), b}, Uniform: []int64{b, b}})
	}
	r.Samples = append(r.Samples, Sample{At: 11 * time.Second}) // the idle tail has no groups
	w := Workload{Requests: make([]Request, 2)}
	for _, format := range []string{"png", "svg"} {
		path, err := writeGroupPlot(t.TempDir(), format, r, s, w)
		require.NoError(t, err)
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		if format == "svg" {
			assert.Contains(t, string(data), "sliding-window 128 ×12: uniform full-attention cache (peak 9 MiB)")
		}
	}
	_, err = writeGroupPlot(t.TempDir(), "png", Result{Strategy: nameCache}, s, w)
	assert.ErrorContains(t, err, "no layer groups to plot")
}

// TestGroupMeterNeed counts the live tokens of a prompt and two sequences on it by
// hand: gpt-oss-20b's window of 128 tokens, a 300-token prompt, sequences of 500 and
// 350 tokens.
func TestGroupMeterNeed(t *testing.T) {
	_, groups, err := lookupModel("gpt-oss-20b")
	require.NoError(t, err)
	bk, err := host.NewPrivate(host.PrivateOptions{})
	require.NoError(t, err)
	c, err := kv.New(bk, kv.Config{Model: *groups, MaxTokens: 1024, Authority: accounting.NewGovernor().Authority("test", accounting.HostKey)})
	require.NoError(t, err)
	defer c.Close()
	gm, err := newGroupMeter(c, *groups)
	require.NoError(t, err)
	seq := func(n int) *kv.Sequence {
		q, err := c.NewSequence()
		require.NoError(t, err)
		require.NoError(t, q.Append(n))
		return q
	}
	prompt, a, b := seq(300), seq(500), seq(350)
	gm.add(a)
	gm.add(b)
	bpt := int64(groups.Groups[0].BytesPerToken())
	require.Equal(t, bpt, int64(groups.Groups[1].BytesPerToken()))
	u, err := gm.read()
	require.NoError(t, err)
	// No prompt: each sequence's window (127 and 127 tokens) and every token.
	assert.Equal(t, (127+127+500+350)*bpt, u.Need)

	gm.setPrefix(prompt)
	u, err = gm.read()
	require.NoError(t, err)
	// The window: a reads 373..499 (its own), b 223..349 (its own from 300), the
	// prompt's tokens from min(173, 373, 223) = 173. The full group: the prompt once.
	window := (500 - 373) + (350 - 300) + (300 - 173)
	assert.Equal(t, int64(window+300+200+50)*bpt, u.Need)

	gm.setPrefix(nil)
	u, err = gm.read()
	require.NoError(t, err)
	assert.Equal(t, (127+127+500+350)*bpt, u.Need, "the prompt forgotten")
	for _, q := range []*kv.Sequence{prompt, a, b} {
		q.Close()
	}
}

// TestPagedOnLayerGroups builds the paged baseline on the models of layer groups: with
// gpt-oss-20b's windows, where it replays every request and reads back every live
// token, its window layers giving back what is behind the window; refused for
// chunked-local, MLA and recurrent groups.
func TestPagedOnLayerGroups(t *testing.T) {
	g, groups, err := lookupModel("gpt-oss-20b")
	require.NoError(t, err)
	ws, ok := pagedWindows(groups)
	require.True(t, ok)
	for _, gr := range groups.Groups {
		for _, l := range gr.Layers {
			assert.Equal(t, gr.Window, ws[l], "layer %d", l) // 0 for full attention
		}
	}
	s := testSetup(1 << 30)
	s.model, s.groups, s.maxTokens = g, groups, 1024
	b, err := build(namePaged, s)
	require.NoError(t, err)
	p := b.st.(*baseline.Paged)
	assert.Equal(t, baseline.DefaultBlockTokens*groups.Groups[0].BytesPerToken(), p.BlockBytes(), "a block holds one group's 12 layers")
	var reqs []Request
	for i := range 3 {
		reqs = append(reqs, Request{ID: i, Arrival: time.Duration(i) * 100 * time.Millisecond, Context: 150 + 40*i, Generated: 200})
	}
	w := Workload{Requests: reqs, Speed: 1, Step: 25 * time.Millisecond, Concurrency: 4, SystemPrompt: 100, Verify: true,
		Layers: g.Layers, TokenBytes: g.Groups[0].TokenBytes(), MaxTokens: s.maxTokens, Plan: planLayers(groups)}
	res, err := Replay(context.Background(), p, w, nil)
	require.NoError(t, err)
	assert.Equal(t, 3, res.Completed)
	assert.Positive(t, res.Verified.Reads, "every live token read back as written")
	// The need counts every token of the full layers (the prompt's once, the requests'
	// 150+190+230 prompt and 3×200 generated tokens) and at most a window of the window
	// layers per sequence (the prompt's and the requests').
	full, window := int64(groups.Groups[1].BytesPerToken()), int64(groups.Groups[0].BytesPerToken())
	require.Equal(t, kv.SlidingWindow, groups.Groups[0].Kind)
	assert.LessOrEqual(t, res.PeakNeeded, (100+150+190+230+600)*full+4*128*window, "the need counts a window's tokens, not all")
	assert.Greater(t, res.PeakNeeded, (100+230)*full)
	require.NoError(t, p.Close())

	for _, name := range []string{"llama-4-scout", "deepseek-v3", "qwen3-next-80b-a3b"} {
		t.Run(name, func(t *testing.T) {
			g, groups, err := lookupModel(name)
			require.NoError(t, err)
			_, ok := pagedWindows(groups)
			assert.False(t, ok)
			s := testSetup(0)
			s.model, s.groups, s.maxTokens = g, groups, 16384
			_, err = build(namePaged, s)
			assert.ErrorContains(t, err, "strategy paged can not model "+name)
		})
	}
}
