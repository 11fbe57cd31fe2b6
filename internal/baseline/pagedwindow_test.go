package baseline_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/baseline"
)

func TestPagedWindowsBadOptions(t *testing.T) {
	tests := []struct {
		name string
		o    baseline.PagedOptions
		want string
	}{
		{"too few windows", baseline.PagedOptions{Windows: []int{0, 8}}, "2 windows for 3 layers"},
		{"too many windows", baseline.PagedOptions{Windows: []int{0, 8, 0, 8}}, "4 windows for 3 layers"},
		{"negative window", baseline.PagedOptions{Windows: []int{0, -8, 0}}, "layer 1: window -8 is negative"},
		{"window under a block", baseline.PagedOptions{BlockTokens: 4, Windows: []int{0, 3, 0}}, "layer 1: window 3 is under one block of 4 tokens"},
		{"window under the default block", baseline.PagedOptions{Windows: []int{8, 8, 8}}, "layer 0: window 8 is under one block of 16 tokens"},
		{"prefix cache with a window", baseline.PagedOptions{Windows: []int{0, 16, 0}, PrefixCache: true}, "the prefix cache models full attention only"},
		{"prefix cache with windows only", baseline.PagedOptions{Windows: []int{16, 16, 16}, PrefixCache: true}, "the prefix cache models full attention only"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, a := newAuthority(-1)
			tt.o.Authority, tt.o.Blocks = a, 4
			p, err := baseline.NewPaged(testShape, tt.o)
			assert.Nil(t, p)
			require.ErrorIs(t, err, baseline.ErrOptions)
			assert.Contains(t, err.Error(), tt.want)
			assert.Zero(t, a.Stats().Owned, "a refusal allocates nothing")
		})
	}
}

// TestPagedWindowsGroups checks how windows cut layers into groups, by the block size:
// a block holds one group's layers.
func TestPagedWindowsGroups(t *testing.T) {
	const bt, tb = 4, 24
	tests := []struct {
		name    string
		windows []int
		layers  int // per group
	}{
		{"nil: one group", nil, 6},
		{"all full attention: one group", []int{0, 0, 0, 0, 0, 0}, 6},
		{"all one window: one group", []int{8, 8, 8, 8, 8, 8}, 6},
		{"half and half: two groups of 3", []int{8, 0, 8, 0, 8, 0}, 3},
		{"three classes of 2", []int{8, 0, 12, 0, 8, 12}, 2},
		{"4 and 2: groups of 2", []int{8, 8, 0, 8, 0, 8}, 2},
		{"5 and 1: groups of 1", []int{8, 8, 8, 8, 8, 0}, 1},
	}
	s := baseline.Shape{Layers: 6, TokenBytes: tb, MaxTokens: 64}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := baseline.NewPaged(s, baseline.PagedOptions{BlockTokens: bt, Windows: tt.windows})
			require.NoError(t, err)
			assert.Equal(t, bt*2*tt.layers*tb, p.BlockBytes())
			require.NoError(t, p.Close())
		})
	}
}

