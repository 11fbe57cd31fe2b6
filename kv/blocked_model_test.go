package kv_test

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// bseq is the model of a sequence in TestBlockedModel: the writer of each token (0:
// appended, not written), the token IDs its first tokens stand for (each such token
// written by idWriter of the IDs up to it), and the bytes at the start of its range
// that are shared (never written).
type bseq struct {
	s      *kv.Sequence
	toks   []uint64
	ids    []int32
	frozen int
	from   *bprefix
}

// head returns copies of the model of s's first n tokens: their writers and the
// token IDs they stand for.
func (s *bseq) head(n int) ([]uint64, []int32) {
	return slices.Clone(s.toks[:n]), slices.Clone(s.ids[:min(len(s.ids), n)])
}

type bprefix struct {
	p        *kv.Prefix
	toks     []uint64
	ids      []int32
	released bool
	users    int
}

// idWriter is the writer of the last of ids's tokens: a token's K and V depend on
// the whole prefix, as a model's do.
func idWriter(ids []int32) uint64 {
	h := fnv.New64a()
	for _, id := range ids {
		h.Write([]byte{byte(id), byte(id >> 8), byte(id >> 16), byte(id >> 24)})
	}
	return h.Sum64() | 1<<63
}

// blockedModel drives a Blocked cache with a prefix cache, under a budget, against a
// plain model: the writers of every token, Len, and Writable from the model's own
// arithmetic of blocks.
type blockedModel struct {
	t        *testing.T
	e        *env
	pc       *kv.PrefixCache
	ml       modelLayout
	r        *rand.Rand
	seqs     []*bseq
	prefixes []*bprefix
	prompts  [][]int32
	writer   uint64
	step     string
	// takeovers counts misses that took over an entry's ranges (logged with
	// KV_TRACE_MODEL).
	takeovers int
}

// TestBlockedModel drives random Append, AppendBatch, WriteToken, Truncate, ForkAt,
// Freeze, NewSequenceFrom, Prefix.Release, Close and prefix cache Lookup and Insert
// on the Blocked layout with blocks of odd sizes (tpb not dividing the granule, blocks
// of several granules, blocks larger than MaxTokens) on each sharing backing, under
// a budget tight enough for refusals, evictions and miss takeovers. After each step
// every known token of every live sequence must read back (through View too on the
// host), Len and Writable must match the model, a refused operation must change
// nothing, and the books must balance; at the end everything is given back.
func TestBlockedModel(t *testing.T) {
	const maxTokens = 40
	for kind := range sharingBackings {
		for _, bt := range []int{0, 2, 5, 9, 50} {
			for seed := range 3 {
				name := fmt.Sprintf("%s/BlockTokens=%d/seed=%d", sharingNames[kind], bt, seed)
				t.Run(name, func(t *testing.T) {
					cfg := kv.Config{Model: tiny8, MaxTokens: maxTokens, Layout: kv.Blocked, BlockTokens: bt}
					g := envGranuleOf(kind)
					ml := modelOf(cfg, g)
					limit := int64(0)
					if seed%2 == 1 {
						limit = int64(8*ml.blk + 16*g) // the pools keep up to 16 idle granules
					}
					e := openEnv(t, kind, pooled, withConfig(kv.Config{MaxTokens: maxTokens, Layout: kv.Blocked, BlockTokens: bt}), withLimit(limit))
					pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
					require.NoError(t, err)
					m := &blockedModel{t: t, e: e, pc: pc, ml: ml, r: rand.New(rand.NewPCG(uint64(seed), uint64(bt)))}
					require.Equal(t, ml.tpb, func() int {
						s, err := e.c.NewSequence()
						require.NoError(t, err)
						defer s.Close()
						return s.BlockTokens()
					}(), "tokens per block")
					for i := range 200 {
						m.run(m.r.IntN(16))
						if traceModel {
							t.Log(m.step)
						}
						m.check()
						if t.Failed() {
							t.Fatalf("after step %d: %s", i, m.step)
						}
					}
					for len(m.seqs) > 0 {
						m.step = fmt.Sprintf("seq %d: final Close", m.seqs[len(m.seqs)-1].s.ID())
						if traceModel {
							t.Log(m.step)
						}
						m.closeSeq(len(m.seqs) - 1)
					}
					for _, p := range m.prefixes {
						if !p.released {
							p.p.Release()
						}
					}
					if traceModel {
						t.Logf("prefix cache: %+v; %d takeovers", pc.Stats(), m.takeovers)
					}
					require.NoError(t, pc.Close())
					e.finish(t)
				})
			}
		}
	}
}

