package kv_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// groupGranule is small so that the tiny hybrid model's windows cross many granules
// (and blocks) in a few tokens.
const groupGranule = 256

// tinyHybrid has one group of each kind: a sliding window of 5 tokens on layers 0
// and 3, one full layer, a chunked-local layer (chunks of 9), an MLA layer (one latent
// of 48 bytes: blocks of 256 bytes hold 5 tokens and 16 bytes of waste) and a
// recurrent layer.
var tinyHybrid = kv.Model{Name: "tiny-hybrid", Layers: 6, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 5, Layers: []int{0, 3}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.ChunkedLocal, Window: 9, Layers: []int{2}, KVHeads: 1, HeadDim: 32, DType: arena.Float16},
	{Kind: kv.MLALatent, Layers: []int{4}, KVHeads: 1, HeadDim: 24, DType: arena.Float16},
	{Kind: kv.Recurrent, Layers: []int{5}, StateBytes: 100},
}}

// tinyDead has 192-byte tokens in every group: on groupGranule granules a full
// group's default block is 4 tokens in 3 granules, no byte dead, while its window
// groups (windows of 6) take blocks of 1 token a granule, 64 bytes dead, since half
// their window bounds their blocks: the default's two cases side by side.
var tinyDead = kv.Model{Name: "tiny-dead", Layers: 6, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 6, Layers: []int{0, 1, 2}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{3, 4}, KVHeads: 1, HeadDim: 24, DType: arena.Float16},
	{Kind: kv.ChunkedLocal, Window: 6, Layers: []int{5}, KVHeads: 3, HeadDim: 16, DType: arena.Float16},
}}

const groupMaxTokens = 200

// tensorRef is one per-token tensor of a model: a layer, its kind and its group.
type tensorRef struct {
	layer int
	kind  kv.Kind
	group kv.Group
}

// tensorsOf returns every per-token tensor of m, and its recurrent layers.
func tensorsOf(m kv.Model) (tensors []tensorRef, states []int) {
	for _, g := range m.Groups {
		for _, l := range g.Layers {
			switch g.Kind {
			case kv.Recurrent:
				states = append(states, l)
			case kv.MLALatent:
				tensors = append(tensors, tensorRef{l, kv.K, g})
			default:
				tensors = append(tensors, tensorRef{l, kv.K, g}, tensorRef{l, kv.V, g})
			}
		}
	}
	return tensors, states
}

// refSeq is the plain model of one sequence: every token of every tensor it wrote,
// and each recurrent layer's state.
type refSeq struct {
	s      *kv.Sequence
	tokens [][][]byte // [tensor][token]
	states [][]byte   // [recurrent layer]; nil while the sequence is empty
	// dropAt is the length the window groups give back from: FirstLive of it. An
	// append from n tokens raises it to n; Truncate(0) resets it, a fork sets it.
	dropAt int
}

// groupModel drives a cache on a Model and the plain model side by side.
type groupModel struct {
	t    *testing.T
	gran int
	// ledger is where the cache's granules are charged; live, when not nil, counts
	// the backing's physical granules (a pooling backing's idle ones hide from it).
	ledger  *accounting.Authority
	live    func() int
	held    bool // map-ahead's worker is held off (HoldAhead): check leaves the ledger be
	c       *kv.Cache
	m       kv.Model
	tensors []tensorRef
	states  []int
	seqs    []*refSeq
	rnd     *rand.Rand
	seen    *groupCounts
	// prefixes are the prefixes frozen so far (on a model without recurrent
	// groups), held by the test until closeAll.
	prefixes []*kv.Prefix
}

// groupCounts is what a run of operations went through, so that a test can tell its
// operations reached the cases it means to check.
type groupCounts struct{ forks, refused, dropped, shared, frozen int }

// fakeGroups are the options of the group tests' env: a sharing Fake of
// groupGranule granules.
var fakeGroups = []envOption{withGranule(groupGranule), withLimit(1 << 30)}