// TestPagedWindowGivesBack follows one sequence of a two-group model (a full layer, a
// window layer of 8 tokens, blocks of 4) through kv's window rule.
func TestPagedWindowGivesBack(t *testing.T) {
	const bt = 4
	s := baseline.Shape{Layers: 2, TokenBytes: 24, MaxTokens: 64}
	_, a := newAuthority(-1)
	p, err := baseline.NewPaged(s, baseline.PagedOptions{BlockTokens: bt, ChunkBlocks: 1, Windows: []int{0, 8}, Authority: a})
	require.NoError(t, err)
	bb := int64(p.BlockBytes())
	assert.Equal(t, int64(bt*2*s.TokenBytes), bb, "a block holds one layer")
	q, err := p.NewSequence()
	require.NoError(t, err)
	require.NoError(t, q.Append(16), "an append from 0 gives nothing back")
	writeAll(t, s, q, 1, 0, 16)
	assert.Equal(t, 8*bb, p.Stats().Physical, "4 blocks per group")

	// From 16 tokens the next step reads [FirstLive(16), 16) = [9, 16): blocks 0 and
	// 1 of the window layer go back, and the new blocks are those.
	require.NoError(t, q.Append(1))
	writeAll(t, s, q, 1, 16, 17)
	assert.Equal(t, 8*bb, p.Stats().Physical, "the window's blocks were reused")
	assert.Zero(t, p.FreeBlocks())
	checkLayer(t, s, q, 0, 0, 17, 1)
	buf := make([]byte, s.TokenBytes)
	r := q.(baseline.Reader)
	for tok := range 17 {
		err := r.ReadToken(1, baseline.V, tok, buf)
		if tok < 8 {
			require.ErrorIs(t, err, baseline.ErrDropped, "token %d", tok)
			require.ErrorIs(t, q.WriteToken(1, baseline.K, tok, buf), baseline.ErrDropped)
			continue
		}
		require.NoError(t, err, "token %d: held from its block's first token on", tok)
		require.Equal(t, pattern(s, 1, 1, baseline.V, tok), buf)
	}
	assert.Contains(t, r.ReadToken(1, baseline.K, 3, buf).Error(), "token 3 of layer 1 (its group holds the tokens from 8 on)")

	// A prefix of 10 tokens needs the window's tokens from FirstLive(10) = 3 on, which
	// the sequence gave back; one of 16 needs them from 9 on.
	_, err = q.Freeze(10)
	require.ErrorIs(t, err, baseline.ErrDropped)
	pf, err := q.Freeze(16)
	require.NoError(t, err)
	st := p.Stats()
	assert.Equal(t, (4+2)*bb, st.Saved, "the prefix shares 4 full blocks and 2 window blocks")
	assert.Equal(t, int64(17), st.Tokens)
	q2, err := p.NewSequenceFrom(pf)
	require.NoError(t, err)
	checkLayer(t, s, q2, 0, 0, 16, 1)
	checkLayer(t, s, q2, 1, 8, 16, 1)
	require.ErrorIs(t, q2.WriteToken(1, baseline.K, 7, buf), baseline.ErrDropped)
	require.ErrorIs(t, q2.WriteToken(1, baseline.K, 8, buf), baseline.ErrReadOnly)
	assert.Equal(t, 2*(4+2)*bb, p.Stats().Saved)
	pf.Release()
	require.NoError(t, q.Close())
	require.NoError(t, q2.Close())
	assert.Zero(t, p.Stats().Saved)
	assert.Equal(t, int(p.Stats().Physical/bb), p.FreeBlocks(), "every block went back")
	require.NoError(t, p.Close())
	assert.Zero(t, a.Stats().Owned)
}

// TestPagedWindowRefusedAppendChangesNothing: an append refused by the budget takes
// back the window blocks it gave back first.
func TestPagedWindowRefusedAppendChangesNothing(t *testing.T) {
	const bt = 4
	s := baseline.Shape{Layers: 2, TokenBytes: 24, MaxTokens: 64}
	bb := int64(bt * 2 * s.TokenBytes)
	_, a := newAuthority(8 * bb)
	p, err := baseline.NewPaged(s, baseline.PagedOptions{BlockTokens: bt, ChunkBlocks: 1, Windows: []int{0, 8}, Authority: a})
	require.NoError(t, err)
	q, err := p.NewSequence()
	require.NoError(t, err)
	require.NoError(t, q.Append(16))
	writeAll(t, s, q, 1, 0, 16)
	require.NoError(t, q.Append(4)) // 20 tokens: full 5 blocks, window blocks 2..4
	writeAll(t, s, q, 1, 16, 20)
	free, st := p.FreeBlocks(), p.Stats()
	// From 20 the window gives block 2 back, but 8 more tokens need 4 blocks.
	require.ErrorIs(t, q.Append(8), accounting.ErrBudgetExceeded)
	assert.Equal(t, free, p.FreeBlocks())
	assert.Equal(t, st, p.Stats())
	assert.Equal(t, 20, q.Len())
	buf := make([]byte, s.TokenBytes)
	require.NoError(t, q.(baseline.Reader).ReadToken(1, baseline.K, 8, buf), "block 2 is held still")
	assert.Equal(t, pattern(s, 1, 1, baseline.K, 8), buf)
	checkLayer(t, s, q, 0, 0, 20, 1)
	checkLayer(t, s, q, 1, 8, 20, 1)
	require.NoError(t, q.Append(0), "an append of nothing still gives back what is dead")
	assert.Equal(t, free+1, p.FreeBlocks())
	require.ErrorIs(t, q.(baseline.Reader).ReadToken(1, baseline.K, 8, buf), baseline.ErrDropped)
	require.NoError(t, q.Close())
	require.NoError(t, p.Close())
}

// checkLayer reads tokens [from, to) of layer's K and V back and compares them with
// what sequence seq wrote.
func checkLayer(t *testing.T, s baseline.Shape, q baseline.Sequence, layer, from, to, seq int) {
	t.Helper()
	r := q.(baseline.Reader)
	buf := make([]byte, s.TokenBytes)
	for tok := from; tok < to; tok++ {
		for _, v := range []baseline.Kind{baseline.K, baseline.V} {
			require.NoError(t, r.ReadToken(layer, v, tok, buf))
			require.Equal(t, pattern(s, seq, layer, v, tok), buf, "layer %d %v token %d", layer, v, tok)
		}
	}
}