// traceModel logs every step of TestBlockedModel (-v), to follow a failure.
var traceModel = os.Getenv("KV_TRACE_MODEL") != ""

// shareable returns the shared bytes of a sequence started on n tokens: its whole blocks.
func (m *blockedModel) shareable(n int) int { return n / m.ml.tpb * m.ml.blk }

// writable returns the first writable token of a sequence with frozen shared bytes.
func (m *blockedModel) writable(frozen int) int { return frozen / m.ml.blk * m.ml.tpb }

// refused reports whether err is a refusal for memory (nothing changed), and fails
// the test on any other error.
func (m *blockedModel) refused(err error) bool {
	if err == nil {
		return false
	}
	require.ErrorIs(m.t, err, accounting.ErrBudgetExceeded, m.step)
	return true
}

func (m *blockedModel) pick() *bseq {
	if len(m.seqs) == 0 {
		return nil
	}
	return m.seqs[m.r.IntN(len(m.seqs))]
}

// prompt returns token IDs that share a random prefix with an earlier prompt, over a
// vocabulary of 3 so that matches of every length happen.
func (m *blockedModel) prompt() []int32 {
	var ids []int32
	if len(m.prompts) > 0 && m.r.IntN(4) > 0 {
		old := m.prompts[m.r.IntN(len(m.prompts))]
		ids = append(ids, old[:m.r.IntN(len(old)+1)]...)
	}
	for n := m.r.IntN(44); len(ids) < n; {
		ids = append(ids, int32(m.r.IntN(3)))
	}
	m.prompts = append(m.prompts, ids)
	return ids
}

