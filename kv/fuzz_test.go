package kv_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// The operations FuzzCacheOps decodes, one per two input bytes (op, argument).
const (
	opNew = iota
	opAppend
	opWrite
	opTruncate
	opFork
	opFreeze
	opFrom
	opClose
	opRelease
	opForkAt
	opBatch
	opCount
)

const (
	fuzzMaxTokens = 40 // per sequence
	fuzzMaxLive   = 6  // sequences at once
	fuzzMaxOps    = 64
)

// mseq is the model of a sequence: the writer of each of its tokens (0: contents
// unknown, appended but not written since).
type mseq struct {
	s    *kv.Sequence
	toks []uint64
	from *mprefix
}

// mprefix is the model of a prefix: its tokens, whether its creator released it, and
// how many live sequences started on it.
type mprefix struct {
	p        *kv.Prefix
	toks     []uint64
	released bool
	users    int
}

func (p *mprefix) live() bool { return !p.released || p.users > 0 }

// cacheModel drives a cache and checks it against the model after every step.
type cacheModel struct {
	t        *testing.T
	e        *env
	seqs     []*mseq
	prefixes []*mprefix
	writer   uint64
	step     string
}

// FuzzCacheOps drives random sequences of cache operations (NewSequence, Append,
// WriteToken, Truncate, Fork, ForkAt, Freeze, NewSequenceFrom, AppendBatch, Close,
// Prefix.Release) on each
// sharing backing and layout, against a model of every token's writer. After every
// step it reads back every known token of every live sequence, and checks each
// sequence's length and committed bytes, the cache's Stats, and that the ledger maps
// exactly the granules the sequences and prefixes hold; at the end, that everything
// is given back. The first input byte picks the backing and layout.
func FuzzCacheOps(f *testing.F) {
	for kind := range sharingBackings {
		for layout := range len(fuzzLayouts) {
			cfg := byte(int(kind)*len(fuzzLayouts) + layout)
			f.Add([]byte{cfg,
				opNew, 0, opAppend, 19, opFreeze, 17, opFrom, 0, opAppend, 9, opWrite, 20,
				opFork, 1, opTruncate, 11, opAppend, 5, opWrite, 3, opRelease, 0, opClose, 0,
				opTruncate, 3, opFreeze, 2, opFrom, 1, opClose, 1, opAppend, 30, opForkAt, 7,
				opBatch, 0x5d, opWrite, 1, opBatch, 0xff})
			f.Add([]byte{cfg,
				opNew, 0, opAppend, 8, opFork, 0, opFork, 1, opTruncate, 5, opAppend, 3,
				opWrite, 4, opWrite, 9, opFreeze, 8, opFrom, 0, opTruncate, 1, opClose, 2,
				opRelease, 0, opClose, 0})
		}
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) == 0 {
			return
		}
		kind, fl := backingKind(int(ops[0])/len(fuzzLayouts))%sharingBackings, fuzzLayouts[int(ops[0])%len(fuzzLayouts)]
		layout := fl.layout
		e := openEnv(t, kind, pooled, withConfig(kv.Config{MaxTokens: fuzzMaxTokens, Layout: layout, BlockTokens: fl.blockTokens}))
		m := &cacheModel{t: t, e: e}
		ops = ops[1:]
		for i := 0; i+1 < len(ops) && i < 2*fuzzMaxOps; i += 2 {
			m.run(int(ops[i])%opCount, int(ops[i+1]))
			m.check()
			if t.Failed() {
				t.Fatalf("after step %d: %s (%s, %v, BlockTokens %d)", i/2, m.step, e.name, layout, fl.blockTokens)
			}
		}
		m.closeAll()
		e.finish(t)
	})
}

// fuzzLayouts are the layouts the first input byte picks from (with the backing):
// Blocked with tiny8's default block (one token in a granule, 1 KiB free) and with
// four tokens a block (three granules).
var fuzzLayouts = []struct {
	layout      kv.Layout
	blockTokens int
}{{kv.PerLayer, 0}, {kv.Blocked, 0}, {kv.Blocked, testBlockTokens}}

