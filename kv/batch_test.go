package kv_test

import (
	"context"
	"errors"
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

// perTensorGranule is the bytes one granule per tensor of a tiny8 sequence takes in
// the PerLayer layout: 8 tokens.
const perTensorGranule = int64(2 * 3 * fakeGranule)

func newSeqs(t *testing.T, c *kv.Cache, n int) []*kv.Sequence {
	t.Helper()
	seqs := make([]*kv.Sequence, n)
	for i := range seqs {
		s, err := c.NewSequence()
		require.NoError(t, err)
		seqs[i] = s
	}
	return seqs
}

func closeAll(t *testing.T, seqs ...*kv.Sequence) {
	t.Helper()
	for _, s := range seqs {
		assert.True(t, s.Close().OK())
	}
}

func lens(seqs []*kv.Sequence) []int {
	out := make([]int, len(seqs))
	for i, s := range seqs {
		out[i] = s.Len()
	}
	return out
}

func TestAppendBatchAllOrNothing(t *testing.T) {
	// Room for 5 granules per tensor in all: 40 tokens of one sequence.
	e := openEnv(t, withLimit(5*perTensorGranule), withConfig(kv.Config{MaxTokens: 256, Layout: kv.PerLayer}))
	c := e.c
	seqs := newSeqs(t, c, 3)

	batch := []kv.Growth{{seqs[0], 8}, {seqs[1], 9}, {seqs[2], 1}} // 1 + 2 + 1 granules per tensor
	need, err := c.Need(batch)
	require.NoError(t, err)
	assert.Equal(t, 4*perTensorGranule, need)
	require.NoError(t, c.AppendBatch(batch))
	assert.Equal(t, []int{8, 9, 1}, lens(seqs))
	writeTokens(t, seqs[1], 7, 0, 9)

	// Within the granules held: no new memory, Need 0.
	batch = []kv.Growth{{seqs[1], 7}, {seqs[2], 7}}
	need, err = c.Need(batch)
	require.NoError(t, err)
	assert.Zero(t, need)
	require.NoError(t, c.AppendBatch(batch))
	assert.Equal(t, []int{8, 16, 8}, lens(seqs))

	// 3 more granules per tensor where 1 is free: refused whole, with the figures a
	// scheduler acts on.
	owned := e.auth.Stats().Owned
	batch = []kv.Growth{{seqs[0], 1}, {seqs[1], 1}, {seqs[2], 1}}
	err = c.AppendBatch(batch)
	var be *accounting.BudgetError
	require.ErrorAs(t, err, &be)
	assert.True(t, accounting.CanWait(err))
	assert.Equal(t, 3*perTensorGranule, be.Requested)
	assert.Equal(t, perTensorGranule, be.Available)
	assert.Equal(t, 5*perTensorGranule, be.Limit)
	assert.Equal(t, []int{8, 16, 8}, lens(seqs), "no sequence grew")
	assert.Equal(t, owned, e.auth.Stats().Owned, "nothing held")
	checkTokens(t, seqs[1], 7, 0, 9)

	// Preempt: free what the refusal said is missing, and step again.
	assert.True(t, seqs[0].Close().OK())
	batch = []kv.Growth{{seqs[1], 1}, {seqs[2], 1}}
	need, err = c.Need(batch)
	require.NoError(t, err)
	assert.LessOrEqual(t, need, e.gov.Available(accounting.HostKey))
	require.NoError(t, c.AppendBatch(batch))
	assert.Equal(t, 17, seqs[1].Len())
	seqs = seqs[1:]

	// Larger than the whole limit: waiting can not help.
	err = c.AppendBatchCtx(context.Background(), []kv.Growth{{seqs[0], 200}})
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
	assert.False(t, accounting.CanWait(err))
	closeAll(t, seqs...)
}

// A batch step under a fault at every backing call it makes: every sequence grows or
// none does, the data is intact and the ledger exact.
func TestAppendBatchFaultInjection(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, noCache, withLimit(1<<30), withFaults)
			c := e.cache(t, kv.Config{Model: tiny8, MaxTokens: 256, Layout: layout, BlockTokens: oldBlock(layout)})
			step := func(seqs []*kv.Sequence) error {
				return c.AppendBatch([]kv.Growth{{seqs[0], 3}, {seqs[1], 20}, {seqs[2], 0}, {seqs[3], 9}})
			}
			setup := func() []*kv.Sequence {
				seqs := newSeqs(t, c, 4)
				for i, s := range seqs {
					require.NoError(t, s.Append(5+i))
					writeTokens(t, s, uint64(i), 0, s.Len())
				}
				return seqs
			}
			seqs := setup()
			e.faults.Reset()
			require.NoError(t, step(seqs))
			calls := e.faults.Calls()
			require.GreaterOrEqual(t, calls, 3, "the step commits in several ranges")
			closeAll(t, seqs...)

			boom := errors.New("injected")
			for n := 1; n <= calls; n++ {
				for _, undo := range []bool{false, true} {
					seqs := setup()
					owned := e.auth.Stats().Owned
					before := lens(seqs)
					e.faults.Reset()
					e.faults.FailAt(n, boom)
					if undo {
						e.faults.FailOp(backingtest.OpDecommit, 1, boom) // the rollback fails too
					}
					err := step(seqs)
					require.ErrorIs(t, err, boom, "call %d", n)
					e.faults.Reset()
					damaged := 0
					for i, s := range seqs {
						if s.Damaged() {
							damaged++
							continue
						}
						assert.Equal(t, before[i], s.Len(), "call %d: sequence %d grew alone", n, i)
						checkTokens(t, s, uint64(i), 0, s.Len())
					}
					if damaged == 0 {
						assert.Equal(t, owned, e.auth.Stats().Owned, "call %d: the refusal holds nothing", n)
					} else {
						assert.ErrorIs(t, err, kv.ErrDamaged, "call %d", n)
					}
					if !undo {
						assert.Zero(t, damaged, "call %d: a rollback that works damages nothing", n)
					}
					closeAll(t, seqs...)
					assert.Zero(t, e.auth.Stats().Owned, "call %d", n)
					assert.Zero(t, e.auth.Stats().Mapped, "call %d", n)
					assert.Equal(t, kv.Stats{}, holdings(c), "call %d", n)
				}
			}
		})
	}
}

