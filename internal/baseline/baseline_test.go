package baseline_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/internal/testutil"
)

// testShape is small enough for -race and has an odd token size so that offsets that
// are off by a token show.
var testShape = baseline.Shape{Layers: 3, TokenBytes: 24, MaxTokens: 100}

type factory struct {
	name string
	make func(s baseline.Shape, a *accounting.Authority) (baseline.Strategy, error)
	// sharesPrefix says whether a prefix's whole blocks are mapped (read-only in each
	// sequence) rather than copied.
	sharesPrefix bool
}

var factories = []factory{
	{name: "eager", make: func(s baseline.Shape, a *accounting.Authority) (baseline.Strategy, error) {
		return baseline.NewEager(s, baseline.EagerOptions{Authority: a})
	}},
	{name: "paged", sharesPrefix: true, make: func(s baseline.Shape, a *accounting.Authority) (baseline.Strategy, error) {
		// Small chunks so that tests cross chunk boundaries.
		return baseline.NewPaged(s, baseline.PagedOptions{BlockTokens: 4, ChunkBlocks: 3, Authority: a})
	}},
	{name: "paged+prefix-cache", sharesPrefix: true, make: func(s baseline.Shape, a *accounting.Authority) (baseline.Strategy, error) {
		return baseline.NewPaged(s, baseline.PagedOptions{BlockTokens: 4, ChunkBlocks: 3, Authority: a, PrefixCache: true})
	}},
	{name: "append", make: func(s baseline.Shape, a *accounting.Authority) (baseline.Strategy, error) {
		return baseline.NewAppend(s, baseline.AppendOptions{Authority: a})
	}},
}

func newAuthority(limit int64) (*accounting.Governor, *accounting.Authority) {
	g := accounting.NewGovernor()
	if limit >= 0 {
		if err := g.SetLimit(accounting.HostKey, limit); err != nil {
			panic(err)
		}
	}
	return g, g.Authority("baseline-test", accounting.HostKey)
}

// pattern returns the bytes written to token of (layer, v) of sequence seq: distinct
// for every (seq, layer, v, token, byte).
func pattern(s baseline.Shape, seq, layer int, v baseline.Kind, token int) []byte {
	b := make([]byte, s.TokenBytes)
	for i := range b {
		b[i] = testutil.TokenByte(uint64(seq), layer, v, token, i)
	}
	return b
}

func writeAll(t *testing.T, s baseline.Shape, q baseline.Sequence, seq, from, to int) {
	t.Helper()
	for tok := from; tok < to; tok++ {
		for l := range s.Layers {
			for _, v := range []baseline.Kind{baseline.K, baseline.V} {
				require.NoError(t, q.WriteToken(l, v, tok, pattern(s, seq, l, v, tok)))
			}
		}
	}
}

// checkAll reads tokens [from, to) back and compares them with what seqOf(token)
// wrote.
func checkAll(t *testing.T, s baseline.Shape, q baseline.Sequence, from, to int, seqOf func(tok int) int) {
	t.Helper()
	r, ok := q.(baseline.Reader)
	require.True(t, ok, "sequence %T reads back", q)
	dst := make([]byte, s.TokenBytes)
	for tok := from; tok < to; tok++ {
		for l := range s.Layers {
			for _, v := range []baseline.Kind{baseline.K, baseline.V} {
				require.NoError(t, r.ReadToken(l, v, tok, dst))
				require.Equal(t, pattern(s, seqOf(tok), l, v, tok), dst, "token %d layer %d %v", tok, l, v)
			}
		}
	}
}

func same(seq int) func(int) int { return func(int) int { return seq } }

