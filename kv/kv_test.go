package kv_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

func TestAppendGrowsInGranuleSteps(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}))
			c := e.c
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
				assert.Equal(t, sz.Committed, e.auth.Stats().Owned, "owned = committed; nothing pooled by the fake")
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
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 512, Layout: layout, BlockTokens: blockTokensFor(layout)}))
			c := e.c
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
			assert.Equal(t, st.Owned, e.auth.Stats().Owned)
			assert.Less(t, st.Owned, st.Committed, "shared granules are owned once")

			for _, s := range append(seqs, child, root) {
				assert.True(t, s.Close().OK())
			}
			assert.Equal(t, kv.Stats{}, holdings(c))
		})
	}
}

func TestSharedMemoryIsOwnedOnce(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 2048, Layout: kv.PerLayer}))
	c := e.c
	src, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, src.Append(1024)) // 1024 × 512 B = 128 granules per tensor
	p, err := src.Freeze(1024)
	require.NoError(t, err)
	assert.True(t, src.Close().OK())
	perTensor := int64(1024 * tiny8.Groups[0].TokenBytes())
	prefixBytes := perTensor * int64(2*tiny8.Layers)
	assert.Equal(t, prefixBytes, e.auth.Stats().Owned)

	var seqs []*fakeSeq
	for range 64 {
		s, err := c.NewSequenceFrom(p)
		require.NoError(t, err)
		seqs = append(seqs, s)
	}
	p.Release()
	st := c.Stats()
	assert.Equal(t, prefixBytes, e.auth.Stats().Owned, "64 sequences on the prefix own it once")
	assert.Equal(t, prefixBytes, st.Owned)
	assert.Equal(t, 64*prefixBytes, st.Shared, "each of the 64 sequences maps it")
	assert.Equal(t, 64*prefixBytes, st.Committed)
	assert.Equal(t, e.auth.Stats().Mapped, st.Mapped)
	for _, s := range seqs {
		assert.True(t, s.Close().OK())
	}
}

func TestBudgetRefusesWaitsAdmitsFIFO(t *testing.T) {
	// Room for exactly 2 sequences of 8 tokens (one granule per tensor, 6 tensors).
	perSeq := int64(2 * tiny8.Layers * fakeGranule)
	e := openEnv(t, withLimit(2*perSeq), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
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
	assert.Equal(t, 2*perSeq, e.auth.Stats().Owned)

	// A cancelled wait leaks nothing.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	assert.ErrorIs(t, w1.AppendCtx(ctx, 1), context.DeadlineExceeded)
	cancel()
	assert.Equal(t, 0, w1.Len())
	assert.Equal(t, 2*perSeq, e.auth.Stats().Owned)

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
		require.Eventually(t, func() bool { return e.gov.Stats(accounting.HostKey).Waiters == 1+i }, 5*time.Second, time.Millisecond)
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
	e := openEnv(t, noCache, withLimit(1<<30))
	_, err := kv.New(e.fake, kv.Config{Model: kv.Model{}, MaxTokens: 8})
	assert.ErrorIs(t, err, kv.ErrModel)
	_, err = kv.New(e.fake, kv.Config{Model: tiny8, MaxTokens: 0})
	assert.ErrorIs(t, err, kv.ErrConfig)
	_, err = kv.New(e.fake, kv.Config{Model: tiny8, MaxTokens: 1 << 62})
	assert.ErrorIs(t, err, kv.ErrConfig, "overflowing reservation")
	// 1 was the token-major layout, removed: a Config that still names it is refused
	// like any other unknown layout, never read as another.
	for _, l := range []kv.Layout{1, 3, 9} {
		_, err = kv.New(e.fake, kv.Config{Model: tiny8, MaxTokens: 8, Layout: l})
		assert.ErrorIs(t, err, kv.ErrConfig, "layout %d", l)
		_, err = kv.Config{Model: tiny8, MaxTokens: 8, Layout: l}.Size(fakeGranule, 1)
		assert.ErrorIs(t, err, kv.ErrConfig, "layout %d", l)
		assert.Equal(t, fmt.Sprintf("Layout(%d)", l), l.String())
	}
	assert.Equal(t, kv.Layout(0), kv.Blocked, "Blocked is the zero value")
	assert.Equal(t, kv.Layout(2), kv.PerLayer, "PerLayer keeps its number")
	_, err = kv.New(e.fake, kv.Config{Model: tiny8, MaxTokens: 8, Authority: e.auth})
	assert.ErrorIs(t, err, kv.ErrConfig, "a ByBacking backing must not be charged twice")
	private := backingtest.NewFake(backingtest.FakeOptions{Granularity: fakeGranule})
	_, err = kv.New(private, kv.Config{Model: tiny8, MaxTokens: 8})
	assert.ErrorIs(t, err, kv.ErrConfig, "a ByBuffer backing needs an authority")

	c := e.cache(t, kv.Config{MaxTokens: 16, Layout: kv.PerLayer})
	s, err := c.NewSequence()
	require.NoError(t, err)
	assert.ErrorIs(t, s.Append(-1), kv.ErrRange)
	assert.ErrorIs(t, s.Append(17), kv.ErrTooLong)
	require.NoError(t, s.Append(4))
	assert.ErrorIs(t, s.Truncate(5), kv.ErrRange)
	assert.ErrorIs(t, s.Truncate(-1), kv.ErrRange)
	_, err = s.Freeze(5)
	assert.ErrorIs(t, err, kv.ErrRange)
	tok := make([]byte, tiny8.Groups[0].TokenBytes())
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
	pc, err := kv.New(private, kv.Config{Model: tiny8, MaxTokens: 8, Authority: gov.Authority("kv", accounting.HostKey)})
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

func TestConcurrentStress(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 128, Layout: kv.PerLayer}))
	c := e.c
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