func TestBatchBadInputs(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 16, Layout: kv.PerLayer}))
	c := e.c
	other := e.cache(t, kv.Config{MaxTokens: 16, Layout: kv.PerLayer})
	seqs := newSeqs(t, c, 2)
	foreign, err := other.NewSequence()
	require.NoError(t, err)
	defer closeAll(t, append(seqs, foreign)...)
	require.NoError(t, seqs[0].Append(4))

	tests := []struct {
		name  string
		batch []kv.Growth
		want  error
	}{
		{"nil sequence", []kv.Growth{{seqs[0], 1}, {nil, 1}}, kv.ErrBatch},
		{"another cache's", []kv.Growth{{seqs[0], 1}, {foreign, 1}}, kv.ErrBatch},
		{"twice", []kv.Growth{{seqs[0], 1}, {seqs[1], 1}, {seqs[0], 1}}, kv.ErrBatch},
		{"twice, alone", []kv.Growth{{seqs[0], 1}, {seqs[0], 1}}, kv.ErrBatch},
		{"negative", []kv.Growth{{seqs[1], 1}, {seqs[0], -1}}, kv.ErrRange},
		{"past MaxTokens", []kv.Growth{{seqs[1], 1}, {seqs[0], 13}}, kv.ErrTooLong},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Need(tt.batch)
			assert.ErrorIs(t, err, tt.want, "Need")
			assert.ErrorIs(t, c.AppendBatch(tt.batch), tt.want, "AppendBatch")
			assert.ErrorIs(t, c.AppendBatchCtx(context.Background(), tt.batch), tt.want, "AppendBatchCtx")
			assert.Equal(t, []int{4, 0}, lens(seqs), "nothing changed")
		})
	}
	_, err = seqs[0].Need(-1)
	assert.ErrorIs(t, err, kv.ErrRange)
	_, err = seqs[0].Need(13)
	assert.ErrorIs(t, err, kv.ErrTooLong)
	n, err := seqs[0].Need(12)
	require.NoError(t, err)
	assert.Equal(t, perTensorGranule, n)
	assert.NoError(t, c.AppendBatch(nil), "an empty step does nothing")
	assert.PanicsWithValue(t, kv.PanicNilContext, func() {
		//lint:ignore SA1012 the nil context is the point: the call must panic on it
		_ = c.AppendBatchCtx(nil, []kv.Growth{{seqs[0], 1}})
	})
	closed, err := c.NewSequence()
	require.NoError(t, err)
	require.True(t, closed.Close().OK())
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _ = c.AppendBatch([]kv.Growth{{closed, 1}}) })
	assert.PanicsWithValue(t, kv.PanicSequenceClosed, func() { _, _ = closed.Need(1) })
}

