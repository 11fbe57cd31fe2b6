package kv_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// tiny8 has 8-head tokens of 512 bytes: a 4 KiB granule holds 8 tokens, so tests cross
// many granule boundaries with little memory.
var tiny8 = kv.Geometry{Name: "tiny8", Layers: 3, KVHeads: 4, HeadDim: 64, DType: kv.Tiny.DType}

const fakeGranule = 4 << 10

type (
	fakeCache = kv.Cache
	fakeSeq   = kv.Sequence
)

type fixture struct {
	gov  *accounting.Governor
	pool *accounting.Authority
	fake *backingtest.Fake
}

func newFixture(t *testing.T, limit int64) *fixture {
	t.Helper()
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, limit))
	pool := gov.Authority("pool", accounting.HostKey)
	f := backingtest.NewFake(backingtest.FakeOptions{Granularity: fakeGranule, Authority: pool})
	t.Cleanup(func() {
		assert.Zero(t, f.LiveGranules(), "granules leaked")
		assert.Zero(t, f.LiveReservations(), "reservations leaked")
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
		assert.Zero(t, pool.Stats().Mapped, "mappings left behind")
	})
	return &fixture{gov: gov, pool: pool, fake: f}
}

func (fx *fixture) cache(t *testing.T, layout kv.Layout, maxTokens int) *fakeCache {
	t.Helper()
	c, err := kv.New(fx.fake, kv.Config{Geometry: tiny8, MaxTokens: maxTokens, Layout: layout, BlockTokens: blockTokensFor(layout)})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// testBlockTokens is the block the fake-backed tests ask the Blocked layout for:
// tiny8's default block on a 4 KiB granule holds one token (3 KiB, 1 KiB free), so
// they ask for 4 tokens a block (three granules, none free), which puts several tokens
// in a block and makes the prefix cache's unit a block of several granules. The host
// tests (64 KiB granules) and some fuzz inputs keep the default block.
const testBlockTokens = 4

// blockTokensFor returns the Config.BlockTokens the fake-backed tests give layout.
func blockTokensFor(l kv.Layout) int {
	if l == kv.Blocked {
		return testBlockTokens
	}
	return 0
}

// modelLayout is the tests' own arithmetic of where a layout puts tokens, written
// apart from kv's.
type modelLayout struct{ nbuf, row, tpb, blk, gran int }

func modelOf(cfg kv.Config, gran int) modelLayout {
	g := cfg.Geometry
	switch cfg.Layout {
	case kv.PerLayer:
		return modelLayout{nbuf: 2 * g.Layers, row: g.TokenBytes(), gran: gran}
	case kv.PerSequence:
		return modelLayout{nbuf: 1, row: g.BytesPerToken(), gran: gran}
	}
	blk := (max(cfg.BlockTokens, 1)*g.BytesPerToken() + gran - 1) / gran * gran
	return modelLayout{nbuf: 1, tpb: blk / g.BytesPerToken(), blk: blk, gran: gran}
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

// pattern is the byte at index i of token t of (layer, kind) written by writer w.
func pattern(w uint64, layer int, kind kv.Kind, t, i int) byte {
	return byte(w*131 + uint64(layer)*31 + uint64(kind)*17 + uint64(t)*7 + uint64(i)*3)
}

// writeTokens writes tokens [from, to) of every tensor of s as writer w.
func writeTokens(t *testing.T, s *kv.Sequence, w uint64, from, to int) {
	t.Helper()
	require.NoError(t, tryWrite(s, w, from, to))
}

// tryWrite is writeTokens that returns the first error.
func tryWrite(s *kv.Sequence, w uint64, from, to int) error {
	g := s.Cache().Config().Geometry
	buf := make([]byte, g.TokenBytes())
	for layer := range g.Layers {
		for _, kind := range []kv.Kind{kv.K, kv.V} {
			for tok := from; tok < to; tok++ {
				for i := range buf {
					buf[i] = pattern(w, layer, kind, tok, i)
				}
				if err := s.WriteToken(layer, kind, tok, buf); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// checkTokens checks that tokens [from, to) of s hold writer w's pattern.
func checkTokens(t *testing.T, s *kv.Sequence, w uint64, from, to int) {
	t.Helper()
	require.NoError(t, tryCheck(s, w, from, to))
}

var errCorrupt = errors.New("data corrupted")

// tryCheck is checkTokens that returns the first error; corruption matches errCorrupt.
func tryCheck(s *kv.Sequence, w uint64, from, to int) error {
	g := s.Cache().Config().Geometry
	buf := make([]byte, g.TokenBytes())
	for layer := range g.Layers {
		for _, kind := range []kv.Kind{kv.K, kv.V} {
			for tok := from; tok < to; tok++ {
				if err := s.ReadToken(layer, kind, tok, buf); err != nil {
					return err
				}
				for i := range buf {
					if buf[i] != pattern(w, layer, kind, tok, i) {
						return fmt.Errorf("%w: seq %d layer %d %v token %d byte %d: got %d, want %d (writer %d)", errCorrupt, s.ID(), layer, kind, tok, i, buf[i], pattern(w, layer, kind, tok, i), w)
					}
				}
			}
		}
	}
	return nil
}

// tokenAddr returns the address of token tok of layer's K or V tensor of s, from the
// accessors a kernel has: Base, TokenStride, and BlockTokens and BlockStride in the
// Blocked layout.
func tokenAddr(s *kv.Sequence, layer int, kind kv.Kind, tok int) uintptr {
	if bt := s.BlockTokens(); bt > 0 {
		return s.Base(layer, kind) + uintptr(tok/bt*s.BlockStride()+tok%bt*s.TokenStride())
	}
	return s.Base(layer, kind) + uintptr(tok*s.TokenStride())
}

// viewShape returns the shape of a layer's view of s.
func viewShape(s *kv.Sequence) []int {
	g := s.Cache().Config().Geometry
	if bt := s.BlockTokens(); bt > 0 {
		return []int{(s.Len() + bt - 1) / bt, bt, g.KVHeads, g.HeadDim}
	}
	return []int{s.Len(), g.KVHeads, g.HeadDim}
}

func bases(s *kv.Sequence) []uintptr {
	var out []uintptr
	for layer := range s.Cache().Config().Geometry.Layers {
		out = append(out, s.Base(layer, kv.K), s.Base(layer, kv.V))
	}
	return out
}

var layouts = []kv.Layout{kv.Blocked, kv.PerLayer, kv.PerSequence}

func TestAppendGrowsInGranuleSteps(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			fx := newFixture(t, 1<<30)
			c := fx.cache(t, layout, 256)
			s, err := c.NewSequence()
			require.NoError(t, err)
			b0 := bases(s)
			for n := 1; n <= 100; n++ {
				require.NoError(t, s.Append(1))
				assert.Equal(t, n, s.Len())
				sz, err := c.Config().Size(fakeGranule, n)
				require.NoError(t, err)
				st := c.Stats()
				assert.Equal(t, modelOf(c.Config(), fakeGranule).committed(n), sz.Committed, "tokens %d", n)
				assert.Equal(t, sz.Committed, st.Committed, "tokens %d", n)
				assert.Equal(t, sz.Waste, st.Waste)
				assert.Equal(t, int64(n*tiny8.BytesPerToken()), st.Used)
				assert.Equal(t, sz.Committed, fx.pool.Stats().Owned, "owned = committed; nothing pooled by the fake")
			}
			writeTokens(t, s, 1, 0, 100)
			checkTokens(t, s, 1, 0, 100)
			assert.Equal(t, b0, bases(s), "bases never move")
			assert.ErrorIs(t, s.Append(157), kv.ErrTooLong)
			require.NoError(t, s.Append(156))
			assert.True(t, s.Close().OK())
		})
	}
}

func TestIntegrityAcrossSharingForkTruncate(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			fx := newFixture(t, 1<<30)
			c := fx.cache(t, layout, 512)
			root, err := c.NewSequence()
			require.NoError(t, err)
			rootBases := bases(root)
			require.NoError(t, root.Append(45)) // not a whole number of granules in either layout
			writeTokens(t, root, 1, 0, 45)

			prefix, err := root.Freeze(37)
			require.NoError(t, err)
			assert.Equal(t, 37, prefix.Len())

			var seqs []*fakeSeq
			for i := range 4 {
				s, err := c.NewSequenceFrom(prefix)
				require.NoError(t, err)
				assert.Same(t, prefix, s.Prefix())
				require.Equal(t, 37, s.Len())
				checkTokens(t, s, 1, 0, 37)
				require.NoError(t, s.Append(20+i))
				writeTokens(t, s, uint64(10+i), 37, s.Len())
				seqs = append(seqs, s)
			}
			prefix.Release()

			// Fork the second sequence, then let both grow apart.
			child, err := seqs[1].Fork()
			require.NoError(t, err)
			require.Equal(t, seqs[1].Len(), child.Len())
			require.NoError(t, child.Append(9))
			writeTokens(t, child, 99, seqs[1].Len(), child.Len())
			require.NoError(t, seqs[1].Append(3))
			writeTokens(t, seqs[1], 11, seqs[1].Len()-3, seqs[1].Len())

			// Truncate into the shared region and regrow: never writes shared memory.
			require.NoError(t, seqs[0].Truncate(13))
			assert.Equal(t, 13, seqs[0].Len())
			assert.LessOrEqual(t, seqs[0].Writable(), 13)
			require.NoError(t, seqs[0].Append(30))
			writeTokens(t, seqs[0], 50, 13, 43)

			// Everything is intact.
			checkTokens(t, root, 1, 0, 45)
			checkTokens(t, seqs[0], 1, 0, 13)
			checkTokens(t, seqs[0], 50, 13, 43)
			for i, s := range seqs[1:] {
				checkTokens(t, s, 1, 0, 37)
				checkTokens(t, s, uint64(11+i), 37, 37+21+i)
			}
			checkTokens(t, child, 1, 0, 37)
			checkTokens(t, child, 11, 37, 37+21)
			checkTokens(t, child, 99, 37+21, child.Len())
			assert.Equal(t, rootBases, bases(root))

			st := c.Stats()
			assert.Greater(t, st.Shared, int64(0))
			assert.Equal(t, st.Owned, fx.pool.Stats().Owned)
			assert.Less(t, st.Owned, st.Committed, "shared granules are owned once")

			for _, s := range append(seqs, child, root) {
				assert.True(t, s.Close().OK())
			}
			assert.Equal(t, kv.Stats{}, holdings(c))
		})
	}
}

