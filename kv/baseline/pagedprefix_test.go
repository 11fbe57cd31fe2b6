package baseline_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv/baseline"
)

func prefixPaged(t *testing.T, limit int64) *baseline.Paged {
	t.Helper()
	_, a := newAuthority(limit)
	p, err := baseline.NewPaged(testShape, baseline.PagedOptions{BlockTokens: 4, ChunkBlocks: 2, Authority: a, PrefixCache: true})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, p.Close()) })
	return p
}

func ids(n int, seed int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = seed*1000 + int32(i)
	}
	return out
}

// prefill makes a sequence of tokens, writes each token's pattern and indexes it.
func prefill(t *testing.T, p *baseline.Paged, tokens []int32, seq int) baseline.Sequence {
	t.Helper()
	q, m, err := p.Lookup(tokens)
	require.NoError(t, err)
	require.NoError(t, q.Append(len(tokens)-m))
	for tok := m; tok < len(tokens); tok++ {
		for l := range testShape.Layers {
			for _, v := range []baseline.Kind{baseline.K, baseline.V} {
				require.NoError(t, q.WriteToken(l, v, tok, pattern(testShape, seq, l, v, tok)))
			}
		}
	}
	require.NoError(t, p.Insert(q, tokens))
	return q
}

func TestPagedLookupMatchesWholeBlocks(t *testing.T) {
	p := prefixPaged(t, -1)
	a := ids(10, 1) // blocks of 4: two whole blocks
	q := prefill(t, p, a, 1)
	require.NoError(t, q.Close())

	tests := []struct {
		name   string
		tokens []int32
		want   int
	}{
		{"longer prompt", append(append([]int32{}, a...), 7, 8, 9), 8},
		{"same prompt", a, 8},
		{"the last token is never matched", a[:8], 4},
		{"diverging in block 2", append(append([]int32{}, a[:6]...), -1, -1, -1), 4},
		{"diverging at once", ids(10, 2), 0},
		{"empty", nil, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q, m, err := p.Lookup(tt.tokens)
			require.NoError(t, err)
			defer q.Close()
			assert.Equal(t, tt.want, m)
			assert.Equal(t, tt.want, q.Len())
			dst := make([]byte, testShape.TokenBytes)
			for tok := range m {
				require.NoError(t, q.(baseline.Reader).ReadToken(1, baseline.V, tok, dst))
				assert.Equal(t, pattern(testShape, 1, 1, baseline.V, tok), dst, "token %d", tok)
			}
			if m > 0 {
				assert.ErrorIs(t, q.WriteToken(0, baseline.K, 0, dst), baseline.ErrReadOnly)
			}
		})
	}
	st := p.PrefixStats()
	assert.Equal(t, int64(10+13+10+8+9+10), st.Queries)
	assert.Equal(t, int64(8+8+4+4), st.Hits)
}

// TestPagedChainNeedsItsParent: a block's tokens alone do not match; its parent must.
func TestPagedChainNeedsItsParent(t *testing.T) {
	p := prefixPaged(t, -1)
	a := ids(9, 1)
	require.NoError(t, prefill(t, p, a, 1).Close())
	b := append(ids(4, 2), a[4:]...) // block 1 equal to a's, under another parent
	q, m, err := p.Lookup(b)
	require.NoError(t, err)
	assert.Zero(t, m)
	require.NoError(t, q.Close())
}

// TestPagedEvictsLeastRecentlyUsed: with the pool at its budget, new blocks come from
// the free cached blocks, oldest first and each sequence's tail before its head.
func TestPagedEvictsLeastRecentlyUsed(t *testing.T) {
	bb := int64(4 * testShape.BytesPerToken())
	p := prefixPaged(t, 4*bb) // two chunks of two blocks
	a, b := ids(9, 1), ids(9, 2)
	require.NoError(t, prefill(t, p, a, 1).Close()) // 3 blocks, 2 whole ones cached
	require.NoError(t, prefill(t, p, b, 2).Close())
	// The budget holds 4 blocks; a's were freed first: its tail block went first.
	q, m, err := p.Lookup(a)
	require.NoError(t, err)
	defer q.Close()
	assert.Equal(t, 4, m, "a's blocks were the oldest: its tail block went, its head stayed")
	assert.Positive(t, p.PrefixStats().Evicted)
}

// TestPagedBudgetWithCache: the cache never holds more than the budget, and a request
// that needs more than free plus cached blocks is refused, changing nothing.
func TestPagedBudgetWithCache(t *testing.T) {
	bb := int64(4 * testShape.BytesPerToken())
	p := prefixPaged(t, 4*bb)
	require.NoError(t, prefill(t, p, ids(9, 1), 1).Close())
	q, _, err := p.Lookup(ids(4, 9))
	require.NoError(t, err)
	defer q.Close()
	before := p.PrefixStats()
	err = q.Append(20)
	require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Equal(t, before, p.PrefixStats(), "a refusal evicts nothing")
	assert.LessOrEqual(t, p.Stats().Physical, 4*bb)
}

func TestPagedPrefixBadInput(t *testing.T) {
	off, err := baseline.NewPaged(testShape, baseline.PagedOptions{})
	require.NoError(t, err)
	defer off.Close()
	_, _, err = off.Lookup(ids(4, 1))
	assert.ErrorIs(t, err, baseline.ErrOptions)
	q, err := off.NewSequence()
	require.NoError(t, err)
	assert.ErrorIs(t, off.Insert(q, nil), baseline.ErrOptions)
	p := prefixPaged(t, -1)
	assert.ErrorIs(t, p.Insert(q, nil), baseline.ErrForeign)
	require.NoError(t, q.Close())
	assert.Zero(t, off.PrefixStats())
}

// TestPagedPrefixRandom drives random prompts sharing prefixes and checks every match
// against a naive model: the longest run of whole blocks, short of the last token,
// that a cached (never evicted: no budget) earlier prompt shares.
func TestPagedPrefixRandom(t *testing.T) {
	p := prefixPaged(t, -1)
	r := rand.New(rand.NewPCG(3, 4))
	var made [][]int32
	for i := range 200 {
		var tok []int32
		if len(made) > 0 && r.IntN(3) > 0 {
			base := made[r.IntN(len(made))]
			tok = append(tok, base[:r.IntN(len(base)+1)]...)
		}
		for range 1 + r.IntN(20) {
			tok = append(tok, int32(r.IntN(3)))
		}
		want := 0
		for _, s := range made {
			k := 0
			for k < len(s) && k < len(tok) && s[k] == tok[k] {
				k++
			}
			want = max(want, min(k, len(tok)-1, len(s))/4*4)
		}
		q, m, err := p.Lookup(tok)
		require.NoError(t, err)
		require.Equal(t, want, m, "step %d", i)
		require.NoError(t, q.Append(len(tok)-m))
		require.NoError(t, p.Insert(q, tok))
		require.NoError(t, q.Close())
		made = append(made, tok)
	}
}