// windowModel is what a paged pool with windows must hold, computed apart: every
// holder's blocks per group, each named by an identity that sharing keeps, and every
// token's bytes.
type windowModel struct {
	bt      int
	windows []int // per group
	layers  []int // group of each layer
	next    int   // next block identity
}

type modelHolder struct {
	n     int
	first []int   // per group: first block held
	ids   [][]int // per group: identities of blocks first...
	ro    int     // blocks below are read-only
	data  map[[3]int][]byte
}

func (m *windowModel) firstBlock(g, n int) int {
	if w := m.windows[g]; w > 0 {
		return max(0, n-w+1) / m.bt
	}
	return 0
}

func (m *windowModel) newID() int { m.next++; return m.next }

// TestPagedWindowRandom drives pools with windows through random appends, writes,
// freezes, sequences from prefixes, closes and releases, and after every step checks
// each live token's bytes, that dropped tokens are refused, and Physical, Saved,
// Tokens and the free blocks against the model.
func TestPagedWindowRandom(t *testing.T) {
	const bt, tb = 4, 8
	configs := []struct {
		windows []int // per layer
		groups  []int // per layer: its group, as NewPaged cuts them
		gw      []int // per group: its window
	}{
		{[]int{0, 0, 0, 0}, []int{0, 0, 0, 0}, []int{0}},
		{[]int{8, 8, 8, 8}, []int{0, 0, 0, 0}, []int{8}},
		{[]int{0, 8, 0, 8}, []int{0, 1, 0, 1}, []int{0, 8}},
		{[]int{12, 0, 4, 0, 12, 4}, []int{0, 1, 2, 1, 0, 2}, []int{12, 0, 4}},
	}
	for ci, cfg := range configs {
		for seed := range uint64(6) {
			t.Run(fmt.Sprintf("config%d/seed%d", ci, seed), func(t *testing.T) {
				s := baseline.Shape{Layers: len(cfg.windows), TokenBytes: tb, MaxTokens: 48}
				runWindowModel(t, s, cfg.windows, &windowModel{bt: bt, windows: cfg.gw, layers: cfg.groups}, rand.New(rand.NewPCG(seed, uint64(ci))))
			})
		}
	}
}