func TestShapeValidate(t *testing.T) {
	tests := []struct {
		name  string
		shape baseline.Shape
		ok    bool
	}{
		{"ok", testShape, true},
		{"zero layers", baseline.Shape{Layers: 0, TokenBytes: 1, MaxTokens: 1}, false},
		{"negative token bytes", baseline.Shape{Layers: 1, TokenBytes: -1, MaxTokens: 1}, false},
		{"zero max tokens", baseline.Shape{Layers: 1, TokenBytes: 1, MaxTokens: 0}, false},
		{"overflow", baseline.Shape{Layers: 1 << 20, TokenBytes: 1 << 20, MaxTokens: 1 << 30}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.shape.Validate()
			if tt.ok {
				assert.NoError(t, err)
				return
			}
			assert.ErrorIs(t, err, baseline.ErrShape)
			for _, f := range factories {
				_, err := f.make(tt.shape, nil)
				assert.ErrorIs(t, err, baseline.ErrShape, f.name)
			}
		})
	}
}

func TestBadOptions(t *testing.T) {
	tests := []struct {
		name string
		make func() error
	}{
		{"eager negative slots", func() error {
			_, err := baseline.NewEager(testShape, baseline.EagerOptions{Slots: -1})
			return err
		}},
		{"paged negative block", func() error {
			_, err := baseline.NewPaged(testShape, baseline.PagedOptions{BlockTokens: -16})
			return err
		}},
		{"paged block longer than a sequence", func() error {
			_, err := baseline.NewPaged(testShape, baseline.PagedOptions{BlockTokens: testShape.MaxTokens + 1})
			return err
		}},
		{"paged negative chunk", func() error {
			_, err := baseline.NewPaged(testShape, baseline.PagedOptions{ChunkBlocks: -1})
			return err
		}},
		{"paged negative blocks", func() error {
			_, err := baseline.NewPaged(testShape, baseline.PagedOptions{Blocks: -1})
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, tt.make(), baseline.ErrOptions)
		})
	}
}

func TestKindString(t *testing.T) {
	assert.Equal(t, "K", baseline.K.String())
	assert.Equal(t, "V", baseline.V.String())
	assert.Equal(t, "Kind(7)", baseline.Kind(7).String())
}

func TestStrategies(t *testing.T) {
	for _, f := range factories {
		t.Run(f.name, func(t *testing.T) { testStrategy(t, f) })
	}
}