// run applies one operation to the cache and the model.
func (m *cacheModel) run(op, arg int) {
	t := m.t
	var s *mseq
	if len(m.seqs) > 0 {
		s = m.seqs[arg%len(m.seqs)]
	}
	switch {
	case op == opNew && len(m.seqs) < fuzzMaxLive:
		m.step = "NewSequence"
		ks, err := m.e.c.NewSequence()
		require.NoError(t, err)
		m.seqs = append(m.seqs, &mseq{s: ks})
	case op == opAppend && s != nil:
		n := arg % 24
		m.step = fmt.Sprintf("seq %d: Append(%d) at %d", s.s.ID(), n, len(s.toks))
		err := s.s.Append(n)
		if len(s.toks)+n > fuzzMaxTokens {
			require.ErrorIs(t, err, kv.ErrTooLong)
			return
		}
		require.NoError(t, err)
		from := len(s.toks)
		s.toks = append(s.toks, make([]uint64, n)...)
		m.write(s, from, len(s.toks))
	case op == opWrite && s != nil && len(s.toks) > 0:
		tok := arg % len(s.toks)
		m.step = fmt.Sprintf("seq %d: write token %d of %d (writable from %d)", s.s.ID(), tok, len(s.toks), s.s.Writable())
		m.write(s, tok, tok+1)
	case op == opTruncate && s != nil:
		n := arg % (len(s.toks) + 1)
		m.step = fmt.Sprintf("seq %d: Truncate(%d) of %d", s.s.ID(), n, len(s.toks))
		require.NoError(t, s.s.Truncate(n))
		s.toks = s.toks[:n]
	case op == opFork && s != nil && len(m.seqs) < fuzzMaxLive:
		m.step = fmt.Sprintf("seq %d: Fork of %d tokens", s.s.ID(), len(s.toks))
		ks, err := s.s.Fork()
		require.NoError(t, err)
		m.seqs = append(m.seqs, &mseq{s: ks, toks: append([]uint64(nil), s.toks...)})
	case op == opForkAt && s != nil && len(m.seqs) < fuzzMaxLive:
		n := (arg / 8) % (len(s.toks) + 1)
		m.step = fmt.Sprintf("seq %d: ForkAt(%d) of %d tokens", s.s.ID(), n, len(s.toks))
		ks, err := s.s.ForkAt(n)
		require.NoError(t, err)
		m.seqs = append(m.seqs, &mseq{s: ks, toks: append([]uint64(nil), s.toks[:n]...)})
	case op == opBatch && s != nil:
		m.batch(arg)
	case op == opFreeze && s != nil:
		p := arg % (len(s.toks) + 1)
		m.step = fmt.Sprintf("seq %d: Freeze(%d) of %d", s.s.ID(), p, len(s.toks))
		kp, err := s.s.Freeze(p)
		require.NoError(t, err)
		require.Equal(t, p, kp.Len())
		m.prefixes = append(m.prefixes, &mprefix{p: kp, toks: append([]uint64(nil), s.toks[:p]...)})
	case op == opFrom && len(m.prefixes) > 0 && len(m.seqs) < fuzzMaxLive:
		p := m.prefixes[arg%len(m.prefixes)]
		m.step = fmt.Sprintf("NewSequenceFrom(prefix of %d tokens, released %v)", len(p.toks), p.released)
		if p.released {
			require.PanicsWithValue(t, kv.PanicPrefixReleased, func() { _, _ = m.e.c.NewSequenceFrom(p.p) })
			return
		}
		ks, err := m.e.c.NewSequenceFrom(p.p)
		require.NoError(t, err)
		assert.Same(t, p.p, ks.Prefix())
		p.users++
		m.seqs = append(m.seqs, &mseq{s: ks, toks: append([]uint64(nil), p.toks...), from: p})
	case op == opClose && s != nil:
		m.step = fmt.Sprintf("seq %d: Close", s.s.ID())
		m.closeSeq(arg % len(m.seqs))
	case op == opRelease && len(m.prefixes) > 0:
		i := arg % len(m.prefixes)
		p := m.prefixes[i]
		m.step = fmt.Sprintf("Release(prefix of %d tokens, released %v)", len(p.toks), p.released)
		if p.released {
			require.PanicsWithValue(t, kv.PanicPrefixReleased, p.p.Release)
			return
		}
		p.p.Release()
		p.released = true
		m.forget(p)
	default:
		m.step = "nothing"
	}
}

// write writes tokens [from, to) of s as a new writer. A token below Writable must be
// refused whole, in every layer and kind, and keep its contents.
func (m *cacheModel) write(s *mseq, from, to int) {
	for tok := from; tok < to; tok++ {
		m.writer++
		w := m.writer
		refuse := tok < s.s.Writable()
		writeOrRefuse(m.t, s.s, tok, w, refuse, fmt.Sprintf("Writable %d", s.s.Writable()))
		if !refuse {
			s.toks[tok] = w
		}
	}
}