func TestSharedMemoryIsOwnedOnce(t *testing.T) {
	fx := newFixture(t, 1<<30)
	c := fx.cache(t, kv.PerLayer, 2048)
	src, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, src.Append(1024)) // 1024 × 512 B = 128 granules per tensor
	p, err := src.Freeze(1024)
	require.NoError(t, err)
	assert.True(t, src.Close().OK())
	perTensor := int64(1024 * tiny8.TokenBytes())
	prefixBytes := perTensor * int64(2*tiny8.Layers)
	assert.Equal(t, prefixBytes, fx.pool.Stats().Owned)

	var seqs []*fakeSeq
	for range 64 {
		s, err := c.NewSequenceFrom(p)
		require.NoError(t, err)
		seqs = append(seqs, s)
	}
	p.Release()
	st := c.Stats()
	assert.Equal(t, prefixBytes, fx.pool.Stats().Owned, "64 sequences on the prefix own it once")
	assert.Equal(t, prefixBytes, st.Owned)
	assert.Equal(t, 64*prefixBytes, st.Shared, "each of the 64 sequences maps it")
	assert.Equal(t, 64*prefixBytes, st.Committed)
	assert.Equal(t, fx.pool.Stats().Mapped, st.Mapped)
	for _, s := range seqs {
		assert.True(t, s.Close().OK())
	}
}