func testStrategy(t *testing.T, f factory) {
	s := testShape
	newStrategy := func(t *testing.T, limit int64) (baseline.Strategy, *accounting.Authority) {
		_, a := newAuthority(limit)
		st, err := f.make(s, a)
		require.NoError(t, err)
		return st, a
	}

	t.Run("name", func(t *testing.T) {
		st, _ := newStrategy(t, -1)
		assert.Equal(t, f.name, st.Name())
		require.NoError(t, st.Close())
	})

	t.Run("data survives growth", func(t *testing.T) {
		st, a := newStrategy(t, -1)
		seqs := make([]baseline.Sequence, 3)
		for i := range seqs {
			q, err := st.NewSequence()
			require.NoError(t, err)
			seqs[i] = q
		}
		// Grow in uneven steps, interleaved, writing each step's tokens.
		for _, step := range []int{1, 3, 0, 5, 8, 13, 21, 49} {
			for i, q := range seqs {
				from := q.Len()
				require.NoError(t, q.Append(step))
				assert.Equal(t, from+step, q.Len())
				writeAll(t, s, q, i, from, q.Len())
			}
		}
		for i, q := range seqs {
			checkAll(t, s, q, 0, q.Len(), same(i))
		}
		st1 := st.Stats()
		assert.Equal(t, 3, st1.Sequences)
		assert.Equal(t, int64(3*s.MaxTokens), st1.Tokens)
		assert.GreaterOrEqual(t, st1.Physical, st1.Tokens*int64(s.BytesPerToken()))
		assert.Equal(t, a.Stats().Owned, st1.Physical, "authority charged exactly the physical bytes")
		for _, q := range seqs {
			require.NoError(t, q.Close())
		}
		assert.Zero(t, st.Stats().Tokens)
		require.NoError(t, st.Close())
		assert.Zero(t, st.Stats().Physical)
		assert.Zero(t, a.Stats().Owned, "everything given back")
	})

	t.Run("bad inputs", func(t *testing.T) {
		st, _ := newStrategy(t, -1)
		q, err := st.NewSequence()
		require.NoError(t, err)
		require.NoError(t, q.Append(10))
		before := st.Stats()

		assert.ErrorIs(t, q.Append(-1), baseline.ErrRange)
		assert.ErrorIs(t, q.Append(s.MaxTokens), baseline.ErrTooLong)
		assert.Equal(t, 10, q.Len(), "a refused append changes nothing")
		assert.Equal(t, before, st.Stats())

		src := make([]byte, s.TokenBytes)
		writes := []struct {
			name  string
			layer int
			v     baseline.Kind
			token int
			src   []byte
		}{
			{"negative layer", -1, baseline.K, 0, src},
			{"layer past the last", s.Layers, baseline.K, 0, src},
			{"unknown kind", 0, baseline.Kind(2), 0, src},
			{"negative token", 0, baseline.V, -1, src},
			{"token past Len", 0, baseline.V, 10, src},
			{"short source", 0, baseline.K, 0, src[1:]},
			{"long source", 0, baseline.K, 0, append(src, 0)},
		}
		r := q.(baseline.Reader)
		for _, w := range writes {
			assert.ErrorIs(t, q.WriteToken(w.layer, w.v, w.token, w.src), baseline.ErrRange, "write: "+w.name)
			assert.ErrorIs(t, r.ReadToken(w.layer, w.v, w.token, w.src), baseline.ErrRange, "read: "+w.name)
		}

		_, err = q.Freeze(-1)
		assert.ErrorIs(t, err, baseline.ErrRange)
		_, err = q.Freeze(11)
		assert.ErrorIs(t, err, baseline.ErrRange)

		// A prefix of another strategy is refused.
		other, err := f.make(s, nil)
		require.NoError(t, err)
		oq, err := other.NewSequence()
		require.NoError(t, err)
		require.NoError(t, oq.Append(2))
		op, err := oq.Freeze(2)
		require.NoError(t, err)
		_, err = st.NewSequenceFrom(op)
		assert.ErrorIs(t, err, baseline.ErrForeign)
		_, err = st.NewSequenceFrom(foreignPrefix{})
		assert.ErrorIs(t, err, baseline.ErrForeign)
		op.Release()
		require.NoError(t, oq.Close())
		require.NoError(t, other.Close())

		// Close refuses while a sequence is live, then works; a second changes nothing.
		assert.ErrorIs(t, st.Close(), baseline.ErrBusy)
		require.NoError(t, q.Close())
		require.NoError(t, st.Close())
		require.ErrorIs(t, st.Close(), baseline.ErrClosed)
		_, err = st.NewSequence()
		assert.ErrorIs(t, err, baseline.ErrClosed)
	})

	t.Run("misuse panics", func(t *testing.T) {
		st, _ := newStrategy(t, -1)
		q, err := st.NewSequence()
		require.NoError(t, err)
		require.NoError(t, q.Append(6))
		p, err := q.Freeze(5)
		require.NoError(t, err)
		p.Release()
		assert.PanicsWithValue(t, baseline.PanicPrefixReleased, p.Release)
		assert.PanicsWithValue(t, baseline.PanicPrefixReleased, func() { _, _ = st.NewSequenceFrom(p) })
		require.NoError(t, q.Close())
		assert.ErrorIs(t, q.Close(), baseline.ErrClosed, "a second Close changes nothing")
		assert.PanicsWithValue(t, baseline.PanicSequenceClosed, func() { _ = q.Append(1) })
		assert.PanicsWithValue(t, baseline.PanicSequenceClosed, func() { q.Len() })
		assert.PanicsWithValue(t, baseline.PanicSequenceClosed, func() { _ = q.WriteToken(0, baseline.K, 0, nil) })
		assert.PanicsWithValue(t, baseline.PanicSequenceClosed, func() { _, _ = q.Freeze(0) })
		require.NoError(t, st.Close())
	})

	t.Run("prefix", func(t *testing.T) {
		st, a := newStrategy(t, -1)
		src, err := st.NewSequence()
		require.NoError(t, err)
		const P = 11 // not a whole number of paged blocks
		require.NoError(t, src.Append(P+3))
		writeAll(t, s, src, 0, 0, P+3)
		p, err := src.Freeze(P)
		require.NoError(t, err)
		assert.Equal(t, P, p.Len())
		assert.Equal(t, 1, st.Stats().Prefixes)
		// The source keeps its tokens, and they are unchanged.
		checkAll(t, s, src, 0, P+3, same(0))

		const N = 4
		seqs := make([]baseline.Sequence, N)
		for i := range seqs {
			q, err := st.NewSequenceFrom(p)
			require.NoError(t, err)
			require.Equal(t, P, q.Len())
			seqs[i] = q
		}
		// Each sequence writes its own tokens past the prefix; the prefix reads the same
		// in all of them.
		for i, q := range seqs {
			require.NoError(t, q.Append(7))
			writeAll(t, s, q, i+1, P, P+7)
		}
		for i, q := range seqs {
			checkAll(t, s, q, 0, P+7, func(tok int) int {
				if tok < P {
					return 0
				}
				return i + 1
			})
		}
		// The prefix's first token: shared read-only memory where it is mapped, a
		// private copy otherwise.
		err = seqs[0].WriteToken(0, baseline.K, 0, pattern(s, 9, 0, baseline.K, 0))
		if f.sharesPrefix {
			assert.ErrorIs(t, err, baseline.ErrReadOnly)
			assert.ErrorIs(t, src.WriteToken(0, baseline.K, 0, pattern(s, 9, 0, baseline.K, 0)), baseline.ErrReadOnly,
				"the frozen source can not write its prefix either")
		} else {
			require.NoError(t, err)
			checkAll(t, s, seqs[1], 0, 1, same(0))
		}
		// The prefix outlives its creator's reference while sequences use it.
		p.Release()
		q, err := st.NewSequence()
		require.NoError(t, err)
		require.NoError(t, q.Append(P))
		checkAll(t, s, seqs[N-1], 0, P, same(0))
		require.NoError(t, q.Close())

		stats := st.Stats()
		if f.sharesPrefix {
			// Paged blocks of 4 tokens: P/4 whole blocks shared by N+1 holders (the
			// source and N sequences), each addressed N times more than it is held.
			bb := int64(st.(*baseline.Paged).BlockBytes())
			assert.Equal(t, int64(N*(P/4))*bb, stats.Saved)
		} else {
			assert.Zero(t, stats.Saved)
		}
		require.NoError(t, src.Close())
		for _, q := range seqs {
			require.NoError(t, q.Close())
		}
		assert.Zero(t, st.Stats().Saved)
		require.NoError(t, st.Close())
		assert.Zero(t, a.Stats().Owned)
	})

	t.Run("empty prefix", func(t *testing.T) {
		st, _ := newStrategy(t, -1)
		src, err := st.NewSequence()
		require.NoError(t, err)
		p, err := src.Freeze(0)
		require.NoError(t, err)
		q, err := st.NewSequenceFrom(p)
		require.NoError(t, err)
		assert.Zero(t, q.Len())
		p.Release()
		require.NoError(t, q.Close())
		require.NoError(t, src.Close())
		require.NoError(t, st.Close())
	})

	t.Run("budget", func(t *testing.T) {
		// Room for about one sequence of half the maximum length, whatever the strategy
		// takes for it (measured on an unlimited twin).
		twin, err := f.make(s, nil)
		require.NoError(t, err)
		tq, err := twin.NewSequence()
		require.NoError(t, err)
		require.NoError(t, tq.Append(s.MaxTokens/2))
		need := twin.Stats().Physical
		require.NoError(t, tq.Close())
		require.NoError(t, twin.Close())

		g, a := newAuthority(need)
		st, err := f.make(s, a)
		require.NoError(t, err)
		q1, err := st.NewSequence()
		require.NoError(t, err)
		require.NoError(t, q1.Append(s.MaxTokens/2))
		writeAll(t, s, q1, 1, 0, q1.Len())
		before := st.Stats()

		// A second sequence of the same length can not fit.
		q2, err := st.NewSequence()
		if err == nil {
			err = q2.Append(s.MaxTokens / 2)
			assert.Zero(t, q2.Len(), "a refused append changes nothing")
		}
		require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
		assert.Equal(t, before.Physical, st.Stats().Physical, "a refusal allocates nothing")
		assert.Equal(t, before.Physical, a.Stats().Owned)
		checkAll(t, s, q1, 0, q1.Len(), same(1))

		// Once the first is gone, the second fits.
		require.NoError(t, q1.Close())
		if q2 == nil {
			q2, err = st.NewSequence()
			require.NoError(t, err)
		}
		require.NoError(t, q2.Append(s.MaxTokens/2))
		assert.LessOrEqual(t, g.Stats(accounting.HostKey).Peak, need)
		require.NoError(t, q2.Close())
		require.NoError(t, st.Close())
		assert.Zero(t, a.Stats().Owned)
	})
}

