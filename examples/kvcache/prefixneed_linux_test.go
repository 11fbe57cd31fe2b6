package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// sizeNeed is kv's own need of one sequence of n tokens of m (kv.Model.Size).
func sizeNeed(t *testing.T, m kv.Model, n int) int64 {
	t.Helper()
	sz, err := m.Size(testGranule, 0, n)
	require.NoError(t, err)
	return sz.Need
}

// TestLiveNeed: on a model of window, full and recurrent groups the live need is
// kv.Model.Size's Need summed over the live sequences; a second sequence on the same
// whole blocks adds only its own state, and one that shares the first block adds its
// own tokens past it. On a uniform model it is the distinct tokens times bpt.
func TestLiveNeed(t *testing.T) {
	m := kv.Model{Name: "tiny-mixed", Layers: 5, Groups: []kv.Group{
		{Kind: kv.Recurrent, Layers: []int{0, 3}, StateBytes: 700},
		{Kind: kv.SlidingWindow, Window: 128, Layers: []int{1, 4}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
		{Kind: kv.FullAttention, Layers: []int{2}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
	}}
	require.NoError(t, m.Validate(0))
	q := func(tokens, done int, keys ...uint64) *preq {
		return &preq{tokens: make([]int32, tokens), done: done, liveKeys: keys}
	}
	sum := func(qs ...*preq) (live int64) {
		for _, q := range qs {
			live += int64(len(q.tokens) + q.done)
		}
		return live
	}
	a, b, c := q(1100, 7, 1, 2), q(700, 0, 3), q(40, 2)
	assert.Equal(t, sizeNeed(t, m, 1107)+sizeNeed(t, m, 700)+sizeNeed(t, m, 42),
		liveNeed(&m, 0, []*preq{a, b, c}, sum(a, b, c), 0), "nothing shared: Size's Need of each")

	twin, again := q(1024, 0, 1, 2), q(1024, 0, 1, 2)
	state := int64(2 * 700)
	assert.Equal(t, sizeNeed(t, m, 1024)+state, liveNeed(&m, 0, []*preq{twin, again}, sum(twin, again), 2*MooncakeBlockTokens),
		"the same two blocks twice: the second adds its state")

	// d shares a's first block and goes on 300 tokens past it: its window lies past
	// the block, so it adds its state, its window and the full group's 300.
	d := q(812, 0, 1)
	full := int64(m.Groups[2].BytesPerToken())
	assert.Equal(t, sizeNeed(t, m, 1107)+state+128*int64(m.Groups[1].BytesPerToken())+300*full,
		liveNeed(&m, 0, []*preq{a, d}, sum(a, d), MooncakeBlockTokens))
	// e is a's first block alone: its window lies in that block, as a's does not.
	e := q(512, 0, 1)
	assert.Equal(t, sizeNeed(t, m, 1107)+state+128*int64(m.Groups[1].BytesPerToken()),
		liveNeed(&m, 0, []*preq{a, e}, sum(a, e), MooncakeBlockTokens))
	// With e alone and then a too, the shared window tokens count once.
	f := q(512, 0, 1)
	assert.Equal(t, sizeNeed(t, m, 512)+state, liveNeed(&m, 0, []*preq{e, f}, sum(e, f), MooncakeBlockTokens))

	bpt := int64(testModel.BytesPerToken())
	assert.Equal(t, (sum(a, b, twin, again)-2*MooncakeBlockTokens)*bpt,
		liveNeed(nil, bpt, []*preq{a, b, twin, again}, sum(a, b, twin, again), 2*MooncakeBlockTokens))
}

// TestReplayPrefixNeed replays the small trace one request at a time: the peak need
// is the need of the longest sequence sampled, each request's prompt and all its
// tokens but the last (the step that makes the last releases it before the sample):
// kv.Model.Size's Need on a model of window groups, its tokens times the bytes per
// token on a uniform one (as before the need read the groups).
func TestReplayPrefixNeed(t *testing.T) {
	for _, hybrid := range []bool{false, true} {
		w := prefixWorkload(t)
		w.Concurrency = 1
		s := testSetup(0)
		s.maxTokens = w.MaxTokens
		m := testModel
		if hybrid {
			m = tinyWindowModel
			w.Plan, w.Layers, w.TokenBytes, w.Groups = planLayers(&m), m.Layers, m.Groups[0].TokenBytes(), &m
			s.model = kv.Uniform(m.Name, m.Layers, 2, 32, arena.Float16)
			s.groups = &m
		}
		var want int64
		for _, r := range w.Requests {
			prompt, gen, _ := clipRequest(r, w.MaxTokens)
			if gen > 1 {
				want = max(want, sizeNeed(t, m, prompt+gen-1))
			}
		}
		require.Positive(t, want)
		if !hybrid {
			assert.Equal(t, int64(1500+3)*int64(2*testModel.Layers*testModel.Groups[0].TokenBytes()), want, "B, the longest")
		}
		r := replayWhole(t, namePrefixOn, s, w)
		require.Equal(t, len(w.Requests), r.Completed, m.Name)
		assert.Equal(t, want, r.PeakNeeded, m.Name)
		assert.Less(t, r.PeakNeeded, r.PeakPhysical, m.Name)
	}
}