func TestBudgetRefusesWaitsAdmitsFIFO(t *testing.T) {
	// Room for exactly 2 sequences of 8 tokens (one granule per tensor, 6 tensors).
	perSeq := int64(2 * tiny8.Layers * fakeGranule)
	fx := newFixture(t, 2*perSeq)
	c := fx.cache(t, kv.PerLayer, 64)
	a, err := c.NewSequence()
	require.NoError(t, err)
	b, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, a.Append(8))
	require.NoError(t, b.Append(8))

	w1, err := c.NewSequence()
	require.NoError(t, err)
	w2, err := c.NewSequence()
	require.NoError(t, err)
	err = w1.Append(1)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded, "refuses at once")
	assert.Equal(t, 0, w1.Len(), "and changes nothing")
	assert.Equal(t, 2*perSeq, fx.pool.Stats().Owned)

	// A cancelled wait leaks nothing.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	assert.ErrorIs(t, w1.AppendCtx(ctx, 1), context.DeadlineExceeded)
	cancel()
	assert.Equal(t, 0, w1.Len())
	assert.Equal(t, 2*perSeq, fx.pool.Stats().Owned)

	// Two waiters: admitted in arrival order as memory comes back.
	order := make(chan int, 2)
	var wg sync.WaitGroup
	for i, s := range []*fakeSeq{w1, w2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			assert.NoError(t, s.AppendCtx(context.Background(), 8))
			order <- i
		}()
		// Queued in the governor, not only counted by the cache (which counts a wait
		// before it queues): else the second could queue first.
		require.Eventually(t, func() bool { return fx.gov.Stats(accounting.HostKey).Waiters == 1+i }, 5*time.Second, time.Millisecond)
	}
	assert.Equal(t, int64(3), c.Stats().Waits)
	assert.True(t, a.Close().OK())
	assert.Equal(t, 0, <-order, "the first waiter is served first")
	assert.True(t, b.Close().OK())
	assert.Equal(t, 1, <-order)
	wg.Wait()
	assert.True(t, w1.Close().OK())
	assert.True(t, w2.Close().OK())
}