type foreignPrefix struct{}

func (foreignPrefix) Len() int { return 0 }
func (foreignPrefix) Release() {}

func TestEagerPhysical(t *testing.T) {
	_, a := newAuthority(-1)
	e, err := baseline.NewEager(testShape, baseline.EagerOptions{Slots: 2, Authority: a})
	require.NoError(t, err)
	slot := int64(testShape.MaxTokens * testShape.BytesPerToken())
	assert.Equal(t, int(slot), e.SlotBytes())
	assert.Equal(t, 2*slot, e.Stats().Physical, "slots allocated up front")

	var seqs []baseline.Sequence
	for range 3 {
		q, err := e.NewSequence()
		require.NoError(t, err)
		seqs = append(seqs, q)
	}
	assert.Equal(t, 3*slot, e.Stats().Physical, "a third sequence takes a new slot")
	for _, q := range seqs {
		require.NoError(t, q.Close())
	}
	assert.Equal(t, 3*slot, e.Stats().Physical, "closed slots stay resident")
	q, err := e.NewSequence()
	require.NoError(t, err)
	assert.Equal(t, 3*slot, e.Stats().Physical, "a new sequence reuses a slot")
	assert.Equal(t, 3*slot, e.Stats().PeakPhysical)
	require.NoError(t, q.Close())
	require.NoError(t, e.Close())
	assert.Zero(t, a.Stats().Owned)

	// Slots that the budget can not cover are refused up front.
	_, small := newAuthority(slot)
	_, err = baseline.NewEager(testShape, baseline.EagerOptions{Slots: 2, Authority: small})
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Zero(t, small.Stats().Owned)
}

