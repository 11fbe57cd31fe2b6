package kv_test

import (
	"errors"
	"fmt"
	"math/big"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// tiny8 has 8-head tokens of 512 bytes: a 4 KiB granule holds 8 tokens, so tests cross
// many granule boundaries with little memory.
var tiny8 = kv.Uniform("tiny8", 3, 4, 64, arena.Float16)

// fakeGranule is the granule of the tests' backingtest.Fake: envGranule.
const fakeGranule = envGranule

// atEveryCall runs run once for each of its first calls backing calls, with a fault
// injected at that call (e.faults: the env needs withFaults), and returns how many
// runs failed. A run that fails must fail with the injected error, never with
// corrupt data; after each, e's backing (a backingtest.Fake) and ledger must hold
// nothing, and after(n), when not nil, checks more.
func (e *env) atEveryCall(t *testing.T, calls int, run func() error, after func(n int)) int {
	t.Helper()
	boom := errors.New("injected")
	failed := 0
	for n := 1; n <= calls; n++ {
		e.faults.Reset()
		e.faults.FailAt(n, boom)
		if err := run(); err != nil {
			failed++
			require.ErrorIs(t, err, boom, "call %d", n)
			require.NotErrorIs(t, err, errCorrupt, "call %d", n)
		}
		e.faults.Reset()
		// The ledger balances and nothing is left mapped after every failure.
		assert.Zero(t, e.fake.LiveGranules(), "call %d: granules left", n)
		assert.Zero(t, e.fake.LiveReservations(), "call %d: reservations left", n)
		assert.Zero(t, e.auth.Stats().Owned, "call %d", n)
		assert.Zero(t, e.auth.Stats().Mapped, "call %d", n)
		if after != nil {
			after(n)
		}
	}
	return failed
}

// goWorkers starts work(w) for each w in [0, n) on a goroutine of its own and
// returns wait, which waits for them all and requires that none returned an error.
func goWorkers(n int, work func(w int) error) (wait func(t *testing.T)) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := work(w); err != nil {
				errs <- err
			}
		}()
	}
	return func(t *testing.T) {
		t.Helper()
		waitAll(t, &wg, errs)
	}
}

