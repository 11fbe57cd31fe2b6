package kv_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// The model's side of each of the layout's functions, from what the layout's doc
// says rather than from kv's formulas: where it can, by counting.

// unit returns the bytes of a sharing unit: a block, or a granule.
func (m modelLayout) unit() int {
	if m.blk > 0 {
		return m.blk
	}
	return m.gran
}

// extent returns the bytes at the start of each range that n tokens occupy: the
// blocks that hold them, or n rows.
func (m modelLayout) extent(n int) int {
	if m.blk > 0 {
		return ceilDiv(n, m.tpb) * m.blk
	}
	return n * m.row
}

// unitsFor returns the units that the bytes of n tokens touch, the last perhaps partly.
func (m modelLayout) unitsFor(n int) int {
	if m.blk > 0 {
		return ceilDiv(n, m.tpb)
	}
	return ceilDiv(n*m.row, m.gran)
}

// fullUnits returns the units wholly filled by n tokens: in the Blocked layout the
// blocks whose every token is below n, elsewhere the granules below n rows.
func (m modelLayout) fullUnits(n int) int {
	k := 0
	for m.blk > 0 && (k+1)*m.tpb <= n || m.blk == 0 && (k+1)*m.gran <= n*m.row {
		k++
	}
	return k
}

// tokensWithin returns the most tokens whose bytes all lie within the first b bytes
// of each range: the largest n with extent(n) <= b, by counting.
func (m modelLayout) tokensWithin(b int) int {
	n := 0
	for m.extent(n+1) <= b {
		n++
	}
	return n
}

// writableFrom returns the first token whose bytes (its block's, in the Blocked
// layout) start at or past the first frozen bytes of each range, by counting.
func (m modelLayout) writableFrom(frozen int) int {
	t := 0
	for m.start(t) < frozen {
		t++
	}
	return t
}

// start returns where the bytes of token t's sharing begin: its block's start, or
// its own row.
func (m modelLayout) start(t int) int {
	if m.blk > 0 {
		return t / m.tpb * m.blk
	}
	return t * m.row
}

// place returns the range and the offset of tensor i's token 0.
func (m modelLayout) place(i int) (buf, off int) {
	if m.blk > 0 {
		return 0, i * m.rt * m.row // [runs][tensor][R tokens] inside a block
	}
	return i, 0
}

// offset returns the byte offset of token t of tensor i in its range: block t/T,
// then the run of R tokens of every tensor that holds t inside the block, then the
// tensor's R tokens in the run, then the token's row in them.
func (m modelLayout) offset(i, t int) int {
	_, off := m.place(i)
	if m.blk > 0 {
		b, in := t/m.tpb, t%m.tpb
		return b*m.blk + in/m.rt*(m.rt*m.nt*m.row) + off + in%m.rt*m.row
	}
	return off + t*m.row
}

// run returns the tokens from t on, below limit, whose rows of tensor i follow each
// other in memory, by walking them.
func (m modelLayout) run(i, t, limit int) int {
	k := 1
	for t+k < limit && m.offset(i, t+k) == m.offset(i, t)+k*m.row {
		k++
	}
	return k
}

