package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// groupWorkload is a few short requests on a model of groups, with Verify on:
// prompts of ctx tokens, gen generated, on a system prompt of system tokens.
func groupWorkload(g kv.Model, groups *kv.Model, maxTokens, system, ctx, gen int) Workload {
	var reqs []Request
	for i := range 3 {
		reqs = append(reqs, Request{ID: i, Arrival: time.Duration(i) * 50 * time.Millisecond, Context: ctx + 7*i, Generated: gen})
	}
	plan := planLayers(groups)
	return Workload{Requests: reqs, Speed: 1, Step: 25 * time.Millisecond, Concurrency: 4, SystemPrompt: system,
		Layers: g.Layers, Plan: plan, TokenBytes: planBytes(plan, g.Groups[0].TokenBytes()), MaxTokens: maxTokens, Verify: true}
}

// TestReplayEveryGroupKind replays, with every live token and state read back, the
// models whose groups differ from one K and V of one shape: an MLA latent
// (deepseek-v3), recurrent states beside full layers of another shape
// (qwen3-next-80b-a3b), window groups (gemma-3-27b, llama-4-scout) and a window the
// requests outgrow (gpt-oss-20b), on a backing that shares the system prompt and on
// one that copies it. The meter's groups add up to the cache's committed bytes, and
// everything comes back.
func TestReplayEveryGroupKind(t *testing.T) {
	models := []struct {
		name      string
		maxTokens int
		ctx, gen  int
	}{
		{"deepseek-v3", 1024, 40, 12},
		{"qwen3-next-80b-a3b", 1024, 40, 12},
		{"gemma-3-27b", 1024, 30, 8},
		{"llama-4-scout", 8192, 40, 12},
		{"gpt-oss-20b", 1024, 150, 40},
	}
	for _, bk := range []string{defaultBacking, "private"} {
		for _, m := range models {
			t.Run(bk+"/"+m.name, func(t *testing.T) {
				g, groups, err := lookupModel(m.name)
				require.NoError(t, err)
				require.NotNil(t, groups)
				s := testSetup(0)
				s.model, s.groups, s.maxTokens, s.backing = g, groups, m.maxTokens, bk
				b, err := build(nameCache, s)
				require.NoError(t, err)
				mc := &meteredCache{cacheStrategy: b.st.(*cacheStrategy)}
				w := groupWorkload(g, groups, m.maxTokens, 20, m.ctx, m.gen)
				res, err := Replay(context.Background(), mc, w, nil)
				require.NoError(t, err)
				require.NoError(t, mc.Close())
				assert.Empty(t, mc.mismatch)
				assert.Equal(t, 3, res.Completed)
				assert.Zero(t, b.gov.Stats(b.dev).Used, "every byte came back")
				require.NotEmpty(t, res.GroupPeak)
				for i, gr := range groups.Groups {
					assert.Positive(t, res.GroupPeak[i], "group %d (%v) held memory", i, gr.Kind)
				}
			})
		}
	}
}

// miswriting is a cache strategy whose sequences write one byte wrong: token token
// of layer layer, or, with state set, layer's recurrent state.
type miswriting struct {
	*cacheStrategy
	layer, token int
	state        bool
}

func (c *miswriting) NewSequence() (baseline.Sequence, error) {
	q, err := c.cacheStrategy.NewSequence()
	if err != nil {
		return nil, err
	}
	return &miswritingSeq{cacheSeq: q.(*cacheSeq), c: c}, nil
}

type miswritingSeq struct {
	*cacheSeq
	c *miswriting
}

func flipped(src []byte) []byte {
	b := append([]byte(nil), src...)
	b[len(b)/2] ^= 0x10
	return b
}

func (q *miswritingSeq) WriteToken(layer int, v baseline.Kind, token int, src []byte) error {
	if !q.c.state && layer == q.c.layer && token == q.c.token {
		src = flipped(src)
	}
	return q.cacheSeq.WriteToken(layer, v, token, src)
}

func (q *miswritingSeq) writeState(layer int, src []byte) error {
	if q.c.state && layer == q.c.layer {
		src = flipped(src)
	}
	return q.cacheSeq.writeState(layer, src)
}

