package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// testModel is small enough for -race: 2 KiB of K/V per token, so a Blocked block of
// one 64 KiB granule holds 32 tokens and no free bytes.
// It is the tiny preset's element type with a few more layers and dimensions.
var testModel = kv.Uniform("test", 4, 2, 64, kv.Tiny().Groups[0].DType)

const (
	testGranule = 64 << 10
	testSystem  = 100 // 3 whole granules shared, 4 tokens copied
)

func testSetup(budget int64) setup {
	return setup{model: testModel, backing: defaultBacking, layout: kv.Blocked, granule: testGranule,
		populate: true, maxTokens: 4096, budget: budget}
}

// testWorkload is a slice of the bundled trace: its first n requests, compressed in
// time so that they overlap.
func testWorkload(t *testing.T, n int) Workload {
	reqs, err := ReadTrace(bytes.NewReader(bundledTrace))
	require.NoError(t, err)
	return Workload{
		Requests:     reqs[:n],
		Speed:        4,
		Step:         25 * time.Millisecond,
		Concurrency:  16,
		SystemPrompt: testSystem,
		Layers:       testModel.Layers,
		TokenBytes:   testModel.Groups[0].TokenBytes(),
		MaxTokens:    4096,
	}
}

// checkEnd checks that a strategy gave everything back.
func checkEnd(t *testing.T, r Result) {
	assert.Equal(t, r.Requests, r.Completed, "%s: every request completed", r.Strategy)
	assert.Zero(t, r.Rejected, r.Strategy)
	assert.Zero(t, r.End.Sequences, "%s: no sequence left", r.Strategy)
	assert.Zero(t, r.End.Prefixes, "%s: prefix released", r.Strategy)
	assert.Zero(t, r.End.Tokens, r.Strategy)
	assert.Zero(t, r.End.Saved, r.Strategy)
	assert.Zero(t, r.GovernorAfter, "%s: governor at zero after Close", r.Strategy)
	if r.Strategy == nameCache && defaultBacking == "shared" {
		require.NotNil(t, r.PoolAfter)
		assert.Zero(t, r.PoolAfter.Mapped, "every granule unmapped")
		assert.Equal(t, r.PoolAfter.Owned, r.PoolAfter.Idle, "every owned granule back in the pool")
	}
}

// TestReplayBudget replays under a budget smaller than the unbounded peak: requests
// wait instead of failing, memory stays under the budget, and everything completes.
func TestReplayBudget(t *testing.T) {
	w := testWorkload(t, 40)
	free, err := replayOne(context.Background(), nameCache, testSetup(0), w, nopProgress{}, nil)
	require.NoError(t, err)
	budget := free.PeakPhysical * 6 / 10
	s := testSetup(budget)
	for _, name := range allStrategies {
		r, err := replayOne(context.Background(), name, s, w, nopProgress{}, nil)
		require.NoError(t, err, name)
		checkEnd(t, r)
		assert.LessOrEqual(t, r.PeakPhysical, budget, name)
		for _, smp := range r.Samples {
			require.LessOrEqual(t, smp.Physical, budget, name)
		}
		assert.Positive(t, r.MemoryRefused, "%s: memory held some requests up", name)
		assert.GreaterOrEqual(t, r.Waited, r.MemoryRefused, name)
		assert.Positive(t, r.WaitMax, name)
		assert.LessOrEqual(t, r.WaitP50, r.WaitP99, name)
		assert.LessOrEqual(t, r.WaitP99, r.WaitMax, name)
		if name == nameCache {
			assert.Greater(t, r.Makespan, free.Makespan, "waiting takes longer")
		}
	}
}

func TestReplayRejectsWhatCanNeverFit(t *testing.T) {
	w := testWorkload(t, 1)
	w.Requests = []Request{
		{ID: 0, Context: 50, Generated: 10},
		{ID: 1, Context: 3000, Generated: 10}, // 6 MiB: more than the whole budget
		{ID: 2, Context: 50, Generated: 10},
	}
	const budget = 1 << 20
	for _, name := range []string{nameCache, namePaged, nameAppend} {
		r, err := replayOne(context.Background(), name, testSetup(budget), w, nopProgress{}, nil)
		require.NoError(t, err, name)
		assert.Equal(t, 1, r.Rejected, name)
		assert.Equal(t, 2, r.Completed, name)
		assert.Zero(t, r.GovernorAfter, name)
	}
}

func TestReplayPrefixOverBudget(t *testing.T) {
	// Eager needs a whole MaxTokens slot for the sequence that prefills the system
	// prompt: under a budget below one slot the replay fails at once, clearly,
	// rather than waiting forever.
	slot := int64(4096 * testModel.BytesPerToken())
	_, err := replayOne(context.Background(), nameEager, testSetup(slot-1), testWorkload(t, 3), nopProgress{}, nil)
	require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Contains(t, err.Error(), "system prompt")
}