func TestPagedPhysical(t *testing.T) {
	const bt, chunk = 4, 3
	_, a := newAuthority(-1)
	p, err := baseline.NewPaged(testShape, baseline.PagedOptions{BlockTokens: bt, ChunkBlocks: chunk, Blocks: 1, Authority: a})
	require.NoError(t, err)
	bb := int64(bt * testShape.BytesPerToken())
	assert.Equal(t, int(bb), p.BlockBytes())
	assert.Equal(t, chunk*bb, p.Stats().Physical, "the preallocated block rounds up to a chunk")
	assert.Equal(t, chunk, p.FreeBlocks())

	q, err := p.NewSequence()
	require.NoError(t, err)
	assert.Equal(t, chunk, p.FreeBlocks(), "an empty sequence holds no block")
	require.NoError(t, q.Append(1))
	assert.Equal(t, chunk-1, p.FreeBlocks())
	require.NoError(t, q.Append(bt-1))
	assert.Equal(t, chunk-1, p.FreeBlocks(), "the first block fills before a second is taken")
	const tokens = 4*bt + 1 // 5 blocks: a second chunk
	require.NoError(t, q.Append(tokens-bt))
	assert.Equal(t, 2*chunk*bb, p.Stats().Physical)
	assert.Equal(t, 2*chunk-5, p.FreeBlocks())
	require.NoError(t, q.Close())
	assert.Equal(t, 2*chunk, p.FreeBlocks(), "blocks go back to the free list")
	assert.Equal(t, 2*chunk*bb, p.Stats().Physical, "the pool never shrinks")
	require.NoError(t, p.Close())
	assert.Zero(t, a.Stats().Owned)
}