// waitAll waits for the goroutines of wg, which send their failures on errs, and
// requires that none failed.
func waitAll(t *testing.T, wg *sync.WaitGroup, errs chan error) {
	t.Helper()
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// testBlockTokens is the block the fake-backed tests ask the Blocked layout for:
// tiny8's default block on a 4 KiB granule holds one token (3 KiB, 1 KiB free), so
// they ask for 4 tokens a block (three granules, none free), which puts several tokens
// in a block and makes the prefix cache's unit a block of several granules. The host
// tests (64 KiB granules) and some fuzz inputs keep the default block.
const testBlockTokens = 4

// oldBlock returns, for layout, the Config.BlockTokens that asks the Blocked layout
// for the block the default chose before blocks were chosen per group (the fewest
// granules that hold one token): the tests whose figures were worked out on those
// blocks ask for them.
func oldBlock(l kv.Layout) int {
	if l == kv.Blocked {
		return 1
	}
	return 0
}

// blockTokensFor returns the Config.BlockTokens the fake-backed tests give layout.
func blockTokensFor(l kv.Layout) int {
	if l == kv.Blocked {
		return testBlockTokens
	}
	return 0
}

// modelLayout is the tests' own arithmetic of where a layout puts tokens, written
// apart from kv's (layout_test.go checks kv's against it): nt tensors of row bytes a
// token, in nbuf ranges; in the Blocked layout blocks of blk bytes, tpb tokens each,
// cut into runs of rt tokens.
type modelLayout struct{ nbuf, nt, row, tpb, blk, rt, gran int }

func modelOf(cfg kv.Config, gran int) modelLayout {
	g := cfg.Model
	nt := g.Layers * len(kv.KindsOf(g))
	switch cfg.Layout {
	case kv.PerLayer:
		return modelLayout{nbuf: nt, nt: nt, row: g.Groups[0].TokenBytes(), gran: gran}
	}
	tpb, blk := refBlock(g.Groups[0], gran, cfg.BlockTokens)
	return modelLayout{nbuf: 1, nt: nt, row: g.Groups[0].TokenBytes(), tpb: tpb, blk: blk, rt: refRun(tpb, cfg.RunTokens), gran: gran}
}

// refRun is the tests' own account of the runs a block of tpb tokens is cut into
// (Config.RunTokens' doc): rt where it is given and cuts the block into more than
// one, else the whole block, by counting the runs.
func refRun(tpb, rt int) int {
	if rt > 0 && tpb/rt > 1 && tpb/rt*rt == tpb {
		return rt
	}
	return tpb
}

// refBlock is the tests' own account of a group's block (blocks.go's rule), by
// search: for an override bt, the fewest granules that hold bt tokens, holding as
// many as fit; by default, of the blocks of t tokens in the fewest granules that hold
// them, for t up to the bound (512 or one granule's tokens, half a window at most),
// the one of least dead share, the fewest tokens of those.
func refBlock(g kv.Group, gran, bt int) (tpb, blk int) {
	bpt := g.BytesPerToken()
	if bt > 0 {
		blk = (bt*bpt + gran - 1) / gran * gran
		return blk / bpt, blk
	}
	bound := max(512, gran/bpt)
	if g.Kind == kv.SlidingWindow || g.Kind == kv.ChunkedLocal {
		bound = min(bound, max(1, g.Window/2))
	}
	var dead int
	for t := 1; t <= bound && (blk == 0 || dead > 0); t++ {
		b := (t*bpt + gran - 1) / gran * gran
		if d := b - t*bpt; blk == 0 || new(big.Int).Mul(big.NewInt(int64(d)), big.NewInt(int64(blk))).Cmp(new(big.Int).Mul(big.NewInt(int64(dead)), big.NewInt(int64(b)))) < 0 {
			tpb, blk, dead = t, b, d
		}
	}
	return tpb, blk
}

// committed returns the bytes of granules n tokens commit, all ranges together.
func (m modelLayout) committed(n int) int64 {
	if m.blk > 0 {
		return int64((n + m.tpb - 1) / m.tpb * m.blk)
	}
	return int64(m.nbuf * ((n*m.row + m.gran - 1) / m.gran * m.gran))
}

// kept returns the tokens wholly below the sharing unit (a granule, or a block) where
// token n starts: what a truncate to n keeps when it can not replace that unit.
func (m modelLayout) kept(n int) int {
	if m.blk > 0 {
		return n / m.tpb * m.tpb
	}
	return n * m.row / m.gran * m.gran / m.row
}

// writeTokens writes tokens [from, to) of every tensor of s as writer w.
func writeTokens(t *testing.T, s *kv.Sequence, w uint64, from, to int) {
	t.Helper()
	require.NoError(t, tryWrite(s, w, from, to))
}

// tryWrite is writeTokens that returns the first error.
func tryWrite(s *kv.Sequence, w uint64, from, to int) error {
	return eachToken(s, from, to, func(layer int, kind kv.Kind, tok int, buf []byte) error {
		testutil.FillToken(buf, w, layer, kind, tok)
		return s.WriteToken(layer, kind, tok, buf)
	})
}

// eachToken calls f on tokens [from, to) of every tensor of s, layer after layer,
// with a buffer of one token's bytes, and returns f's first error.
func eachToken(s *kv.Sequence, from, to int, f func(layer int, kind kv.Kind, tok int, buf []byte) error) error {
	g := s.Cache().Config().Model
	if !isUniform(g) {
		return eachModelToken(g, from, to, f)
	}
	buf := make([]byte, g.Groups[0].TokenBytes())
	for layer := range g.Layers {
		for _, kind := range kv.KindsOf(g) {
			for tok := from; tok < to; tok++ {
				if err := f(layer, kind, tok, buf); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// eachModelToken is eachToken on a cache of Model m (of per-token groups): every
// tensor of tensorsOf(m), in layer order, with its group's token bytes.
func eachModelToken(m kv.Model, from, to int, f func(layer int, kind kv.Kind, tok int, buf []byte) error) error {
	tensors, _ := tensorsOf(m)
	slices.SortStableFunc(tensors, func(a, b tensorRef) int { return a.layer - b.layer })
	for _, tr := range tensors {
		buf := make([]byte, tr.group.TokenBytes())
		for tok := from; tok < to; tok++ {
			if err := f(tr.layer, tr.kind, tok, buf); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeOrRefuse writes token tok of every tensor of s as writer w, and requires
// each write refused with ErrReadOnly when refuse, else done; where says where.
func writeOrRefuse(t *testing.T, s *kv.Sequence, tok int, w uint64, refuse bool, where string) {
	t.Helper()
	_ = eachToken(s, tok, tok+1, func(layer int, kind kv.Kind, _ int, buf []byte) error {
		testutil.FillToken(buf, w, layer, kind, tok)
		err := s.WriteToken(layer, kind, tok, buf)
		if refuse {
			require.ErrorIs(t, err, kv.ErrReadOnly, "%s: token %d layer %d %v", where, tok, layer, kind)
		} else {
			require.NoError(t, err, "%s: token %d layer %d %v", where, tok, layer, kind)
		}
		return nil
	})
}

// checkTokens checks that tokens [from, to) of s hold writer w's pattern.
func checkTokens(t *testing.T, s *kv.Sequence, w uint64, from, to int) {
	t.Helper()
	require.NoError(t, tryCheck(s, w, from, to))
}

var errCorrupt = errors.New("data corrupted")

// tryCheck is checkTokens that returns the first error; corruption matches errCorrupt.
func tryCheck(s *kv.Sequence, w uint64, from, to int) error {
	return eachToken(s, from, to, func(layer int, kind kv.Kind, tok int, buf []byte) error {
		if err := s.ReadToken(layer, kind, tok, buf); err != nil {
			return err
		}
		if i := testutil.TokenAt(buf, w, layer, kind, tok); i >= 0 {
			return fmt.Errorf("%w: seq %d layer %d %v token %d byte %d: got %d, want %d (writer %d)", errCorrupt, s.ID(), layer, kind, tok, i, buf[i], testutil.TokenByte(w, layer, kind, tok, i), w)
		}
		return nil
	})
}

// tokenOffset returns where token t of a layer's tensor lies from its Base, by the
// Strides doc's formula.
func tokenOffset(st kv.Strides, t int) int {
	if st.BlockTokens == 0 {
		return t * st.TokenStride
	}
	in := t % st.BlockTokens
	return t/st.BlockTokens*st.BlockStride + in/st.RunTokens*st.RunStride + in%st.RunTokens*st.TokenStride
}

// tokenAddr returns the address of token tok of layer's K or V tensor of s, from
// what a kernel has: Base and the layer's Strides.
func tokenAddr(s *kv.Sequence, layer int, kind kv.Kind, tok int) uintptr {
	return s.Base(layer, kind) + uintptr(tokenOffset(stridesOf(s, layer), tok))
}

// viewShape returns the shape of a layer's view of s.
func viewShape(s *kv.Sequence) []int {
	g := s.Cache().Config().Model
	if bt := s.BlockTokens(); bt > 0 {
		blocks := (s.Len() + bt - 1) / bt
		if st := stridesOf(s, 0); st.RunTokens < bt {
			return []int{blocks, bt / st.RunTokens, st.RunTokens, g.Groups[0].KVHeads, g.Groups[0].HeadDim}
		}
		return []int{blocks, bt, g.Groups[0].KVHeads, g.Groups[0].HeadDim}
	}
	return []int{s.Len(), g.Groups[0].KVHeads, g.Groups[0].HeadDim}
}

// stridesOf returns layer's Strides in s's cache.
func stridesOf(s *kv.Sequence, layer int) kv.Strides {
	st, err := s.Cache().LayerStrides(layer)
	if err != nil {
		panic(err)
	}
	return st
}

// blockIndex returns the leading indices of token t in a Blocked View whose first
// block is held's (the Strides doc): [block, token], or [block, run, token] where a
// block is cut into runs.
func blockIndex(st kv.Strides, t, held int) []int {
	b, in := t/st.BlockTokens-held/st.BlockTokens, t%st.BlockTokens
	if st.RunTokens < st.BlockTokens {
		return []int{b, in / st.RunTokens, in % st.RunTokens}
	}
	return []int{b, in}
}

func bases(s *kv.Sequence) []uintptr {
	var out []uintptr
	for layer := range s.Cache().Config().Model.Layers {
		out = append(out, s.Base(layer, kv.K), s.Base(layer, kv.V))
	}
	return out
}

var layouts = []kv.Layout{kv.Blocked, kv.PerLayer}

// tokenIO writes or checks tokens [from, to) of a sequence as writer w.
type tokenIO func(t *testing.T, s *kv.Sequence, w uint64, from, to int)

// shareForkTruncate checks data integrity on c across a prefix, a fork and a truncation
// into shared memory, and that bases never move; it closes everything it made. It
// writes and checks through WriteToken and ReadToken unless rw names other accessors.
// Its token counts suit a granule of up to 128 tokens per tensor.
func shareForkTruncate(t *testing.T, c *kv.Cache, rw ...tokenIO) {
	t.Helper()
	shareForkTruncateN(t, c, 1, rw...)
}

// shareForkTruncateN is shareForkTruncate with every token count n times larger, for
// a granule of up to 128n tokens per tensor: the frozen prefix and the truncated fork
// must still cover whole granules of a PerLayer tensor, or nothing is shared.
func shareForkTruncateN(t *testing.T, c *kv.Cache, n int, rw ...tokenIO) {
	t.Helper()
	write, check := tokenIO(writeTokens), tokenIO(checkTokens)
	if len(rw) == 2 {
		write, check = rw[0], rw[1]
	}
	root, err := c.NewSequence()
	require.NoError(t, err)
	b0 := bases(root)
	require.NoError(t, root.Append(300*n))
	write(t, root, 1, 0, 300*n)
	p, err := root.Freeze(250 * n)
	require.NoError(t, err)
	s, err := c.NewSequenceFrom(p)
	require.NoError(t, err)
	p.Release()
	require.NoError(t, s.Append(40*n))
	write(t, s, 2, 250*n, 290*n)
	f, err := s.Fork()
	require.NoError(t, err)
	require.NoError(t, f.Truncate(199*n))
	require.NoError(t, f.Append(50*n))
	write(t, f, 3, 199*n, 249*n)
	check(t, root, 1, 0, 300*n)
	check(t, s, 1, 0, 250*n)
	check(t, s, 2, 250*n, 290*n)
	check(t, f, 1, 0, 199*n)
	check(t, f, 3, 199*n, 249*n)
	assert.Equal(t, b0, bases(root))
	st := c.Stats()
	assert.Greater(t, st.Shared, int64(0))
	assert.Less(t, st.Owned, st.Committed, "shared granules are owned once")
	for _, q := range []*kv.Sequence{f, s, root} {
		assert.True(t, q.Close().OK())
	}
}

type fakeSeq = kv.Sequence