func TestReplayBadWorkload(t *testing.T) {
	good := testWorkload(t, 2)
	tests := []struct {
		name string
		edit func(w *Workload)
	}{
		{"no requests", func(w *Workload) { w.Requests = nil }},
		{"negative speed", func(w *Workload) { w.Speed = -1 }},
		{"zero step", func(w *Workload) { w.Step = 0 }},
		{"zero concurrency", func(w *Workload) { w.Concurrency = 0 }},
		{"negative system prompt", func(w *Workload) { w.SystemPrompt = -1 }},
		{"no layers", func(w *Workload) { w.Layers = 0 }},
		{"max tokens within the system prompt", func(w *Workload) { w.MaxTokens = w.SystemPrompt }},
	}
	st, err := baseline.NewPaged(baseline.Shape{Layers: 1, TokenBytes: 1, MaxTokens: 1}, baseline.PagedOptions{BlockTokens: 1})
	require.NoError(t, err)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := good
			tt.edit(&w)
			_, err := Replay(context.Background(), st, w, nil)
			assert.Error(t, err)
		})
	}
}

func TestReplayCancelled(t *testing.T) {
	w := testWorkload(t, 10)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	b, err := build(namePaged, testSetup(0))
	require.NoError(t, err)
	_, err = Replay(ctx, b.st, w, nil)
	assert.ErrorIs(t, err, context.Canceled)
	require.NoError(t, b.st.Close(), "a cancelled replay leaves nothing behind")
}

func TestReplayClipsLongRequests(t *testing.T) {
	w := testWorkload(t, 3)
	w.Requests = append([]Request(nil), w.Requests...)
	w.Requests[1].Context = 10000
	r, err := replayOne(context.Background(), namePaged, testSetup(0), w, nopProgress{}, nil)
	require.NoError(t, err)
	assert.Equal(t, 1, r.Clipped)
	assert.Equal(t, 3, r.Completed)
	assert.LessOrEqual(t, r.PeakNeeded, int64(3*4096*testModel.BytesPerToken()))
}

func TestQuantile(t *testing.T) {
	d := []time.Duration{5, 1, 4, 2, 3}
	assert.Equal(t, time.Duration(3), quantile(d, 0.5))
	assert.Equal(t, time.Duration(5), quantile(d, 0.99))
	assert.Equal(t, time.Duration(5), quantile(d, 1))
	assert.Equal(t, time.Duration(1), quantile(d, 0))
	assert.Zero(t, quantile(nil, 0.5))
}

// writeRec is one WriteToken call.
type writeRec struct {
	layer int
	kind  baseline.Kind
	token int
}

// recordingStrategy records the order of every sequence's writes.
type recordingStrategy struct {
	baseline.Strategy
	writes *[]writeRec
}

func (s recordingStrategy) NewSequence() (baseline.Sequence, error) {
	q, err := s.Strategy.NewSequence()
	if err != nil {
		return nil, err
	}
	return recordingSeq{q, s.writes}, nil
}

func (s recordingStrategy) NewSequenceFrom(p baseline.Prefix) (baseline.Sequence, error) {
	q, err := s.Strategy.NewSequenceFrom(p)
	if err != nil {
		return nil, err
	}
	return recordingSeq{q, s.writes}, nil
}

type recordingSeq struct {
	baseline.Sequence
	writes *[]writeRec
}

func (q recordingSeq) WriteToken(layer int, v baseline.Kind, token int, src []byte) error {
	*q.writes = append(*q.writes, writeRec{layer, v, token})
	return q.Sequence.WriteToken(layer, v, token, src)
}

// TestReplayWritesLayerByLayer: the replay writes a prompt as a model's prefill does,
// all of a layer's tokens (K and V of each) before the next layer's.
func TestReplayWritesLayerByLayer(t *testing.T) {
	var got []writeRec
	record := func(layer int, v baseline.Kind, token int, _ []byte) error {
		got = append(got, writeRec{layer, v, token})
		return nil
	}
	require.NoError(t, writeLayerMajor(record, baseline.K, baseline.V, 2, 5, 7, nil))
	assert.Equal(t, []writeRec{
		{0, baseline.K, 5}, {0, baseline.V, 5}, {0, baseline.K, 6}, {0, baseline.V, 6},
		{1, baseline.K, 5}, {1, baseline.V, 5}, {1, baseline.K, 6}, {1, baseline.V, 6},
	}, got)

	// The whole replay: one request, no system prompt, a 3-token prompt and 2 tokens
	// of output on a model of 4 layers.
	w := testWorkload(t, 1)
	w.SystemPrompt = 0
	w.Requests = []Request{{ID: 0, Context: 3, Generated: 2}}
	b, err := build(namePaged, testSetup(0))
	require.NoError(t, err)
	var writes []writeRec
	_, err = Replay(context.Background(), recordingStrategy{b.st, &writes}, w, nil)
	require.NoError(t, err)
	require.NoError(t, b.st.Close())
	var want []writeRec
	for l := range testModel.Layers { // the prefill: layer by layer
		for tok := range 3 {
			want = append(want, writeRec{l, baseline.K, tok}, writeRec{l, baseline.V, tok})
		}
	}
	for tok := 3; tok < 5; tok++ { // each decode step: one token of every layer
		for l := range testModel.Layers {
			want = append(want, writeRec{l, baseline.K, tok}, writeRec{l, baseline.V, tok})
		}
	}
	assert.Equal(t, want, writes)
}