// newGroupModel returns the model of a run on a cache of m in layout with blocks of
// bt tokens, on a fresh env of opts; it counts live granules where the backing is a
// Fake (a pool's idle granules hide them elsewhere).
func newGroupModel(t *testing.T, opts []envOption, m kv.Model, layout kv.Layout, bt int, seed uint64) *groupModel {
	cfg := kv.Config{Model: m, Layout: layout, BlockTokens: bt, MaxTokens: groupMaxTokens}
	e := openEnv(t, append([]envOption{withConfig(cfg)}, opts...)...)
	var live func() int
	if e.fake != nil {
		live = e.fake.LiveGranules
	}
	tensors, states := tensorsOf(m)
	return &groupModel{t: t, gran: e.c.Granularity(), ledger: e.auth, live: live, c: e.c, m: m, tensors: tensors, states: states,
		rnd: rand.New(rand.NewPCG(seed, 25)), seen: &groupCounts{}}
}

func (gm *groupModel) newSeq() {
	s, err := gm.c.NewSequence()
	require.NoError(gm.t, err)
	gm.seqs = append(gm.seqs, &refSeq{s: s, tokens: make([][][]byte, len(gm.tensors))})
}

func (gm *groupModel) bytes(n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(gm.rnd.Uint32())
	}
	return p
}

// appendTo grows r by k tokens and writes each new token of every tensor (and a
// fresh state when the sequence had none).
func (gm *groupModel) appendTo(r *refSeq, k int) {
	t := gm.t
	n := r.s.Len()
	if err := r.s.Append(k); n+k > groupMaxTokens {
		require.ErrorIs(t, err, kv.ErrTooLong)
		return
	} else {
		require.NoError(t, err)
	}
	r.dropAt = max(r.dropAt, n)
	for i, tr := range gm.tensors {
		tb := tr.group.TokenBytes()
		p := gm.bytes(k * tb)
		require.NoError(t, r.s.WriteTokens(tr.layer, tr.kind, n, n+k, p), "layer %d %v", tr.layer, tr.kind)
		for j := range k {
			r.tokens[i] = append(r.tokens[i], p[j*tb:(j+1)*tb])
		}
	}
	if r.states == nil && k > 0 {
		r.states = make([][]byte, len(gm.states))
		for i, l := range gm.states {
			st := gm.bytes(gm.stateBytes(l))
			require.NoError(t, r.s.WriteState(l, st))
			r.states[i] = st
		}
	}
}

func (gm *groupModel) stateBytes(layer int) int {
	st, err := gm.c.LayerStrides(layer)
	require.NoError(gm.t, err)
	return st.StateBytes
}

// allowed reports whether a sequence whose window groups hold r's tokens can be cut
// (or forked) to n tokens: no window group has dropped a token the next step reads
// (stepReads).
func (gm *groupModel) allowed(r *refSeq, n int) bool {
	for _, tr := range gm.tensors {
		if from := stepReads(tr.group, n); from < n && r.s.FirstHeld(tr.layer) > from {
			return false
		}
	}
	return true
}

func (gm *groupModel) truncate(r *refSeq, n int) {
	ok := gm.allowed(r, n)
	err := r.s.Truncate(n)
	if !ok {
		require.ErrorIs(gm.t, err, kv.ErrDropped, "truncate to %d of %d", n, r.s.Len())
		gm.seen.refused++
		return
	}
	require.NoError(gm.t, err, "truncate to %d", n)
	for i := range r.tokens {
		r.tokens[i] = r.tokens[i][:n]
	}
	if n == 0 {
		r.states = nil // given back with the last token
		r.dropAt = 0
	}
}