func (m *blockedModel) run(op int) {
	t := m.t
	s := m.pick()
	m.step = "nothing"
	switch {
	case op == 0 && len(m.seqs) < 6:
		m.step = "NewSequence"
		ks, err := m.e.c.NewSequence()
		require.NoError(t, err)
		m.seqs = append(m.seqs, &bseq{s: ks})
	case op == 1 && s != nil:
		n := m.r.IntN(12)
		m.step = fmt.Sprintf("seq %d: Append(%d) at %d", s.s.ID(), n, len(s.toks))
		err := s.s.Append(n)
		if len(s.toks)+n > s.s.Cache().Config().MaxTokens {
			require.ErrorIs(t, err, kv.ErrTooLong)
			return
		}
		if m.refused(err) {
			return
		}
		from := len(s.toks)
		s.toks = append(s.toks, make([]uint64, n)...)
		m.grow(s, from, len(s.toks))
	case op == 2 && s != nil && len(s.toks) > 0:
		tok := m.r.IntN(len(s.toks))
		m.step = fmt.Sprintf("seq %d: write token %d of %d", s.s.ID(), tok, len(s.toks))
		m.write(s, tok, tok+1)
	case op == 3 && s != nil:
		n := m.r.IntN(len(s.toks) + 1)
		m.step = fmt.Sprintf("seq %d: Truncate(%d) of %d (frozen %d)", s.s.ID(), n, len(s.toks), s.frozen)
		err := s.s.Truncate(n)
		if err != nil {
			require.ErrorIs(t, err, accounting.ErrBudgetExceeded, m.step)
			require.False(t, s.s.Damaged(), m.step)
			n = n / m.ml.tpb * m.ml.tpb // the whole blocks below the one it could not replace
			require.Equal(t, n, s.s.Len(), "%s: a refused truncate keeps the whole blocks", m.step)
		}
		s.toks = s.toks[:n]
		s.ids = s.ids[:min(len(s.ids), n)]
		s.frozen = min(s.frozen, m.shareable(n))
	case op == 4 && s != nil && len(m.seqs) < 6:
		n := m.r.IntN(len(s.toks) + 1)
		m.step = fmt.Sprintf("seq %d: ForkAt(%d) of %d", s.s.ID(), n, len(s.toks))
		ks, err := s.s.ForkAt(n)
		if m.refused(err) {
			return
		}
		s.frozen = max(s.frozen, m.shareable(n))
		toks, ids := s.head(n)
		m.seqs = append(m.seqs, &bseq{s: ks, toks: toks, ids: ids, frozen: m.shareable(n)})
	case op == 5 && s != nil:
		n := m.r.IntN(len(s.toks) + 1)
		m.step = fmt.Sprintf("seq %d: Freeze(%d) of %d", s.s.ID(), n, len(s.toks))
		kp, err := s.s.Freeze(n)
		if m.refused(err) {
			return
		}
		s.frozen = max(s.frozen, m.shareable(n))
		toks, ids := s.head(n)
		m.prefixes = append(m.prefixes, &bprefix{p: kp, toks: toks, ids: ids})
	case op == 6 && len(m.prefixes) > 0 && len(m.seqs) < 6:
		p := m.prefixes[m.r.IntN(len(m.prefixes))]
		if p.released {
			return
		}
		m.step = fmt.Sprintf("NewSequenceFrom(prefix of %d)", len(p.toks))
		ks, err := m.e.c.NewSequenceFrom(p.p)
		if m.refused(err) {
			return
		}
		p.users++
		m.seqs = append(m.seqs, &bseq{s: ks, toks: append([]uint64(nil), p.toks...),
			ids: append([]int32(nil), p.ids...), frozen: m.shareable(len(p.toks)), from: p})
	case op == 7 && s != nil:
		for i, q := range m.seqs {
			if q == s {
				m.step = fmt.Sprintf("seq %d: Close", s.s.ID())
				m.closeSeq(i)
			}
		}
	case op == 8 && len(m.prefixes) > 0:
		i := m.r.IntN(len(m.prefixes))
		p := m.prefixes[i]
		if p.released {
			return
		}
		m.step = fmt.Sprintf("Release(prefix of %d)", len(p.toks))
		p.p.Release()
		p.released = true
		m.forget(p)
	case (op == 9 || op == 13 || op == 14) && len(m.seqs) < 6:
		ids := m.prompt()
		m.step = fmt.Sprintf("Lookup(%d ids)", len(ids))
		ks, n, err := m.pc.Lookup(ids)
		if m.refused(err) {
			return
		}
		m.step = fmt.Sprintf("Lookup(%d ids) matched %d", len(ids), n)
		if n == 0 && committedOf(t, m.e.c, ks) > 0 {
			m.takeovers++
		}
		require.LessOrEqual(t, n, max(len(ids)-1, 0), m.step)
		require.Equal(t, n, ks.Len(), m.step)
		q := &bseq{s: ks, ids: append([]int32(nil), ids[:n]...), frozen: m.shareable(n)}
		for p := range n {
			q.toks = append(q.toks, idWriter(ids[:p+1]))
		}
		m.seqs = append(m.seqs, q)
		// Prefill the rest of the prompt (the first step writes the copied tail's
		// block, which must be writable).
		rest := min(len(ids), ks.Cache().Config().MaxTokens) - n
		if m.refused(ks.Append(rest)) {
			return
		}
		for p := n; p < n+rest; p++ {
			m.step = fmt.Sprintf("Lookup(%d ids) matched %d: prefill token %d (writable %d)", len(ids), n, p, ks.Writable())
			q.toks = append(q.toks, 0)
			m.writeAs(q, p, idWriter(ids[:p+1]))
		}
		q.ids = append(q.ids, ids[n:n+rest]...)
	case (op == 10 || op == 15) && s != nil:
		k := 0 // the tokens that still hold what their IDs say
		for k < len(s.ids) && k < len(s.toks) && s.toks[k] == idWriter(s.ids[:k+1]) {
			k++
		}
		m.step = fmt.Sprintf("seq %d: Insert(%d of %d)", s.s.ID(), k, len(s.toks))
		require.NoError(t, m.pc.Insert(s.s, s.ids[:k]))
		// Insert shares s's whole blocks below k, unless the cache held all k tokens
		// already (it then adds nothing).
		if f := max(s.frozen, m.shareable(k)); s.s.Writable() == m.writable(f) {
			s.frozen = f
		}
	case op == 11 && len(m.seqs) >= 2:
		a, b := m.seqs[0], m.seqs[len(m.seqs)-1]
		na, nb := m.r.IntN(6), m.r.IntN(6)
		m.step = fmt.Sprintf("AppendBatch(seq %d +%d, seq %d +%d)", a.s.ID(), na, b.s.ID(), nb)
		err := m.e.c.AppendBatch([]kv.Growth{{Seq: a.s, Tokens: na}, {Seq: b.s, Tokens: nb}})
		max := a.s.Cache().Config().MaxTokens
		if len(a.toks)+na > max || len(b.toks)+nb > max {
			require.ErrorIs(t, err, kv.ErrTooLong)
			return
		}
		if m.refused(err) {
			return
		}
		for _, g := range []struct {
			q *bseq
			n int
		}{{a, na}, {b, nb}} {
			from := len(g.q.toks)
			g.q.toks = append(g.q.toks, make([]uint64, g.n)...)
			m.grow(g.q, from, len(g.q.toks))
		}
	case op == 12 && s != nil:
		m.step = fmt.Sprintf("seq %d: views", s.s.ID())
		m.views(s)
	}
}