func TestBadInputs(t *testing.T) {
	fx := newFixture(t, 1<<30)
	_, err := kv.New(fx.fake, kv.Config{Geometry: kv.Geometry{}, MaxTokens: 8})
	assert.ErrorIs(t, err, kv.ErrGeometry)
	_, err = kv.New(fx.fake, kv.Config{Geometry: tiny8, MaxTokens: 0})
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.New(fx.fake, kv.Config{Geometry: tiny8, MaxTokens: 1 << 62})
	assert.ErrorIs(t, err, kv.ErrConfig, "overflowing reservation")
	_, err = kv.New(fx.fake, kv.Config{Geometry: tiny8, MaxTokens: 8, Layout: kv.Layout(9)})
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.New(fx.fake, kv.Config{Geometry: tiny8, MaxTokens: 8, Authority: fx.pool})
	assert.ErrorIs(t, err, kv.ErrConfig, "a ByBacking backing must not be charged twice")
	private := backingtest.NewFake(backingtest.FakeOptions{Granularity: fakeGranule})
	_, err = kv.New(private, kv.Config{Geometry: tiny8, MaxTokens: 8})
	assert.ErrorIs(t, err, kv.ErrConfig, "a ByBuffer backing needs an authority")

	c := fx.cache(t, kv.PerLayer, 16)
	s, err := c.NewSequence()
	require.NoError(t, err)
	assert.ErrorIs(t, s.Append(-1), kv.ErrRange)
	assert.ErrorIs(t, s.Append(17), kv.ErrTooLong)
	require.NoError(t, s.Append(4))
	assert.ErrorIs(t, s.Truncate(5), kv.ErrRange)
	assert.ErrorIs(t, s.Truncate(-1), kv.ErrRange)
	_, err = s.Freeze(5)
	assert.ErrorIs(t, err, kv.ErrRange)
	tok := make([]byte, tiny8.TokenBytes())
	assert.ErrorIs(t, s.WriteToken(0, kv.K, 4, tok), kv.ErrRange, "past Len")
	assert.ErrorIs(t, s.WriteToken(3, kv.K, 0, tok), kv.ErrRange, "no such layer")
	assert.ErrorIs(t, s.WriteToken(0, kv.Kind(2), 0, tok), kv.ErrRange)
	assert.ErrorIs(t, s.WriteToken(0, kv.K, 0, tok[1:]), kv.ErrRange, "short token")
	assert.ErrorIs(t, s.ReadToken(0, kv.V, -1, tok), kv.ErrRange)
	_, err = s.Bytes(0, kv.K)
	assert.ErrorIs(t, err, kv.ErrLayout, "fake memory is not host memory")
	assert.Panics(t, func() { s.Base(7, kv.K) })
	assert.Equal(t, 4, s.Len(), "bad inputs changed nothing")

	p, err := s.Freeze(4)
	require.NoError(t, err)
	p.Release()
	assert.PanicsWithValue(t, kv.PanicPrefixReleased, func() { p.Release() })
	assert.PanicsWithValue(t, kv.PanicPrefixReleased, func() { _, _ = c.NewSequenceFrom(p) })
	assert.ErrorIs(t, c.Close(), kv.ErrBusy, "a live sequence keeps the cache open")

	assert.True(t, s.Close().OK())
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _ = s.Append(1) })
	again := s.Close()
	assert.Equal(t, accounting.Failed, again.Status, "a second Close changes nothing")
	assert.ErrorIs(t, again.Err, kv.ErrClosed)

	// Without sharing, prefixes and forks are refused clearly.
	gov := accounting.NewGovernor()
	pc, err := kv.New(private, kv.Config{Geometry: tiny8, MaxTokens: 8, Authority: gov.Authority("kv", accounting.HostKey)})
	require.NoError(t, err)
	ps, err := pc.NewSequence()
	require.NoError(t, err)
	_, err = ps.Fork()
	assert.ErrorIs(t, err, kv.ErrNoSharing)
	_, err = ps.Freeze(0)
	assert.ErrorIs(t, err, kv.ErrNoSharing)
	assert.True(t, ps.Close().OK())
	require.NoError(t, pc.Close())
	_, err = pc.NewSequence()
	assert.ErrorIs(t, err, kv.ErrClosed)
}