// Batch and single waiters are served in the order they queued, whichever kind.
func TestBatchAndSingleWaitersFIFO(t *testing.T) {
	// Room for exactly 4 granules per tensor.
	e := openEnv(t, withLimit(4*perTensorGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
	hold := newSeqs(t, c, 4)
	for _, s := range hold {
		require.NoError(t, s.Append(8))
	}
	batchSeqs := newSeqs(t, c, 2)
	single := newSeqs(t, c, 2)
	defer closeAll(t, append(batchSeqs, single...)...)

	order := make(chan string, 3)
	var wg sync.WaitGroup
	start := func(name string, fn func() error) {
		wg.Add(1)
		before := e.gov.Stats(accounting.HostKey).Waiters
		go func() {
			defer wg.Done()
			assert.NoError(t, fn())
			order <- name
		}()
		require.Eventually(t, func() bool { return e.gov.Stats(accounting.HostKey).Waiters == before+1 }, 5*time.Second, time.Millisecond)
	}
	ctx := context.Background()
	start("single-0", func() error { return single[0].AppendCtx(ctx, 8) })
	start("batch", func() error { return c.AppendBatchCtx(ctx, []kv.Growth{{batchSeqs[0], 8}, {batchSeqs[1], 8}}) })
	start("single-1", func() error { return single[1].AppendCtx(ctx, 8) })

	// One granule per tensor back: only the head fits, and it is served.
	assert.True(t, hold[0].Close().OK())
	assert.Equal(t, "single-0", <-order)
	// One more: the batch (two) still does not fit, and the single behind it waits.
	assert.True(t, hold[1].Close().OK())
	select {
	case got := <-order:
		t.Fatalf("%s overtook the batch at the head of the queue", got)
	case <-time.After(50 * time.Millisecond):
	}
	assert.True(t, hold[2].Close().OK())
	assert.Equal(t, "batch", <-order)
	assert.True(t, hold[3].Close().OK())
	assert.Equal(t, "single-1", <-order)
	wg.Wait()
	assert.Equal(t, []int{8, 8}, lens(batchSeqs))
	assert.Equal(t, int64(3), c.Stats().Waits)
}

// A cancelled batch wait changes nothing and holds nothing.
func TestAppendBatchCtxCancelled(t *testing.T) {
	e := openEnv(t, withLimit(2*perTensorGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
	seqs := newSeqs(t, c, 3)
	defer closeAll(t, seqs...)
	require.NoError(t, seqs[0].Append(16))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := c.AppendBatchCtx(ctx, []kv.Growth{{seqs[1], 1}, {seqs[2], 1}})
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Equal(t, []int{16, 0, 0}, lens(seqs))
	assert.Equal(t, 2*perTensorGranule, e.auth.Stats().Owned)
	assert.Zero(t, e.gov.Stats(accounting.HostKey).Waiters)
}

func TestForkAtIsolation(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 256, Layout: layout, BlockTokens: blockTokensFor(layout)}))
			c := e.c
			s, err := c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(40))
			writeTokens(t, s, 1, 0, 40)

			f, err := s.ForkAt(29)
			require.NoError(t, err)
			assert.Equal(t, 29, f.Len())
			assert.Equal(t, 40, s.Len(), "the origin keeps its tokens")
			checkTokens(t, f, 1, 0, 29)
			assert.LessOrEqual(t, f.Writable(), 29)
			assert.Equal(t, f.Writable(), s.Writable(), "both see the shared tokens read-only")

			// Both write their own tails; neither sees the other's.
			require.NoError(t, f.Append(11))
			writeTokens(t, f, 2, f.Writable(), 40)
			writeTokens(t, s, 3, s.Writable(), 40)
			checkTokens(t, f, 1, 0, f.Writable())
			checkTokens(t, f, 2, f.Writable(), 40)
			checkTokens(t, s, 1, 0, s.Writable())
			checkTokens(t, s, 3, s.Writable(), 40)
			tok := make([]byte, tiny8.Groups[0].TokenBytes())
			if w := s.Writable(); w > 0 {
				assert.ErrorIs(t, s.WriteToken(0, kv.K, w-1, tok), kv.ErrReadOnly)
				assert.ErrorIs(t, f.WriteToken(0, kv.K, w-1, tok), kv.ErrReadOnly)
			}

			// Forks at the ends: nothing, and everything.
			empty, err := s.ForkAt(0)
			require.NoError(t, err)
			assert.Equal(t, 0, empty.Len())
			whole, err := s.ForkAt(40)
			require.NoError(t, err)
			checkTokens(t, whole, 3, s.Writable(), 40)

			_, err = s.ForkAt(41)
			assert.ErrorIs(t, err, kv.ErrRange)
			_, err = s.ForkAt(-1)
			assert.ErrorIs(t, err, kv.ErrRange)
			assert.Equal(t, 4, c.Stats().Sequences, "no sequence made by a refused fork")
			closeAll(t, empty, whole, f, s)
		})
	}
}