func (gm *groupModel) fork(r *refSeq, n int) {
	ok := gm.allowed(r, n)
	need, nerr := r.s.ForkNeed(n)
	require.NoError(gm.t, nerr)
	child, err := r.s.ForkAt(n)
	if !ok {
		require.ErrorIs(gm.t, err, kv.ErrDropped, "fork at %d of %d", n, r.s.Len())
		gm.seen.refused++
		return
	}
	require.NoError(gm.t, err, "fork at %d", n)
	gm.seen.forks++
	if gm.c.Pool() == nil {
		for _, ss := range gm.c.SequenceStats() {
			if ss.ID == child.ID() {
				require.Equal(gm.t, ss.Committed-ss.Shared, need, "ForkNeed(%d): the copied tails", n)
			}
		}
	}
	cr := &refSeq{s: child, tokens: make([][][]byte, len(gm.tensors)), dropAt: n}
	for i := range r.tokens {
		cr.tokens[i] = append([][]byte(nil), r.tokens[i][:n]...)
	}
	if n > 0 {
		cr.states = append([][]byte(nil), r.states...)
	}
	gm.seqs = append(gm.seqs, cr)
}

// freeze makes a prefix of r's first n tokens and starts a new sequence on it: the
// new sequence holds what a fork at n would, and the prefix each group's units from
// the one that holds its FirstLive(n) on.
func (gm *groupModel) freeze(r *refSeq, n int) {
	t := gm.t
	ok := gm.allowed(r, n)
	p, err := r.s.Freeze(n)
	if !ok {
		require.ErrorIs(t, err, kv.ErrDropped, "freeze at %d of %d", n, r.s.Len())
		gm.seen.refused++
		return
	}
	require.NoError(t, err, "freeze at %d", n)
	gm.prefixes = append(gm.prefixes, p)
	gm.seen.frozen++
	require.Equal(t, n, p.Len())
	require.Equal(t, p.Mapped(), p.Committed(), "a prefix commits what it spans")
	var want, need int64
	for _, g := range gm.m.Groups {
		need += int64(n-g.FirstLive(n)) * int64(g.BytesPerToken())
	}
	require.Equal(t, need, p.Requested(), "the live tokens' bytes")
	if n > 0 {
		// What the prefix commits is what a sequence of n tokens commits, less the
		// partly filled unit it copies (the same, Blocked; the last granule,
		// PerLayer): never more than Size's.
		sz, err := gm.c.Config().Size(gm.gran, n)
		require.NoError(t, err)
		want = sz.Committed
		require.LessOrEqual(t, p.Committed(), want)
		require.GreaterOrEqual(t, p.Committed(), p.Requested())
	}
	s, err := gm.c.NewSequenceFrom(p)
	require.NoError(t, err)
	require.Same(t, p, s.Prefix())
	cr := &refSeq{s: s, tokens: make([][][]byte, len(gm.tensors)), dropAt: n}
	for i := range r.tokens {
		cr.tokens[i] = append([][]byte(nil), r.tokens[i][:n]...)
	}
	gm.seqs = append(gm.seqs, cr)
}