type faultySeq = kv.Sequence

// scenario runs create, append, share, fork, truncate and close on c, checking the
// data it wrote as it goes; it returns the first error. Sequences that survive a
// failure are checked before they are closed: a failure elsewhere must not touch them.
func scenario(c *kv.Cache) (err error) {
	type written struct {
		s        *faultySeq
		w        uint64
		from, to int
	}
	var live []*faultySeq
	var checks []written
	defer func() {
		if err != nil {
			for _, ck := range checks {
				if !ck.s.Damaged() {
					if cerr := tryCheck(ck.s, ck.w, ck.from, ck.to); errors.Is(cerr, errCorrupt) {
						err = errors.Join(err, cerr)
					}
				}
			}
		}
		for _, s := range live {
			if out := s.Close(); !out.OK() && err == nil {
				err = out.Err
			}
		}
	}()
	write := func(s *faultySeq, w uint64, from, to int) error {
		if err := tryWrite(s, w, from, to); err != nil {
			return err
		}
		checks = append(checks, written{s, w, from, to})
		return nil
	}
	root, err := c.NewSequence()
	if err != nil {
		return err
	}
	live = append(live, root)
	if err := root.Append(21); err != nil {
		return err
	}
	if err := write(root, 1, 0, 21); err != nil {
		return err
	}
	p, err := root.Freeze(19)
	if err != nil {
		return err
	}
	defer p.Release()
	s, err := c.NewSequenceFrom(p)
	if err != nil {
		return err
	}
	live = append(live, s)
	if err := s.Append(10); err != nil {
		return err
	}
	checks = append(checks, written{s, 1, 0, 19})
	if err := write(s, 2, 19, 29); err != nil {
		return err
	}
	f, err := s.Fork()
	if err != nil {
		return err
	}
	live = append(live, f)
	if err := f.Truncate(11); err != nil {
		return err
	}
	checks = append(checks, written{f, 1, 0, 11})
	if err := f.Append(5); err != nil {
		return err
	}
	if err := write(f, 3, 11, 16); err != nil {
		return err
	}
	for _, ck := range checks {
		if err := tryCheck(ck.s, ck.w, ck.from, ck.to); err != nil {
			return err
		}
	}
	return nil
}