// frozenCases returns byte counts of a frozen prefix to try: each side of every row
// and every unit boundary up to the extent of n tokens and a unit past it.
func (m modelLayout) frozenCases(n int) []int {
	var out []int
	add := func(b int) {
		for _, d := range []int{-1, 0, 1} {
			if b+d >= 0 {
				out = append(out, b+d)
			}
		}
	}
	for j := 0; j <= n+1; j++ {
		add(j * m.row)
	}
	for k := 0; k <= m.unitsFor(n)+1; k++ {
		add(k * m.unit())
	}
	return out
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// TestLayoutArithmeticAgainstModel checks each of the layout's functions (layout.go)
// against the tests' own model, for every token count, byte count and frozen prefix
// of models with 1, 2 and 3 layers, fp16 and Q8_0 tokens (whose 34-byte blocks
// straddle granules), granules from 64 bytes to 2 MiB and blocks of 0 to 37 tokens in
// both layouts; and that no two tokens of a sequence overlap or pass the reservation.
func TestLayoutArithmeticAgainstModel(t *testing.T) {
	geoms := []kv.Model{
		kv.Uniform("one", 1, 1, 8, arena.Float16),
		tiny8,
		kv.Uniform("q8", 3, 1, 32, arena.Q8_0),
		kv.Uniform("odd", 2, 3, 5, arena.Float16),
	}
	const maxTokens = 48
	for _, g := range geoms {
		for _, layout := range layouts {
			for _, gran := range []int{64, 256, 4096, 64 << 10, 2 << 20} {
				for _, bt := range []int{0, 1, 3, 5, 16, 37} {
					for _, rt := range []int{0, 1, 4} {
						if layout != kv.Blocked && (bt != 0 || rt != 0) || rt != 0 && gran > 4096 {
							continue // (a block of the larger granules holds the 48 tokens)
						}
						name := fmt.Sprintf("%s/%v/granule=%d/BlockTokens=%d/RunTokens=%d", g.Name, layout, gran, bt, rt)
						t.Run(name, func(t *testing.T) {
							cfg := kv.Config{Model: g, Layout: layout, BlockTokens: bt, RunTokens: rt, MaxTokens: maxTokens}
							sh, err := kv.NewShape(g, layout, gran, bt, rt, maxTokens)
							require.NoError(t, err)
							checkShape(t, sh, modelOf(cfg, gran), cfg, gran)
						})
					}
				}
			}
		}
	}
}

func checkShape(t *testing.T, sh kv.Shape, m modelLayout, cfg kv.Config, gran int) {
	g := cfg.Model
	require.Equal(t, m.nbuf, sh.Ranges(), "ranges")
	require.Equal(t, m.nt, sh.Tensors(), "tensors")
	require.Equal(t, m.row, sh.Row(), "row")
	require.Equal(t, m.tpb, sh.TokensPerBlock(), "tokens per block")
	require.Equal(t, m.blk, sh.BlockBytes(), "block bytes")
	require.Equal(t, m.unit(), sh.Unit(), "unit")
	capac := ceilDiv(m.extent(cfg.MaxTokens), gran) * gran
	require.Equal(t, capac, sh.Capacity(), "capacity")
	kinds := kv.KindsOf(g)
	for i := range m.nt {
		buf, off := sh.Place(i)
		wb, wo := m.place(i)
		require.Equal(t, [2]int{wb, wo}, [2]int{buf, off}, "place %d", i)
		tb, to, ok := sh.Tensor(i/len(kinds), kinds[i%len(kinds)])
		require.True(t, ok, "tensor %d", i)
		require.Equal(t, [2]int{wb, wo}, [2]int{tb, to}, "tensor %d", i)
	}
	_, _, ok := sh.Tensor(g.Layers, kv.K)
	require.False(t, ok, "a layer past the last")
	_, _, ok = sh.Tensor(-1, kv.K)
	require.False(t, ok, "layer -1")
	_, _, ok = sh.Tensor(0, kv.V+1)
	require.False(t, ok, "a kind the model has not")

	for n := 0; n <= cfg.MaxTokens; n++ {
		require.Equal(t, m.extent(n), sh.Extent(n), "extent(%d)", n)
		require.Equal(t, m.unitsFor(n), sh.UnitsFor(n), "unitsFor(%d)", n)
		require.Equal(t, m.fullUnits(n), sh.FullUnits(n), "fullUnits(%d)", n)
		require.Equal(t, m.fullUnits(n)*m.unit(), sh.Shareable(n), "shareable(%d)", n)
		require.Equal(t, m.kept(n), sh.TokensIn(sh.FullUnits(n)), "tokens of the whole units below %d", n)
		s, err := cfg.Size(gran, n)
		require.NoError(t, err)
		require.Equal(t, m.committed(n), s.Committed, "Size(%d).Committed", n)
		require.Equal(t, int64(m.nbuf*capac), s.Reserved, "Size(%d).Reserved", n)
	}
	for k := 0; k <= m.unitsFor(cfg.MaxTokens)+1; k++ {
		require.Equal(t, m.tokensWithin(k*m.unit()), sh.TokensIn(k), "tokensIn(%d)", k)
	}
	for _, b := range m.frozenCases(cfg.MaxTokens) {
		require.Equal(t, m.tokensWithin(b), sh.TokensWithin(b), "tokensWithin(%d)", b)
		w := m.writableFrom(b)
		require.Equal(t, w, sh.WritableFrom(b), "writableFrom(%d)", b)
		for i := range m.nt {
			_, off := m.place(i)
			for tok := range cfg.MaxTokens {
				at, shared := sh.TokenAt(off, tok, b)
				if at != m.offset(i, tok) || shared != (tok < w) {
					require.Failf(t, "tokenAt", "tensor %d token %d frozen %d: (%d, %v), the model says (%d, %v)", i, tok, b, at, shared, m.offset(i, tok), tok < w)
				}
			}
		}
	}
	// Every token's row of every tensor is where the model puts it, within the
	// reservation, and no two overlap; a run is the rows that follow each other.
	type span struct{ at, i, tok int }
	spans := make([][]span, m.nbuf)
	for i := range m.nt {
		buf, off := sh.Place(i)
		for tok := range cfg.MaxTokens {
			at := sh.Offset(off, tok)
			require.Equal(t, m.offset(i, tok), at, "offset of tensor %d token %d", i, tok)
			require.LessOrEqual(t, at+m.row, capac, "tensor %d token %d past the reservation", i, tok)
			spans[buf] = append(spans[buf], span{at, i, tok})
			require.Equal(t, m.run(i, tok, cfg.MaxTokens), min(sh.Run(tok), cfg.MaxTokens-tok), "run of tensor %d from token %d", i, tok)
		}
	}
	for buf, ss := range spans {
		slices.SortFunc(ss, func(a, b span) int { return a.at - b.at })
		for j := 1; j < len(ss); j++ {
			if ss[j].at < ss[j-1].at+m.row {
				require.Failf(t, "overlap", "range %d: tensor %d token %d at %d overlaps tensor %d token %d at %d", buf, ss[j].i, ss[j].tok, ss[j].at, ss[j-1].i, ss[j-1].tok, ss[j-1].at)
			}
		}
	}
}