func runWindowModel(t *testing.T, s baseline.Shape, windows []int, m *windowModel, rng *rand.Rand) {
	_, a := newAuthority(-1)
	p, err := baseline.NewPaged(s, baseline.PagedOptions{BlockTokens: m.bt, ChunkBlocks: 5, Windows: windows, Authority: a})
	require.NoError(t, err)
	bb := int64(p.BlockBytes())
	type seq struct {
		q baseline.Sequence
		h *modelHolder
	}
	type prefix struct {
		p baseline.Prefix
		h *modelHolder
	}
	var seqs []seq
	var prefixes []prefix
	groups := len(m.windows)
	fill := func(seed int) []byte {
		b := make([]byte, s.TokenBytes)
		for i := range b {
			b[i] = byte(seed*31 + i*7 + 1)
		}
		return b
	}
	stamp := 0
	write := func(sq seq, layer int, v baseline.Kind, tok int) {
		stamp++
		b := fill(stamp)
		g := m.layers[layer]
		err := sq.q.WriteToken(layer, v, tok, b)
		switch blk := tok / m.bt; {
		case blk < sq.h.first[g]:
			require.ErrorIs(t, err, baseline.ErrDropped)
		case blk < sq.h.ro:
			require.ErrorIs(t, err, baseline.ErrReadOnly)
		default:
			require.NoError(t, err)
			sq.h.data[[3]int{layer, int(v), tok}] = b
		}
	}
	check := func() {
		refs := 0
		held := map[int]bool{}
		var tokens int64
		count := func(h *modelHolder) {
			for _, ids := range h.ids {
				refs += len(ids)
				for _, id := range ids {
					held[id] = true
				}
			}
		}
		buf := make([]byte, s.TokenBytes)
		for _, sq := range seqs {
			count(sq.h)
			tokens += int64(sq.h.n)
			require.Equal(t, sq.h.n, sq.q.Len())
			r := sq.q.(baseline.Reader)
			for l := range s.Layers {
				g := m.layers[l]
				for tok := range sq.h.n {
					for _, v := range []baseline.Kind{baseline.K, baseline.V} {
						err := r.ReadToken(l, v, tok, buf)
						if tok/m.bt < sq.h.first[g] {
							require.ErrorIs(t, err, baseline.ErrDropped)
							continue
						}
						require.NoError(t, err)
						if want, ok := sq.h.data[[3]int{l, int(v), tok}]; ok && !bytes.Equal(want, buf) {
							t.Fatalf("layer %d %v token %d: read %v, wrote %v", l, v, tok, buf, want)
						}
					}
				}
			}
		}
		for _, pf := range prefixes {
			count(pf.h)
		}
		st := p.Stats()
		assert.Equal(t, tokens, st.Tokens)
		assert.Equal(t, int64(refs-len(held))*bb, st.Saved, "every extra reference to a block")
		assert.Equal(t, st.Physical/bb-int64(len(held)), int64(p.FreeBlocks()), "blocks no one holds are free")
		assert.Zero(t, st.Physical%(5*bb), "the pool holds whole chunks")
		assert.Equal(t, st.Physical, a.Stats().Owned)
	}
	newHolder := func() *modelHolder {
		return &modelHolder{first: make([]int, groups), ids: make([][]int, groups), data: map[[3]int][]byte{}}
	}
	for range 150 {
		switch op := rng.IntN(10); {
		case op == 0 || len(seqs) == 0:
			var sq seq
			if len(prefixes) > 0 && rng.IntN(2) == 0 {
				pf := prefixes[rng.IntN(len(prefixes))]
				q, err := p.NewSequenceFrom(pf.p)
				require.NoError(t, err)
				h := newHolder()
				h.n, h.ro = pf.h.n, pf.h.n/m.bt
				for g := range groups {
					h.first[g] = pf.h.first[g]
					h.ids[g] = append([]int(nil), pf.h.ids[g]...)
					if pf.h.n%m.bt > 0 {
						h.ids[g][len(h.ids[g])-1] = m.newID() // the tail is copied
					}
				}
				for k, v := range pf.h.data {
					h.data[k] = v
				}
				sq = seq{q, h}
			} else {
				q, err := p.NewSequence()
				require.NoError(t, err)
				sq = seq{q, newHolder()}
			}
			seqs = append(seqs, sq)
		case op <= 4: // append, then write the new tokens, as a forward pass
			sq := seqs[rng.IntN(len(seqs))]
			k := min(rng.IntN(9), s.MaxTokens-sq.h.n)
			from := sq.h.n
			require.NoError(t, sq.q.Append(k))
			h := sq.h
			for g := range groups {
				if d := m.firstBlock(g, from) - h.first[g]; d > 0 {
					h.ids[g] = h.ids[g][d:]
					h.first[g] += d
				}
				for h.first[g]+len(h.ids[g]) < (from+k+m.bt-1)/m.bt {
					h.ids[g] = append(h.ids[g], m.newID())
				}
			}
			h.n = from + k
			for l := range s.Layers {
				for tok := from; tok < h.n; tok++ {
					write(sq, l, baseline.K, tok)
					write(sq, l, baseline.V, tok)
				}
			}
		case op == 5: // write an older token: held, dropped or read-only
			sq := seqs[rng.IntN(len(seqs))]
			if sq.h.n > 0 {
				write(sq, rng.IntN(s.Layers), baseline.Kind(rng.IntN(2)), rng.IntN(sq.h.n))
			}
		case op == 6: // freeze
			sq := seqs[rng.IntN(len(seqs))]
			n := rng.IntN(sq.h.n + 1)
			pf, err := sq.q.Freeze(n)
			dropped := false
			for g := range groups {
				dropped = dropped || n > 0 && m.firstBlock(g, n) < sq.h.first[g]
			}
			if dropped {
				require.ErrorIs(t, err, baseline.ErrDropped)
				break
			}
			require.NoError(t, err)
			require.Equal(t, n, pf.Len())
			h := newHolder()
			h.n = n
			for g := range groups {
				first := m.firstBlock(g, n)
				h.first[g] = first
				if n > 0 {
					h.ids[g] = append([]int(nil), sq.h.ids[g][first-sq.h.first[g]:n/m.bt-sq.h.first[g]]...)
				}
				if n%m.bt > 0 {
					h.ids[g] = append(h.ids[g], m.newID())
				}
			}
			for k, v := range sq.h.data {
				if k[2] < n {
					h.data[k] = v
				}
			}
			sq.h.ro = max(sq.h.ro, n/m.bt)
			prefixes = append(prefixes, prefix{pf, h})
		case op <= 8:
			i := rng.IntN(len(seqs))
			require.NoError(t, seqs[i].q.Close())
			seqs = append(seqs[:i], seqs[i+1:]...)
		default:
			if len(prefixes) > 0 {
				i := rng.IntN(len(prefixes))
				prefixes[i].p.Release()
				prefixes = append(prefixes[:i], prefixes[i+1:]...)
			}
		}
		check()
	}
	for _, sq := range seqs {
		require.NoError(t, sq.q.Close())
	}
	for _, pf := range prefixes {
		pf.p.Release()
	}
	assert.Zero(t, p.Stats().Saved)
	assert.Equal(t, int(p.Stats().Physical/bb), p.FreeBlocks())
	require.NoError(t, p.Close())
	assert.Zero(t, a.Stats().Owned)
}