func TestFaultInjectionAtEveryBackingCall(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			fx := newFixture(t, 1<<30)
			faulty := backingtest.NewFaulty[*backingtest.FakeReservation](fx.fake)
			c, err := kv.New(faulty, kv.Config{Geometry: tiny8, MaxTokens: 64, Layout: layout})
			require.NoError(t, err)
			require.NoError(t, scenario(c))
			calls := faulty.Calls()
			require.Greater(t, calls, 10)
			boom := errors.New("injected")
			failed := 0
			for n := 1; n <= calls; n++ {
				faulty.Reset()
				faulty.FailAt(n, boom)
				// NB: a failed release is retried once, so a fault there may be absorbed.
				if err := scenario(c); err != nil {
					failed++
					require.ErrorIs(t, err, boom, "call %d", n)
					require.NotErrorIs(t, err, errCorrupt, "call %d", n)
				}
				faulty.Reset()
				// The ledger balances and nothing is left mapped after every failure.
				assert.Zero(t, fx.fake.LiveGranules(), "call %d: granules left", n)
				assert.Zero(t, fx.fake.LiveReservations(), "call %d: reservations left", n)
				assert.Zero(t, fx.pool.Stats().Owned, "call %d", n)
				assert.Zero(t, fx.pool.Stats().Mapped, "call %d", n)
				assert.Equal(t, kv.Stats{}, holdings(c), "call %d", n)
			}
			assert.Greater(t, failed, calls*3/4, "most injected faults surface as errors")
			require.NoError(t, scenario(c), "works again once faults stop")
			require.NoError(t, c.Close())
		})
	}
}

func TestConcurrentStress(t *testing.T) {
	fx := newFixture(t, 1<<30)
	c := fx.cache(t, kv.PerLayer, 128)
	root, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, root.Append(20))
	writeTokens(t, root, 1, 0, 20)
	p, err := root.Freeze(20)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range 25 {
				var s *fakeSeq
				var err error
				if i%2 == 0 {
					s, err = c.NewSequenceFrom(p)
				} else {
					s, err = c.NewSequence()
				}
				if !assert.NoError(t, err) {
					return
				}
				start := s.Len()
				n := 1 + rng.IntN(30)
				assert.NoError(t, s.Append(n))
				writeTokens(t, s, uint64(100+w), start, s.Len())
				f, err := s.Fork()
				if assert.NoError(t, err) {
					assert.NoError(t, f.Truncate(rng.IntN(f.Len()+1)))
					assert.NoError(t, f.Append(3))
					_ = c.Stats()
					assert.True(t, f.Close().OK())
				}
				checkTokens(t, s, uint64(100+w), start, s.Len())
				if start > 0 {
					checkTokens(t, s, 1, 0, start)
				}
				assert.True(t, s.Close().OK())
			}
		}()
	}
	wg.Wait()
	p.Release()
	checkTokens(t, root, 1, 0, 20)
	assert.True(t, root.Close().OK())
}