// check reads every token of every tensor of every sequence back against the plain
// model: the held ones match, the dropped ones fail with ErrDropped; each sequence
// commits exactly what Config.Size says, and the ledger maps what the sequences do.
func (gm *groupModel) check(what string) {
	t := gm.t
	t.Helper()
	if gm.ahead() && !gm.held {
		gm.c.WaitAhead() // NB: at rest, what windows left behind is given back
	}
	var committed int64
	for _, r := range gm.seqs {
		s, n := r.s, r.s.Len()
		for i, tr := range gm.tensors {
			held := s.FirstHeld(tr.layer)
			require.Len(t, r.tokens[i], n)
			switch tr.group.Kind {
			case kv.SlidingWindow, kv.ChunkedLocal:
				require.LessOrEqual(t, held, tr.group.FirstLive(n), "%s: layer %d holds from %d", what, tr.layer, held)
			default:
				require.Zero(t, held, "%s: a %v layer drops nothing", what, tr.group.Kind)
			}
			tb := tr.group.TokenBytes()
			if n > held {
				got := make([]byte, (n-held)*tb)
				require.NoError(t, s.ReadTokens(tr.layer, tr.kind, held, n, got))
				require.True(t, bytes.Equal(bytes.Join(r.tokens[i][held:], nil), got), "%s: layer %d %v tokens [%d, %d)", what, tr.layer, tr.kind, held, n)
				one := make([]byte, tb)
				tok := held + gm.rnd.IntN(n-held)
				require.NoError(t, s.ReadToken(tr.layer, tr.kind, tok, one))
				require.Equal(t, r.tokens[i][tok], one)
				if gm.c.Pool() != nil && tr.group.DType == arena.Float16 {
					gm.checkViews(s, tr, held, tok, r.tokens[i][tok])
				}
			}
			if held > 0 {
				gm.seen.dropped++
				dropped := gm.rnd.IntN(held)
				require.ErrorIs(t, s.ReadToken(tr.layer, tr.kind, dropped, make([]byte, tb)), kv.ErrDropped, "%s: dropped token %d", what, dropped)
				require.ErrorIs(t, s.WriteToken(tr.layer, tr.kind, dropped, make([]byte, tb)), kv.ErrDropped)
			}
		}
		for i, l := range gm.states {
			got := make([]byte, gm.stateBytes(l))
			if r.states == nil {
				require.ErrorIs(t, s.ReadState(l, got), kv.ErrRange, "%s: an empty sequence has no state", what)
				continue
			}
			require.NoError(t, s.ReadState(l, got))
			require.Equal(t, r.states[i], got, "%s: state of layer %d", what, l)
		}
		want := gm.committed(r)
		if r.dropAt == n-1 || n == 0 {
			// After a step that appended one token, the sequence holds what Size says.
			sz, err := gm.c.Config().Size(gm.gran, n)
			require.NoError(t, err)
			require.Equal(t, sz.Committed, want, "%s: the plain model and Size agree", what)
		}
		var st kv.SequenceStats
		for _, ss := range gm.c.SequenceStats() {
			if ss.ID == s.ID() {
				st = ss
			}
		}
		require.Equal(t, want, st.Committed, "%s: sequence %d of %d tokens (windows from %d) commits exactly its units", what, s.ID(), n, r.dropAt)
		committed += st.Committed
	}
	cs := gm.c.Stats()
	require.Equal(t, committed, cs.Committed, what)
	if cs.Shared > 0 {
		gm.seen.shared++
	}
	for _, p := range gm.prefixes {
		committed += p.Committed()
	}
	if gm.ahead() {
		if gm.held {
			return // NB: the ledger maps what windows left behind too, until the worker rests
		}
		committed += cs.Ahead // the runs mapped ahead, at rest
	}
	l := gm.ledger.Stats()
	require.Equal(t, committed, l.Mapped, "%s: the ledger maps what the sequences and the prefixes commit", what)
	if gm.live != nil {
		require.Equal(t, int64(gm.live())*int64(gm.gran), l.Owned, "%s: the ledger owns the live granules", what)
	}
}

// ahead reports whether the cache maps ahead (Config.MapAhead on a pool).
func (gm *groupModel) ahead() bool { return gm.c.Config().MapAhead && gm.c.Pool() != nil }

// committed returns what r's ranges commit in the plain model of the layouts: each
// group's units from the one that holds FirstLive(dropAt) (0 for a group that reads
// every token) to the end of its last token; a recurrent state's granules once the
// sequence has a token.
func (gm *groupModel) committed(r *refSeq) int64 { return gm.committedAt(r.s.Len(), r.dropAt) }