// grow writes the new tokens [from, to) of s: as the next token IDs of its prompt
// while all its tokens hold what their IDs say (so that it can be inserted whole),
// else each as a new writer.
func (m *blockedModel) grow(s *bseq, from, to int) {
	if len(s.ids) != from || m.r.IntN(4) == 0 {
		m.write(s, from, to)
		return
	}
	for tok := from; tok < to; tok++ {
		s.ids = append(s.ids, int32(m.r.IntN(3)))
		m.writeAs(s, tok, idWriter(s.ids))
	}
}

// write writes tokens [from, to) of s, each as a new writer.
func (m *blockedModel) write(s *bseq, from, to int) {
	for tok := from; tok < to; tok++ {
		m.writer++
		m.writeAs(s, tok, m.writer)
	}
}

// writeAs writes token tok of every tensor of s as writer w: refused whole below the
// model's Writable, done at or past it.
func (m *blockedModel) writeAs(s *bseq, tok int, w uint64) {
	refuse := tok < m.writable(s.frozen)
	writeOrRefuse(m.t, s.s, tok, w, refuse, m.step)
	if !refuse {
		s.toks[tok] = w
	}
}

// views checks, on a host backing, that every known token of s reads back through
// its layers' views at [t / BlockTokens, t % BlockTokens], or [t / BlockTokens,
// t % BlockTokens / RunTokens, t % RunTokens] where blocks have runs (the 64 KiB
// granules of Windows make blocks of more than 16 tokens).
func (m *blockedModel) views(s *bseq) {
	t := m.t
	g := tiny8
	st := stridesOf(s.s, 0)
	for layer := range g.Layers {
		for _, kind := range kv.KindsOf(g) {
			v, err := kv.View[arena.F16](s.s, layer, kind)
			require.NoError(t, err)
			require.Equal(t, viewShape(s.s), v.Shape(), m.step)
			if !v.HostAccessible() {
				continue
			}
			for tok, w := range s.toks {
				if w == 0 {
					continue
				}
				for h := range g.Groups[0].KVHeads {
					for d := range g.Groups[0].HeadDim {
						i := 2 * (h*g.Groups[0].HeadDim + d)
						want := arena.F16(testutil.TokenByte(w, layer, kind, tok, i)) | arena.F16(testutil.TokenByte(w, layer, kind, tok, i+1))<<8
						if got := v.At(append(blockIndex(st, tok, 0), h, d)...); got != want {
							require.Failf(t, "a view reads another token", "%s: layer %d %v token %d [%d %d]: got %#x, want %#x", m.step, layer, kind, tok, h, d, got, want)
						}
					}
				}
			}
		}
	}
}