func TestAppendPhysical(t *testing.T) {
	_, a := newAuthority(-1)
	ap, err := baseline.NewAppend(testShape, baseline.AppendOptions{Authority: a})
	require.NoError(t, err)
	q, err := ap.NewSequence()
	require.NoError(t, err)
	assert.Zero(t, ap.Stats().Physical, "an empty sequence holds nothing")
	var grew int
	last := int64(0)
	for range testShape.MaxTokens {
		require.NoError(t, q.Append(1))
		ph := ap.Stats().Physical
		used := int64(q.Len() * testShape.BytesPerToken())
		require.GreaterOrEqual(t, ph, used)
		if ph != last {
			grew++
			last = ph
		}
	}
	assert.Less(t, grew, testShape.MaxTokens/2, "append keeps spare capacity rather than growing every token")
	assert.Greater(t, ap.Stats().Physical, int64(testShape.MaxTokens*testShape.BytesPerToken()), "spare capacity is held")
	assert.Equal(t, a.Stats().Owned, ap.Stats().Physical)
	require.NoError(t, q.Close())
	assert.Zero(t, ap.Stats().Physical)
	require.NoError(t, ap.Close())
	assert.Zero(t, a.Stats().Owned)
}

// TestConcurrent runs many goroutines creating, growing, writing, freezing and closing
// sequences on one strategy; run with -race.
func TestConcurrent(t *testing.T) {
	for _, f := range factories {
		t.Run(f.name, func(t *testing.T) {
			s := testShape
			_, a := newAuthority(-1)
			st, err := f.make(s, a)
			require.NoError(t, err)
			root, err := st.NewSequence()
			require.NoError(t, err)
			require.NoError(t, root.Append(9))
			writeAll(t, s, root, 0, 0, 9)
			p, err := root.Freeze(9)
			require.NoError(t, err)

			var wg sync.WaitGroup
			errs := make(chan error, 8)
			for w := range 8 {
				wg.Go(func() {
					for i := range 10 {
						q, err := st.NewSequenceFrom(p)
						if err != nil {
							errs <- err
							return
						}
						id := w*100 + i + 1
						n := 1 + (w*7+i*3)%40
						if err := q.Append(n); err != nil {
							errs <- err
							return
						}
						for tok := 9; tok < q.Len(); tok++ {
							for l := range s.Layers {
								if err := q.WriteToken(l, baseline.V, tok, pattern(s, id, l, baseline.V, tok)); err != nil {
									errs <- err
									return
								}
							}
						}
						dst := make([]byte, s.TokenBytes)
						for tok := range q.Len() {
							want := 0
							if tok >= 9 {
								want = id
							}
							if err := q.(baseline.Reader).ReadToken(s.Layers-1, baseline.V, tok, dst); err != nil {
								errs <- err
								return
							}
							if string(dst) != string(pattern(s, want, s.Layers-1, baseline.V, tok)) {
								errs <- fmt.Errorf("worker %d: token %d corrupted", w, tok)
								return
							}
						}
						_ = st.Stats()
						if err := q.Close(); err != nil {
							errs <- err
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			p.Release()
			require.NoError(t, root.Close())
			assert.Zero(t, st.Stats().Tokens)
			require.NoError(t, st.Close())
			assert.Zero(t, a.Stats().Owned)
		})
	}
}

func TestBudgetErrorIsTyped(t *testing.T) {
	_, a := newAuthority(0)
	_, err := baseline.NewEager(testShape, baseline.EagerOptions{Slots: 1, Authority: a})
	var be *accounting.BudgetError
	require.True(t, errors.As(err, &be), "got %v", err)
	assert.Equal(t, int64(testShape.MaxTokens*testShape.BytesPerToken()), be.Requested)
}