func TestPresetsAndSizing(t *testing.T) {
	assert.Equal(t, 2048, kv.Llama3_8B.TokenBytes())
	assert.Equal(t, 128<<10, kv.Llama3_8B.BytesPerToken())
	g, err := kv.Preset("LLAMA3-8B")
	require.NoError(t, err)
	assert.Equal(t, kv.Llama3_8B, g)
	_, err = kv.Preset("gpt-9")
	assert.ErrorIs(t, err, kv.ErrUnknownModel)
	assert.Contains(t, err.Error(), "llama3-70b")
	for _, p := range kv.Presets() {
		assert.NoError(t, p.Validate(), p.Name)
	}
	bad := []kv.Geometry{{Layers: 0, KVHeads: 1, HeadDim: 1, DType: kv.Tiny.DType}, {Layers: 1, KVHeads: -1, HeadDim: 1, DType: kv.Tiny.DType}, {Layers: 1, KVHeads: 1, HeadDim: 1}, {Layers: 1 << 30, KVHeads: 1 << 20, HeadDim: 1 << 20, DType: kv.Tiny.DType}}
	for _, b := range bad {
		assert.ErrorIs(t, b.Validate(), kv.ErrGeometry, "%+v", b)
	}

	// Llama-3-8B at 1,000 tokens: per-layer waste is up to one granule per tensor.
	tests := []struct {
		layout    kv.Layout
		granule   int
		committed int64
	}{
		{kv.PerLayer, 64 << 10, 64 * 32 * (64 << 10)},  // 1000×2 KiB = 31.25 granules → 32 per tensor
		{kv.PerLayer, 2 << 20, 64 * (2 << 20)},         // one 2 MiB granule per tensor
		{kv.PerSequence, 64 << 10, 1000 * (128 << 10)}, // rows of 128 KiB fill granules exactly
		{kv.PerSequence, 2 << 20, 63 * (2 << 20)},      // 125,000 KiB → 62.5 → 63 granules
		{kv.Blocked, 64 << 10, 1000 * (128 << 10)},     // a block of two granules holds one token
		{kv.Blocked, 2 << 20, 63 * (2 << 20)},          // 16 tokens a block: 62.5 → 63 blocks
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v/granule=%dKiB", tt.layout, tt.granule>>10), func(t *testing.T) {
			s, err := kv.Config{Geometry: kv.Llama3_8B, Layout: tt.layout, MaxTokens: 2048}.Size(tt.granule, 1000)
			require.NoError(t, err)
			assert.Equal(t, int64(1000*(128<<10)), s.Used)
			assert.Equal(t, tt.committed, s.Committed)
			assert.Equal(t, s.Committed-s.Used, s.Waste)
			assert.Equal(t, int64(2048*(128<<10)), s.Reserved)
		})
	}
	_, err = kv.Config{Geometry: kv.Llama3_8B, Layout: kv.PerLayer, MaxTokens: 2}.Size(3, 1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Geometry: kv.Llama3_8B, Layout: kv.Blocked, MaxTokens: 2}.Size(3, 1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Geometry: kv.Llama3_8B, Layout: kv.Layout(9), MaxTokens: 2}.Size(4096, 1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Geometry: kv.Llama3_8B, Layout: kv.PerLayer, MaxTokens: 2}.Size(4096, 3)
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.Config{Geometry: kv.Geometry{}, Layout: kv.PerLayer, MaxTokens: 2}.Size(4096, 1)
	assert.ErrorIs(t, err, kv.ErrGeometry)
}