func (m *blockedModel) closeSeq(i int) {
	s := m.seqs[i]
	require.True(m.t, s.s.Close().OK())
	m.seqs = append(m.seqs[:i], m.seqs[i+1:]...)
	if s.from != nil {
		s.from.users--
		m.forget(s.from)
	}
}

func (m *blockedModel) forget(p *bprefix) {
	if !p.released || p.users > 0 {
		return
	}
	m.prefixes = slices.DeleteFunc(m.prefixes, func(q *bprefix) bool { return q == p })
}

// check compares every live sequence with the model.
func (m *blockedModel) check() {
	t := m.t
	var tokens int64
	for _, s := range m.seqs {
		require.Equal(t, len(s.toks), s.s.Len(), "%s: seq %d: length", m.step, s.s.ID())
		require.Equal(t, m.writable(s.frozen), s.s.Writable(), "%s: seq %d: Writable", m.step, s.s.ID())
		tokens += int64(len(s.toks))
		for tok, w := range s.toks {
			if w == 0 {
				continue
			}
			if err := tryCheck(s.s, w, tok, tok+1); err != nil {
				require.NoError(t, err, m.step)
			}
		}
	}
	require.Equal(t, tokens, m.e.c.Stats().Tokens, m.step)
	m.e.books(t, m.step)
	if t.Failed() {
		t.Log(errors.New(m.step))
	}
}

func TestSizeOverflow(t *testing.T) {
	g := kv.Uniform("wide", 1024, 1, 1, arena.Float16)
	_, err := kv.Config{Model: g, Layout: kv.PerLayer, MaxTokens: math.MaxInt/2 - 4096 - 1}.Size(4096, 0)
	assert.ErrorIs(t, err, kv.ErrConfig)
}

func TestPresetsAndSizing(t *testing.T) {
	assert.Equal(t, 2048, kv.Llama3_8B().Groups[0].TokenBytes())
	assert.Equal(t, 128<<10, kv.Llama3_8B().BytesPerToken())
	g, err := kv.Preset("LLAMA3-8B")
	require.NoError(t, err)
	assert.Equal(t, kv.Llama3_8B(), g)
	_, err = kv.Preset("gpt-9")
	assert.ErrorIs(t, err, kv.ErrUnknownModel)
	assert.Contains(t, err.Error(), "llama3-70b")
	for _, p := range kv.Presets() {
		assert.NoError(t, p.Validate(0), p.Name)
	}
	bad := []kv.Model{kv.Uniform("", 0, 1, 1, arena.Float16), kv.Uniform("", 1, -1, 1, arena.Float16), kv.Uniform("", 1, 1, 1, 0), kv.Uniform("", 1<<30, 1<<20, 1<<20, arena.Float16)}
	for _, b := range bad {
		assert.ErrorIs(t, b.Validate(0), kv.ErrModel, "%+v", b)
	}

	// Llama-3-8B at 1,000 tokens: per-layer waste is up to one granule per tensor.
	tests := []struct {
		layout    kv.Layout
		granule   int
		committed int64
	}{
		{kv.PerLayer, 64 << 10, 64 * 32 * (64 << 10)}, // 1000×2 KiB = 31.25 granules → 32 per tensor
		{kv.PerLayer, 2 << 20, 64 * (2 << 20)},        // one 2 MiB granule per tensor
		{kv.Blocked, 64 << 10, 1000 * (128 << 10)},    // a block of two granules holds one token
		{kv.Blocked, 2 << 20, 63 * (2 << 20)},         // 16 tokens a block: 62.5 → 63 blocks
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v/granule=%dKiB", tt.layout, tt.granule>>10), func(t *testing.T) {
			s, err := kv.Config{Model: kv.Llama3_8B(), Layout: tt.layout, MaxTokens: 2048}.Size(tt.granule, 1000)
			require.NoError(t, err)
			assert.Equal(t, int64(1000*(128<<10)), s.Used)
			assert.Equal(t, tt.committed, s.Committed)
			assert.Equal(t, s.Committed-s.Used, s.Waste)
			assert.Equal(t, int64(2048*(128<<10)), s.Reserved)
		})
	}
	_, err = kv.Config{Model: kv.Llama3_8B(), Layout: kv.PerLayer, MaxTokens: 2}.Size(3, 1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Model: kv.Llama3_8B(), Layout: kv.Blocked, MaxTokens: 2}.Size(3, 1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Model: kv.Llama3_8B(), Layout: kv.Layout(9), MaxTokens: 2}.Size(4096, 1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Model: kv.Llama3_8B(), Layout: kv.PerLayer, MaxTokens: 2}.Size(4096, 3)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Model: kv.Model{}, Layout: kv.PerLayer, MaxTokens: 2}.Size(4096, 1)
	assert.ErrorIs(t, err, kv.ErrModel)
}

