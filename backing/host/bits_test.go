package host

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBitsetModel drives random operations on a bitset and a []bool model, and
// checks every query against the model after each step.
func TestBitsetModel(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 7))
		n := 1 + r.IntN(300)
		b := newBitset(n)
		model := make([]bool, n)
		for step := range 200 {
			i := r.IntN(n)
			k := r.IntN(n - i + 1)
			switch r.IntN(4) {
			case 0:
				b.set(i)
				model[i] = true
			case 1:
				b.clear(i)
				model[i] = false
			case 2:
				b.setRange(i, k)
				for j := i; j < i+k; j++ {
					model[j] = true
				}
			case 3:
				b.clearRange(i, k)
				for j := i; j < i+k; j++ {
					model[j] = false
				}
			}
			count, want := b.count(), 0
			for j, v := range model {
				require.Equal(t, v, b.has(j), "has, seed %d step %d", seed, step)
				if v {
					want++
				}
			}
			require.Equal(t, want, count, "count, seed %d step %d", seed, step)
			lo := r.IntN(n + 1)
			hi := lo + r.IntN(n-lo+1)
			require.Equal(t, modelFind(model, lo, hi, true), b.next(lo, hi), "next, seed %d step %d", seed, step)
			require.Equal(t, modelFind(model, lo, hi, false), b.nextClear(lo, hi), "nextClear, seed %d step %d", seed, step)
			prev := -1
			for j := lo - 1; j >= 0; j-- {
				if model[j] {
					prev = j
					break
				}
			}
			require.Equal(t, prev, b.prev(lo), "prev, seed %d step %d", seed, step)
			all := true
			for j := lo; j < hi; j++ {
				all = all && model[j]
			}
			require.Equal(t, all, b.all(lo, hi-lo, n), "all, seed %d step %d", seed, step)
			for _, tail := range []bool{false, true} {
				require.Equal(t, modelRun(model, k, tail), b.run(k, n, tail), "run, seed %d step %d", seed, step)
			}
			wantSpan := 1 + r.IntN(n)
			ms, mk := modelSpan(model, wantSpan, true)
			bs, bk := b.span(wantSpan, n)
			require.Equal(t, [2]int{ms, mk}, [2]int{bs, bk}, "span %d, seed %d step %d", wantSpan, seed, step)
			ms, mk = modelSpan(model, wantSpan, false)
			bs, bk = b.spanClear(wantSpan, n)
			require.Equal(t, [2]int{ms, mk}, [2]int{bs, bk}, "spanClear %d, seed %d step %d", wantSpan, seed, step)
		}
		b.resize(n + 100)
		for j := n; j < n+100; j++ {
			require.False(t, b.has(j), "resize adds clear bits")
		}
	}
}

// modelFind returns the first j in [lo, hi) with model[j] == v, or hi.
func modelFind(model []bool, lo, hi int, v bool) int {
	for j := lo; j < hi; j++ {
		if model[j] == v {
			return j
		}
	}
	return hi
}

// modelRun is bitset.run on the model: the start of the first k set bits in a row,
// or of a run that reaches the end when tail is true.
func modelRun(model []bool, k int, tail bool) int {
	n := len(model)
	for i := 0; i < n; {
		if !model[i] {
			i++
			continue
		}
		j := i
		for j < n && model[j] {
			j++
		}
		if j-i >= k || (tail && j == n) {
			return i
		}
		i = j
	}
	if tail {
		return n
	}
	return -1
}

// modelSpan is bitset.span (v true) or spanClear (v false) on the model: the first
// run of at least want bits equal to v, as (start, want), else the first longest
// run, else (len(model), 0).
func modelSpan(model []bool, want int, v bool) (int, int) {
	n := len(model)
	start, k := n, 0
	for i := 0; i < n; {
		if model[i] != v {
			i++
			continue
		}
		j := i
		for j < n && model[j] == v {
			j++
		}
		if j-i >= want {
			return i, want
		}
		if j-i > k {
			start, k = i, j-i
		}
		i = j
	}
	return start, k
}