// Regression (issue 10): a token that straddles the shared boundary is below
// Writable and refused in every layer, although its last bytes lie past the shared
// ones, and the token after it is not.
func TestWriteTokenStraddlingSharedBoundary(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	// Q8_0 tokens of 272 bytes: token 15 spans the first 4 KiB granule's end.
	c := e.cache(t, kv.Config{Model: q8Tiny, MaxTokens: 64, Layout: kv.PerLayer})
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(40))
	f, err := s.ForkAt(20)
	require.NoError(t, err)
	require.Equal(t, 16, f.Writable(), "token 15 lies partly in the shared granule")
	tok := make([]byte, q8Tiny.Groups[0].TokenBytes())
	for layer := range q8Tiny.Layers {
		for _, kind := range kv.KindsOf(q8Tiny) {
			assert.ErrorIs(t, f.WriteToken(layer, kind, 15, tok), kv.ErrReadOnly, "fork layer %d %v", layer, kind)
			assert.ErrorIs(t, s.WriteToken(layer, kind, 15, tok), kv.ErrReadOnly, "origin layer %d %v", layer, kind)
			assert.NoError(t, f.WriteToken(layer, kind, 16, tok), "fork layer %d %v", layer, kind)
		}
	}
	closeAll(t, f, s)
}

// Regression (issue 10): a view of an empty sequence is an empty
// [0, KVHeads, HeadDim] tensor at the tensor's base, for every layer and kind, also
// after Truncate(0).
func TestViewOfEmptySequence(t *testing.T) {
	for _, layout := range []kv.Layout{kv.PerLayer, kv.Blocked} {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, noCache, withLimit(1<<30))
			c := e.cache(t, kv.Config{Model: kv.Tiny(), MaxTokens: 64, Layout: layout})
			s, err := c.NewSequence()
			require.NoError(t, err)
			defer closeAll(t, s)
			check := func(when string) {
				for layer := range kv.Tiny().Layers {
					for _, kind := range kv.KindsOf(kv.Tiny()) {
						v, err := kv.View[arena.F16](s, layer, kind)
						require.NoError(t, err, "%s: layer %d %v", when, layer, kind)
						assert.Equal(t, viewShape(s), v.Shape())
						assert.Equal(t, s.Base(layer, kind), v.DevicePtr(), "%s: the view starts at the tensor's base", when)
					}
				}
			}
			if layout == kv.Blocked {
				assert.Equal(t, 16, s.BlockTokens(), "a 4 KiB block of 256-byte tokens")
				assert.Equal(t, fakeGranule, s.BlockStride())
			} else {
				assert.Zero(t, s.BlockTokens(), "no blocks")
				assert.Zero(t, s.BlockStride())
			}
			check("new")
			require.NoError(t, s.Append(3))
			check("3 tokens")
			require.NoError(t, s.Truncate(0))
			check("truncated")
		})
	}
}