// Blocked's waste is the bytes at each block's end that hold no whole token, plus the
// free tokens of the last block; BlockTokens asks for larger blocks.
func TestBlockedSize(t *testing.T) {
	// 56 KiB a token: a 2 MiB granule holds 36 of them, 32 KiB free, and 7 granules
	// hold 256 with none free (at 64 KiB, 7 granules hold 8), the default's block.
	q := kv.Qwen25_7B()
	tests := []struct {
		name                   string
		granule, block, tokens int
		blockTokens, committed int
		reserved               int64
	}{
		{"64KiB", 64 << 10, 0, 10, 8, 2 * 7 * (64 << 10), 125 * 7 * (64 << 10)},
		{"64KiB/BlockTokens=1", 64 << 10, 1, 10, 1, 10 * (64 << 10), 1000 * (64 << 10)},
		{"2MiB", 2 << 20, 0, 100, 256, 7 * (2 << 20), 4 * 7 * (2 << 20)},
		{"2MiB/exact", 2 << 20, 0, 512, 256, 2 * 7 * (2 << 20), 4 * 7 * (2 << 20)},
		{"2MiB/BlockTokens=1", 2 << 20, 1, 100, 36, 3 * (2 << 20), 28 * (2 << 20)},
		{"2MiB/BlockTokens=37", 2 << 20, 37, 100, 73, 2 * (4 << 20), 14 * (4 << 20)},
		{"2MiB/BlockTokens=128", 2 << 20, 128, 1, 146, 8 << 20, 7 * (8 << 20)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := kv.Config{Model: q, Layout: kv.Blocked, BlockTokens: tt.block, MaxTokens: 1000}
			s, err := cfg.Size(tt.granule, tt.tokens)
			require.NoError(t, err)
			assert.Equal(t, tt.blockTokens, s.BlockTokens)
			assert.Equal(t, 1, s.Buffers)
			assert.Equal(t, int64(tt.tokens*q.BytesPerToken()), s.Used)
			assert.Equal(t, int64(tt.committed), s.Committed)
			assert.Equal(t, s.Committed-s.Used, s.Waste)
			assert.Equal(t, tt.reserved, s.Reserved)
		})
	}
	for _, cfg := range []kv.Config{
		{Model: q, Layout: kv.Blocked, BlockTokens: -1, MaxTokens: 10},
		{Model: q, Layout: kv.Layout(1), MaxTokens: 10}, // the removed token-major layout
		{Model: q, Layout: kv.PerLayer, BlockTokens: 4, MaxTokens: 10},
		{Model: q, Layout: kv.Blocked, BlockTokens: math.MaxInt / 2, MaxTokens: 10},
		{Model: q, Layout: kv.Blocked, MaxTokens: math.MaxInt / 2},
		{Model: q, Layout: kv.Blocked, MaxTokens: 1},
	} {
		_, err := cfg.Size(2<<20, 2)
		assert.ErrorIs(t, err, kv.ErrConfig, "%+v", cfg)
		e := openEnv(t, noCache, withLimit(1<<30))
		_, err = kv.New(e.fake, cfg)
		if cfg.MaxTokens > 1 {
			assert.ErrorIs(t, err, kv.ErrConfig, "New(%+v)", cfg)
		}
	}
}