// batch grows up to three live sequences at once, chosen and sized by arg's bits:
// all or nothing.
func (m *cacheModel) batch(arg int) {
	t := m.t
	var batch []kv.Growth
	var grown []*mseq
	over := false
	for k := range min(len(m.seqs), 1+arg%3) {
		s := m.seqs[(arg/3+k)%len(m.seqs)]
		n := (arg >> (2 + 2*k)) % 4 * 3
		batch = append(batch, kv.Growth{Seq: s.s, Tokens: n})
		grown = append(grown, s)
		over = over || len(s.toks)+n > fuzzMaxTokens
	}
	m.step = fmt.Sprintf("AppendBatch of %d", len(batch))
	err := m.e.c.AppendBatch(batch)
	if over {
		require.ErrorIs(t, err, kv.ErrTooLong)
		return
	}
	require.NoError(t, err)
	for i, s := range grown {
		from := len(s.toks)
		s.toks = append(s.toks, make([]uint64, batch[i].Tokens)...)
		m.write(s, from, len(s.toks))
	}
}

// closeSeq closes the i-th live sequence and drops it from the model.
func (m *cacheModel) closeSeq(i int) {
	s := m.seqs[i]
	out := s.s.Close()
	require.True(m.t, out.OK(), "%v", out)
	again := s.s.Close()
	assert.ErrorIs(m.t, again.Err, kv.ErrClosed, "a second Close")
	m.seqs = append(m.seqs[:i], m.seqs[i+1:]...)
	if s.from != nil {
		s.from.users--
		m.forget(s.from)
	}
}

// forget drops p from the model once it is freed.
func (m *cacheModel) forget(p *mprefix) {
	if p.live() {
		return
	}
	m.prefixes = slices.DeleteFunc(m.prefixes, func(q *mprefix) bool { return q == p })
}

// closeAll closes every sequence and releases every prefix, checking as it goes.
func (m *cacheModel) closeAll() {
	for len(m.seqs) > 0 {
		m.closeSeq(len(m.seqs) - 1)
		m.check()
	}
	for len(m.prefixes) > 0 {
		p := m.prefixes[0]
		require.False(m.t, p.released, "a released prefix with no user is freed")
		p.p.Release()
		p.released = true
		m.forget(p)
		m.check()
	}
	st := m.e.c.Stats()
	st.Owned = 0 // the pool's idle granules stay until the backing closes
	st.Refusals = 0
	assert.Equal(m.t, kv.Stats{}, st)
}

// check compares the cache with the model.
func (m *cacheModel) check() {
	t := m.t
	c := m.e.c
	g := tiny8
	cfg := c.Config()
	committed := modelOf(cfg, c.Granularity()).committed
	var tokens, mapped int64
	byID := map[uint64]kv.SequenceStats{}
	for _, ss := range c.SequenceStats() {
		byID[ss.ID] = ss
	}
	buf := make([]byte, g.Groups[0].TokenBytes())
	for _, s := range m.seqs {
		require.Equal(t, len(s.toks), s.s.Len(), "seq %d: length", s.s.ID())
		assert.LessOrEqual(t, s.s.Writable(), max(s.s.Len(), 0)+1, "seq %d: Writable", s.s.ID())
		tokens += int64(len(s.toks))
		mapped += committed(len(s.toks))
		assert.Equal(t, committed(len(s.toks)), byID[s.s.ID()].Committed, "seq %d: committed bytes", s.s.ID())
		for tok, w := range s.toks {
			if w == 0 {
				continue
			}
			for layer := range g.Layers {
				for _, kind := range kv.KindsOf(g) {
					require.NoError(t, s.s.ReadToken(layer, kind, tok, buf))
					if i := testutil.TokenAt(buf, w, layer, kind, tok); i >= 0 {
						require.Failf(t, "a token lost its bytes", "seq %d token %d layer %d %v byte %d: got %d, want %d (writer %d)",
							s.s.ID(), tok, layer, kind, i, buf[i], testutil.TokenByte(w, layer, kind, tok, i), w)
					}
				}
			}
		}
	}
	for _, p := range m.prefixes {
		mapped += committed(len(p.toks))
	}
	st := c.Stats()
	assert.Equal(t, len(m.seqs), st.Sequences)
	assert.Equal(t, len(m.prefixes), st.Prefixes)
	assert.Equal(t, tokens, st.Tokens)
	m.e.books(t, m.step)
	assert.Equal(t, mapped, m.e.auth.Stats().Mapped, "the ledger maps what the sequences and prefixes hold")
	if t.Failed() {
		t.Log(errors.New(m.step))
	}
}