// TestReplayVerifyCatches proves the read-back can fail: a wrong byte in a recurrent
// state, in a full layer's token, or in a live window token fails the replay with
// errWrongBytes.
func TestReplayVerifyCatches(t *testing.T) {
	tests := []struct {
		name, model  string
		layer, token int
		state        bool
	}{
		{"recurrent state", "qwen3-next-80b-a3b", 0, 0, true},
		{"full layer", "qwen3-next-80b-a3b", 3, 5, false},
		{"MLA latent", "deepseek-v3", 60, 30, false},
		{"live window token", "gpt-oss-20b", 0, 150, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g, groups, err := lookupModel(tt.model)
			require.NoError(t, err)
			s := testSetup(0)
			s.model, s.groups, s.maxTokens = g, groups, 1024
			b, err := build(nameCache, s)
			require.NoError(t, err)
			st := &miswriting{cacheStrategy: b.st.(*cacheStrategy), layer: tt.layer, token: tt.token, state: tt.state}
			_, err = Replay(context.Background(), st, groupWorkload(g, groups, 1024, 0, 150, 10), nil)
			require.ErrorIs(t, err, errWrongBytes)
			require.NoError(t, st.Close())
		})
	}
}

// TestKVDTypeFlag stores the KV in the type -kv-dtype names: fp8 holds half of
// fp16's bytes per token on every group's tensors and keeps a recurrent state as the
// model has it.
func TestKVDTypeFlag(t *testing.T) {
	for _, name := range []string{"llama3-8b", "qwen3-next-80b-a3b", "deepseek-v3"} {
		t.Run(name, func(t *testing.T) {
			g, groups, err := lookupModel(name)
			require.NoError(t, err)
			g16, m16, err := withDType(g, groups, arena.Float16)
			require.NoError(t, err)
			g8, m8, err := withDType(g, groups, arena.Float8E4M3)
			require.NoError(t, err)
			assert.Equal(t, 2*g8.Groups[0].TokenBytes(), g16.Groups[0].TokenBytes())
			if groups == nil {
				return
			}
			assert.Equal(t, 2*m8.BytesPerToken(), m16.BytesPerToken())
			for i, gr := range m8.Groups {
				if gr.Kind == kv.Recurrent {
					assert.Equal(t, groups.Groups[i], gr, "a recurrent state keeps the model's type")
					continue
				}
				assert.Equal(t, arena.Float8E4M3, gr.DType)
				assert.Equal(t, groups.Groups[i].DType, arena.BFloat16, "the preset is not changed")
			}
		})
	}
	dt, err := parseKVDType(kvDTypeDefault)
	require.NoError(t, err)
	assert.Zero(t, dt, "the model's own")
	g, groups, err := withDType(kv.Llama3_8B(), nil, dt)
	require.NoError(t, err)
	assert.Equal(t, kv.Llama3_8B(), g)
	assert.Nil(t, groups)
}

func TestKVDTypeFlagBadInputs(t *testing.T) {
	checkUsage(t, []usageCase{
		{"unknown type", []string{"-kv-dtype", "fp4"}, `-kv-dtype "fp4": want one of model, fp16, bf16, fp8, fp8-e5m2, q8_0`},
		{"empty", []string{"-kv-dtype", ""}, `-kv-dtype "": want one of`},
		{"q8_0 on a head of 16", []string{"-model", "tiny", "-kv-dtype", "q8_0"}, "-kv-dtype q8_0 with tiny: group 0 (full): kv: invalid model: head dim 16 of q8_0"},
	})
}

// TestRunKVDType runs the tiny model in fp8 with the read-back on: the header says
// half of fp16's K/V per token, and every strategy completes.
func TestRunKVDType(t *testing.T) {
	code16, out16, errOut := runArgs(t, small(t, "-kv-dtype", "fp16", "-requests", "4", "-progress", "none")...)
	require.Equal(t, 0, code16, errOut)
	code8, out8, errOut := runArgs(t, small(t, "-kv-dtype", "fp8", "-requests", "4", "-progress", "none", "-verify")...)
	require.Equal(t, 0, code8, errOut)
	assert.Contains(t, out16, "tiny, 256 B of K/V per token")
	assert.Contains(t, out8, "tiny, 128 B of K/V per token")
	for _, n := range allStrategies {
		assert.Regexp(t, n+` .* 4/4`, out8)
	}
}

// TestWorkloadPlanBadInputs: a plan that does not fit the workload's shape is refused.
func TestWorkloadPlanBadInputs(t *testing.T) {
	g, groups, err := lookupModel("qwen3-next-80b-a3b")
	require.NoError(t, err)
	w := groupWorkload(g, groups, 1024, 0, 10, 1)
	short := w
	short.Plan = short.Plan[:3]
	assert.ErrorContains(t, short.validate(), "a layer plan of 3 layers for a model of 48")
	small := w
	small.TokenBytes = g.Groups[0].TokenBytes()
	assert.ErrorContains(t, small.validate(), "less than the plan's largest token or state, 1097728")
	require.NoError(t, w.validate())
}