// Blocked's waste is the bytes at each block's end that hold no whole token, plus the
// free tokens of the last block; BlockTokens asks for larger blocks.
func TestBlockedSize(t *testing.T) {
	q := kv.Qwen25_7B // 56 KiB a token: a 2 MiB granule holds 36 of them, 32 KiB free
	tests := []struct {
		name                   string
		granule, block, tokens int
		blockTokens, committed int
		reserved               int64
	}{
		{"64KiB", 64 << 10, 0, 10, 1, 10 * (64 << 10), 1000 * (64 << 10)},
		{"2MiB", 2 << 20, 0, 100, 36, 3 * (2 << 20), 28 * (2 << 20)},
		{"2MiB/exact", 2 << 20, 0, 72, 36, 2 * (2 << 20), 28 * (2 << 20)},
		{"2MiB/BlockTokens=37", 2 << 20, 37, 100, 73, 2 * (4 << 20), 14 * (4 << 20)},
		{"2MiB/BlockTokens=128", 2 << 20, 128, 1, 146, 8 << 20, 7 * (8 << 20)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := kv.Config{Geometry: q, Layout: kv.Blocked, BlockTokens: tt.block, MaxTokens: 1000}
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
		{Geometry: q, Layout: kv.Blocked, BlockTokens: -1, MaxTokens: 10},
		{Geometry: q, Layout: kv.PerSequence, BlockTokens: 4, MaxTokens: 10},
		{Geometry: q, Layout: kv.PerLayer, BlockTokens: 4, MaxTokens: 10},
		{Geometry: q, Layout: kv.Blocked, BlockTokens: math.MaxInt / 2, MaxTokens: 10},
		{Geometry: q, Layout: kv.Blocked, MaxTokens: math.MaxInt / 2},
		{Geometry: q, Layout: kv.Blocked, MaxTokens: 1},
	} {
		_, err := cfg.Size(2<<20, 2)
		assert.ErrorIs(t, err, kv.ErrConfig, "%+v", cfg)
		fx := newFixture(t, 1<<30)
		_, err = kv.New(fx.fake, cfg)
		if cfg.MaxTokens > 1 {
			assert.ErrorIs(t, err, kv.ErrConfig, "New(%+v)", cfg)
		}
	}
}

// In the Blocked layout token t of (layer l, kind k) lies at (t/T)·block + ((2l+k)·T +
// t%T)·TokenBytes of the sequence's range; forks share whole blocks only and copy the
// tokens of the partly filled last one.
func TestBlockedAddresses(t *testing.T) {
	fx := newFixture(t, 1<<30)
	g := kv.Tiny // 256 bytes a token: a 4 KiB granule is a block of 16 tokens
	c, err := kv.New(fx.fake, kv.Config{Geometry: g, MaxTokens: 256})
	require.NoError(t, err)
	defer func() { assert.NoError(t, c.Close()) }()
	require.Equal(t, kv.Blocked, c.Config().Layout, "the default layout")
	s, err := c.NewSequence()
	require.NoError(t, err)
	assert.Equal(t, 16, s.BlockTokens())
	assert.Equal(t, fakeGranule, s.BlockStride())
	assert.Equal(t, g.TokenBytes(), s.TokenStride())
	for l := range g.Layers {
		for _, k := range []kv.Kind{kv.K, kv.V} {
			assert.Equal(t, uintptr((2*l+int(k))*16*g.TokenBytes()), s.Base(l, k)-s.Base(0, kv.K), "layer %d %v", l, k)
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
	assert.Equal(t, []int{3, 16, g.KVHeads, g.HeadDim}, v.Shape())
	assert.Equal(t, []int{fakeGranule / 2, g.TokenBytes() / 2, g.HeadDim, 1}, v.Strides())
	assert.Equal(t, s.Base(1, kv.V), v.DevicePtr())
	for _, tok := range []int{0, 15, 16, 39} {
		want := s.Base(0, kv.K) + uintptr(tok/16*fakeGranule+(3*16+tok%16)*g.TokenBytes())
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
	assert.ErrorIs(t, f.WriteToken(0, kv.K, 15, make([]byte, g.TokenBytes())), kv.ErrReadOnly)
	require.NoError(t, f.Append(10))
	writeTokens(t, f, 3, 20, 30)
	checkTokens(t, f, 1, 0, 20)
	checkTokens(t, s, 1, 0, 16)
	closeAll(t, f, s)
}

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