// Regression (issue 10): a Fork, NewSequenceFrom or Freeze that fails midway and can
// not give back what it made reports the bytes in its error and in Stats, and
// Cache.Close recovers them.
func TestFailedUndoIsReported(t *testing.T) {
	ops := []struct {
		name string
		run  func(s *kv.Sequence, p *kv.Prefix) error
	}{
		{"Fork", func(s *kv.Sequence, _ *kv.Prefix) error { _, err := s.Fork(); return err }},
		{"NewSequenceFrom", func(s *kv.Sequence, p *kv.Prefix) error { _, err := s.Cache().NewSequenceFrom(p); return err }},
		{"Freeze", func(s *kv.Sequence, _ *kv.Prefix) error { _, err := s.Freeze(20); return err }},
	}
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			e := openEnv(t, noCache, withLimit(1<<30), withFaults)
			c, err := e.tryCache(kv.Config{Model: tiny8, MaxTokens: 64, Layout: kv.PerLayer})
			require.NoError(t, err)
			s, err := c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(21))
			p, err := s.Freeze(21)
			require.NoError(t, err)
			boom := errors.New("injected")
			// The third range's share fails; giving back the first two fails too.
			e.faults.FailOp(backingtest.OpShare, 3, boom)
			e.faults.FailOp(backingtest.OpUnreserve, 1, boom)
			e.faults.FailOp(backingtest.OpUnreserve, 2, boom)
			err = op.run(s, p)
			require.ErrorIs(t, err, boom)
			assert.Contains(t, err.Error(), "could not be given back")
			e.faults.Reset()
			st := c.Stats()
			assert.Positive(t, st.Unreleased, "Stats reports what stays held")
			assert.Equal(t, 1, st.Sequences, "no sequence was made")
			p.Release()
			assert.True(t, s.Close().OK())
			require.NoError(t, c.Close(), "Close gives back what the failed undo kept")
		})
	}
}

func TestLifecycle(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	c, err := e.tryCache(kv.Config{Model: tiny8, MaxTokens: 64})
	require.NoError(t, err)
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(3))
	assert.ErrorIs(t, c.Close(), kv.ErrBusy)
	assert.NotErrorIs(t, c.Close(), kv.ErrConfig)
	require.True(t, s.Close().OK())
	again := s.Close()
	assert.Equal(t, accounting.Failed, again.Status)
	assert.ErrorIs(t, again.Err, kv.ErrClosed)
	for name, fn := range map[string]func(){
		"Len":      func() { s.Len() },
		"ID":       func() { s.ID() },
		"Writable": func() { s.Writable() },
		"Append":   func() { _ = s.Append(1) },
		"Need":     func() { _, _ = s.Need(1) },
		"ForkAt":   func() { _, _ = s.ForkAt(0) },
		"Truncate": func() { _ = s.Truncate(0) },
		"View":     func() { _, _ = kv.View[arena.F16](s, 0, kv.K) },
		"Base":     func() { s.Base(0, kv.K) },
		"Prefix":   func() { s.Prefix() },
		"Damaged":  func() { s.Damaged() },
		"Cache":    func() { s.Cache() },
	} {
		assert.PanicsWithValue(t, kv.PanicSequenceClosed, fn, name)
	}
	require.NoError(t, c.Close())
	assert.ErrorIs(t, c.Close(), kv.ErrClosed, "a second Close changes nothing")
	_, err = c.NewSequence()
	assert.ErrorIs(t, err, kv.ErrClosed)
}

// An append that can never fit the limit fails at once, waiting or not.
func TestAppendNeverFits(t *testing.T) {
	e := openEnv(t, withLimit(4*fakeGranule), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer})) // one token in each of tiny8's 6 tensors needs 6
	c := e.c
	s, err := c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	assert.ErrorIs(t, s.Append(1), accounting.ErrExceedsLimit)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	assert.ErrorIs(t, s.AppendCtx(ctx, 1), accounting.ErrExceedsLimit)
	assert.NoError(t, ctx.Err(), "it did not wait")
	//lint:ignore SA1012 the nil context is the point: the call must panic on it
	assert.PanicsWithValue(t, kv.PanicNilContext, func() { _ = s.AppendCtx(nil, 1) })
}