// committedAt is committed for a sequence of n tokens whose windows give back from
// dropAt.
func (gm *groupModel) committedAt(n, dropAt int) int64 {
	var total int64
	for _, g := range gm.m.Groups {
		st, err := gm.c.LayerStrides(g.Layers[0])
		require.NoError(gm.t, err)
		if g.Kind == kv.Recurrent {
			if n > 0 {
				total += int64(roundUp(len(g.Layers)*g.StateBytes, gm.gran))
			}
			continue
		}
		first := 0
		if g.Kind == kv.SlidingWindow || g.Kind == kv.ChunkedLocal {
			first = g.FirstLive(dropAt)
		}
		if cfg := gm.c.Config(); cfg.Layout == kv.Blocked {
			bt, blk := st.BlockTokens, st.BlockStride
			total += int64((n+bt-1)/bt-first/bt) * int64(blk)
			continue
		}
		ranges := len(g.Layers) * g.TensorsPerLayer()
		per := roundUp(n*st.TokenBytes, gm.gran) - first*st.TokenBytes/gm.gran*gm.gran
		total += int64(ranges) * int64(per)
	}
	return total
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// checkViews reads token tok (whose bytes are want) of tr through a View and a Run
// on the host: a window group's view starts at its first held token's block.
func (gm *groupModel) checkViews(s *kv.Sequence, tr tensorRef, held, tok int, want []byte) {
	t := gm.t
	v, err := kv.View[arena.F16](s, tr.layer, tr.kind)
	require.NoError(t, err)
	st, err := gm.c.LayerStrides(tr.layer)
	require.NoError(t, err)
	heads, hd := tr.group.KVHeads, tr.group.HeadDim
	at := func(h, d int) arena.F16 {
		if st.BlockTokens > 0 {
			return v.At(append(blockIndex(st, tok, held), h, d)...)
		}
		return v.At(tok-held, h, d)
	}
	run, err := kv.Run[arena.F16](s, tr.layer, tr.kind, tok)
	require.NoError(t, err)
	wantElems := make([]arena.F16, heads*hd)
	for i := range wantElems {
		wantElems[i] = arena.F16(binary.LittleEndian.Uint16(want[2*i:]))
	}
	require.Equal(t, wantElems, run[:heads*hd], "layer %d %v token %d by Run", tr.layer, tr.kind, tok)
	// The view, at a few elements: its indexing, not the bytes again.
	for _, i := range []int{0, heads*hd - 1, gm.rnd.IntN(heads * hd)} {
		if got := at(i/hd, i%hd); got != wantElems[i] {
			t.Fatalf("layer %d %v token %d element %d by View: %v, want %v", tr.layer, tr.kind, tok, i, got, wantElems[i])
		}
	}
	if gm.c.Config().Layout == kv.PerLayer {
		b, err := s.Bytes(tr.layer, tr.kind)
		require.NoError(t, err)
		require.Equal(t, want, b[(tok-held)*len(want):][:len(want)], "by Bytes")
	}
}

// step runs one random operation.
func (gm *groupModel) step(op byte) string {
	if len(gm.seqs) == 0 {
		gm.newSeq()
		return "new"
	}
	r := gm.seqs[gm.rnd.IntN(len(gm.seqs))]
	n := r.s.Len()
	switch op % 8 {
	case 0, 1, 2:
		k := 1 + gm.rnd.IntN(12)
		gm.appendTo(r, k)
		return fmt.Sprintf("append %d to %d", k, n)
	case 3:
		// A batch step of every sequence, one token each.
		batch := make([]kv.Growth, 0, len(gm.seqs))
		for _, q := range gm.seqs {
			if q.s.Len() < groupMaxTokens {
				batch = append(batch, kv.Growth{Seq: q.s, Tokens: 1})
			}
		}
		// Need is what the step commits before the windows give back: on the Fake,
		// which pools nothing, every byte of it.
		var want int64
		for _, q := range gm.seqs {
			if n := q.s.Len(); n < groupMaxTokens {
				want += gm.committedAt(n+1, q.dropAt) - gm.committedAt(n, q.dropAt)
			}
		}
		need, err := gm.c.Need(batch)
		require.NoError(gm.t, err)
		if gm.c.Pool() == nil {
			require.Equal(gm.t, want, need, "Need of a batch step")
		}
		require.NoError(gm.t, gm.c.AppendBatch(batch))
		for _, g := range batch {
			for _, q := range gm.seqs {
				if q.s == g.Seq {
					q.dropAt = max(q.dropAt, q.s.Len()-1)
					gm.rewriteLast(q)
				}
			}
		}
		return "batch"
	case 4:
		m := n - gm.rnd.IntN(min(n, 6)+1)
		if gm.rnd.IntN(4) == 0 {
			m = gm.rnd.IntN(n + 1)
		}
		gm.truncate(r, m)
		return fmt.Sprintf("truncate %d to %d", n, m)
	case 5:
		m := n - gm.rnd.IntN(min(n, 4)+1)
		if len(gm.seqs) < 6 {
			if len(gm.states) == 0 && gm.rnd.IntN(2) == 0 {
				gm.freeze(r, m)
				return fmt.Sprintf("freeze %d at %d", n, m)
			}
			gm.fork(r, m)
		}
		return fmt.Sprintf("fork %d at %d", n, m)
	case 6:
		if len(gm.seqs) > 1 {
			i := gm.rnd.IntN(len(gm.seqs))
			require.True(gm.t, gm.seqs[i].s.Close().OK())
			gm.seqs = append(gm.seqs[:i], gm.seqs[i+1:]...)
			return "close"
		}
		gm.newSeq()
		return "new"
	default:
		if len(gm.states) > 0 && r.states != nil {
			i := gm.rnd.IntN(len(gm.states))
			r.states[i] = gm.bytes(len(r.states[i]))
			require.NoError(gm.t, r.s.WriteState(gm.states[i], r.states[i]))
			return "state"
		}
		gm.appendTo(r, 1)
		return "append 1"
	}
}

// rewriteLast writes the last token of every tensor of q, which a batch step just
// appended (and a fresh state for a sequence that had none).
func (gm *groupModel) rewriteLast(q *refSeq) {
	n := q.s.Len()
	for i, tr := range gm.tensors {
		p := gm.bytes(tr.group.TokenBytes())
		require.NoError(gm.t, q.s.WriteToken(tr.layer, tr.kind, n-1, p))
		q.tokens[i] = append(q.tokens[i], p)
	}
	if q.states == nil {
		q.states = make([][]byte, len(gm.states))
		for i, l := range gm.states {
			q.states[i] = gm.bytes(gm.stateBytes(l))
			require.NoError(gm.t, q.s.WriteState(l, q.states[i]))
		}
	}
}

func (gm *groupModel) closeAll() {
	for _, r := range gm.seqs {
		require.True(gm.t, r.s.Close().OK())
	}
	gm.seqs = nil
	for _, p := range gm.prefixes {
		p.Release()
	}
	gm.prefixes = nil
}

// runGroupOps drives ops against the plain model on each layout, checking after every
// operation.
func runGroupOps(t *testing.T, opts []envOption, m kv.Model, seed uint64, ops []byte) groupCounts {
	var seen groupCounts
	for _, lay := range []struct {
		layout kv.Layout
		bt     int
	}{{kv.Blocked, 0}, {kv.Blocked, 3}, {kv.PerLayer, 0}} {
		t.Run(fmt.Sprintf("%v/bt=%d", lay.layout, lay.bt), func(t *testing.T) {
			gm := newGroupModel(t, opts, m, lay.layout, lay.bt, seed)
			var release func()
			for i, op := range ops {
				if gm.ahead() && op&0x80 != 0 && release == nil {
					// The worker held off over a few ops: what windows leave stays
					// behind, for the ops that settle it or a growth that drains it.
					release = gm.c.HoldAhead()
				}
				what := gm.step(op)
				if release != nil && op&0x40 != 0 {
					release()
					release = nil
				}
				gm.held = release != nil
				gm.check(fmt.Sprintf("op %d (%s)", i, what))
			}
			if release != nil {
				release()
				gm.held = false
			}
			gm.closeAll()
			gm.check("closed")
			seen.forks += gm.seen.forks
			seen.refused += gm.seen.refused
			seen.dropped += gm.seen.dropped
			seen.shared += gm.seen.shared
			seen.frozen += gm.seen.frozen
		})
	}
	return seen
}

// tinyWindows is tinyHybrid without its recurrent group (its layer 5 is full
// attention): a model a prefix can be frozen from.
var tinyWindows = withoutRecurrent(tinyHybrid, "tiny-windows")

// withoutRecurrent returns m, whose full-attention group is its second, with its
// recurrent groups' layers moved into that group.
func withoutRecurrent(m kv.Model, name string) kv.Model {
	out := kv.Model{Name: name, Layers: m.Layers}
	var moved []int
	for _, g := range m.Groups {
		if g.Kind == kv.Recurrent {
			moved = append(moved, g.Layers...)
			continue
		}
		g.Layers = slices.Clone(g.Layers)
		out.Groups = append(out.Groups, g)
	}
	out.Groups[1].Layers = append(out.Groups[1].Layers, moved...)
	return out
}

// TestGroupOps: every token of every group reads back after random growth, window
// moves, forks, truncates and batch steps, and every sequence commits exactly what
// Config.Size says (so the granules a window leaves go back: the ledger owns only
// the live ones). On tinyWindows, a model without recurrent groups, the runs freeze
// prefixes too: every token of every group of a sequence started on a prefix
// (NewSequenceFrom) reads back against the plain model, a freeze the windows can not
// serve is refused with ErrDropped, and the ledger maps exactly what the sequences
// and the prefixes commit.
func TestGroupOps(t *testing.T) {
	for _, tt := range []struct {
		m    kv.Model
		want func(t *testing.T, seen groupCounts)
	}{
		{tinyHybrid, func(t *testing.T, seen groupCounts) {
			assert.Positive(t, seen.forks, "forks")
			assert.Positive(t, seen.refused, "truncates and forks refused for dropped tokens")
			assert.Positive(t, seen.dropped, "reads of dropped tokens")
			assert.Positive(t, seen.shared, "states with shared granules")
		}},
		{tinyDead, func(t *testing.T, seen groupCounts) {
			assert.Positive(t, seen.forks, "forks")
			assert.Positive(t, seen.frozen, "prefixes")
			assert.Positive(t, seen.dropped, "reads of dropped tokens")
			assert.Positive(t, seen.shared, "states with shared granules")
		}},
		{tinyWindows, func(t *testing.T, seen groupCounts) {
			assert.Positive(t, seen.frozen, "prefixes")
			assert.Positive(t, seen.forks, "forks")
			assert.Positive(t, seen.refused, "truncates, forks and freezes refused for dropped tokens")
		}},
	} {
		for seed := range uint64(4) {
			t.Run(fmt.Sprintf("model=%s/seed=%d", tt.m.Name, seed), func(t *testing.T) {
				tt.want(t, runGroupOps(t, fakeGroups, tt.m, seed, randomOps(seed, 120)))
			})
		}
	}
}

// randomOps returns n operations drawn from seed.
func randomOps(seed uint64, n int) []byte {
	rnd := rand.New(rand.NewPCG(seed, 1))
	ops := make([]byte, n)
	for i := range ops {
		ops[i] = byte(rnd.Uint32())
	}
	return ops
}

// FuzzGroupOps is TestGroupOps on fuzzed operations.
func FuzzGroupOps(f *testing.F) {
	f.Add(uint64(1), []byte{0, 0, 0, 0, 5, 4, 0, 3, 5, 6, 7})
	f.Add(uint64(2), []byte{1, 1, 1, 1, 1, 1, 4, 4, 4, 5, 5, 3, 3, 3})
	f.Fuzz(func(t *testing.T, seed uint64, ops []byte) {
		if len(ops) > 200 {
			ops = ops[:200]
		}
		runGroupOps(t, fakeGroups, tinyHybrid, seed, ops)
	})
}