// In the Blocked layout token t of (layer l, kind k) lies at (t/T)·block + ((2l+k)·T +
// t%T)·TokenBytes of the sequence's range; forks share whole blocks only and copy the
// tokens of the partly filled last one.
func TestBlockedAddresses(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	g := kv.Tiny() // 256 bytes a token: a 4 KiB granule is a block of 16 tokens
	c := e.cache(t, kv.Config{Model: g, MaxTokens: 256})
	require.Equal(t, kv.Blocked, c.Config().Layout, "the default layout")
	s, err := c.NewSequence()
	require.NoError(t, err)
	assert.Equal(t, 16, s.BlockTokens())
	assert.Equal(t, fakeGranule, s.BlockStride())
	assert.Equal(t, g.Groups[0].TokenBytes(), s.TokenStride())
	for l := range g.Layers {
		for _, k := range kv.KindsOf(g) {
			assert.Equal(t, uintptr((2*l+int(k))*16*g.Groups[0].TokenBytes()), s.Base(l, k)-s.Base(0, kv.K), "layer %d %v", l, k)
		}
	}
	_, err = s.Bytes(0, kv.K)
	assert.ErrorIs(t, err, kv.ErrLayout)
	require.NoError(t, s.Append(1))
	assert.Equal(t, int64(fakeGranule), c.Stats().Committed, "the first token commits its block")
	require.NoError(t, s.Append(39))
	assert.Equal(t, int64(3*fakeGranule), c.Stats().Committed)
	writeTokens(t, s, 1, 0, 40)
	checkTokens(t, s, 1, 0, 40)
	// The view addresses token t where the formula puts it.
	v, err := kv.View[arena.F16](s, 1, kv.V)
	require.NoError(t, err)
	assert.Equal(t, []int{3, 16, g.Groups[0].KVHeads, g.Groups[0].HeadDim}, v.Shape())
	assert.Equal(t, []int{fakeGranule / 2, g.Groups[0].TokenBytes() / 2, g.Groups[0].HeadDim, 1}, v.Strides())
	assert.Equal(t, s.Base(1, kv.V), v.DevicePtr())
	for _, tok := range []int{0, 15, 16, 39} {
		want := s.Base(0, kv.K) + uintptr(tok/16*fakeGranule+(3*16+tok%16)*g.Groups[0].TokenBytes())
		assert.Equal(t, want, tokenAddr(s, 1, kv.V, tok), "token %d", tok)
	}

	f, err := s.ForkAt(20)
	require.NoError(t, err)
	assert.Equal(t, 16, f.Writable(), "one whole block shared, the partly filled one copied")
	assert.Equal(t, 16, s.Writable())
	assert.Equal(t, int64(2*fakeGranule), c.SequenceStats()[1].Committed)
	assert.Equal(t, int64(fakeGranule), c.SequenceStats()[1].Shared)
	writeTokens(t, s, 2, 16, 40) // the origin's own block: the fork's copy keeps writer 1
	checkTokens(t, f, 1, 0, 20)
	checkTokens(t, s, 2, 16, 40)
	assert.ErrorIs(t, f.WriteToken(0, kv.K, 15, make([]byte, g.Groups[0].TokenBytes())), kv.ErrReadOnly)
	require.NoError(t, f.Append(10))
	writeTokens(t, f, 3, 20, 30)
	checkTokens(t, f, 1, 0, 20)
	checkTokens(t, s, 1, 0, 16)
	closeAll(t, f, s)
}
