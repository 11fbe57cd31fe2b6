package radix

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// naive is the reference model: the set of inserted token strings.
type naive [][]int32

func (m naive) longest(q []int32) int {
	best := 0
	for _, s := range m {
		best = max(best, common(s, q))
	}
	return best
}

// randomStream returns a token string that shares a random prefix of one already
// made, over a small vocabulary so that accidental matches happen too.
func randomStream(r *rand.Rand, made [][]int32) []int32 {
	var out []int32
	if len(made) > 0 && r.IntN(4) > 0 {
		base := made[r.IntN(len(made))]
		out = append(out, base[:r.IntN(len(base)+1)]...)
	}
	for range r.IntN(40) {
		out = append(out, int32(r.IntN(4)))
	}
	return out
}

// check verifies the tree's structure in every namespace: depths add up, children
// are keyed by their first token, every leaf is in the leaf set and the set holds
// nothing else, no unpinned internal node has one child, and a namespace other than
// the default has a root exactly while it holds a token or a pin.
func check(t *testing.T, tr *Tree[int]) {
	t.Helper()
	leaves := 0
	var visit func(n *Node[int])
	visit = func(n *Node[int]) {
		for k, c := range n.children {
			require.Same(t, n, c.parent)
			require.NotEmpty(t, c.key)
			require.Equal(t, k, c.key[0])
			require.Equal(t, n.depth+len(c.key), c.depth)
			visit(c)
		}
		if n.Leaf() {
			leaves++
			_, ok := tr.leaves[n]
			require.True(t, ok, "leaf missing from the leaf set")
		} else if n.parent != nil && n.pins == 0 {
			require.Greater(t, len(n.children), 1, "unpinned internal node with one child")
		}
	}
	visit(&tr.root)
	for key, r := range tr.spaces {
		require.Equal(t, key, r.space)
		require.Nil(t, r.parent)
		require.True(t, len(r.children) > 0 || r.pins > 0, "namespace %q kept a root that holds nothing", key)
		visit(r)
	}
	require.Equal(t, leaves, len(tr.leaves), "the leaf set is every namespace's leaves")
	assert.Empty(t, tr.void.children, "the empty root holds nothing")
}

func TestMatchAgainstNaive(t *testing.T) {
	for seed := range uint64(50) {
		r := rand.New(rand.NewPCG(seed, 1))
		tr := New[int]()
		var model naive
		for i := range 60 {
			s := randomStream(r, model)
			m, _ := tr.Peek(s)
			require.Equal(t, model.longest(s), m, "seed %d step %d", seed, i)
			leaf, _, _ := tr.Insert(s, i)
			if leaf != nil {
				require.Equal(t, s, leaf.Tokens())
			}
			model = append(model, s)
			check(t, tr)
			q := randomStream(r, model)
			m, n := tr.Match(q)
			require.Equal(t, model.longest(q), m)
			if m > 0 {
				c := tr.Cover(n)
				require.NotNil(t, c)
				assert.Equal(t, q[:m], c.Tokens()[:m], "the cover holds the matched tokens")
			}
		}
	}
}

// TestEvictAgainstNaive shortens and removes leaves as kv's eviction does and checks
// that the tree then holds exactly the model's (shortened) strings.
func TestEvictAgainstNaive(t *testing.T) {
	for seed := range uint64(50) {
		r := rand.New(rand.NewPCG(seed, 2))
		tr := New[int]()
		var model naive
		var pins []*Node[int]
		for i := range 80 {
			switch op := r.IntN(10); {
			case op < 5:
				s := randomStream(r, model)
				tr.Insert(s, i)
				model = append(model, s)
			case op < 6 && len(model) > 0:
				s := model[r.IntN(len(model))]
				pins = append(pins, tr.Pin(s[:r.IntN(len(s)+1)]))
			case op < 7 && len(pins) > 0:
				k := r.IntN(len(pins))
				tr.Unpin(pins[k])
				pins = append(pins[:k], pins[k+1:]...)
			default:
				// Shorten or remove a random unpinned leaf, as eviction does.
				var leaf *Node[int]
				tr.EachLeaf(func(n *Node[int]) bool {
					if !n.Pinned() {
						leaf = n
						return false
					}
					return true
				})
				if leaf == nil {
					continue
				}
				full := leaf.Tokens()
				pd := leaf.parent.depth
				if d := pd + 1 + r.IntN(leaf.depth-pd); d < leaf.depth {
					tr.Shorten(leaf, d)
					model = cut(model, full, d)
				} else {
					p := tr.Remove(leaf)
					model = cut(model, full, pd)
					if p.Leaf() {
						tr.SetValue(p, i)
					}
				}
			}
			check(t, tr)
			for _, s := range model {
				m, _ := tr.Peek(s)
				require.Equal(t, len(s), m, "seed %d step %d: a held string is lost", seed, i)
			}
			q := randomStream(r, model)
			m, _ := tr.Peek(q)
			require.Equal(t, model.longest(q), m, "seed %d step %d", seed, i)
			for _, p := range pins {
				if p != tr.Root() {
					require.NotNil(t, p.parent, "a pinned node left the tree")
				}
			}
		}
	}
}

// cut replaces, in the model, every string that extends full's first keep tokens
// beyond them and is not held by another path by that prefix: what the tree holds
// after the leaf for full is cut to keep tokens.
func cut(model naive, full []int32, keep int) naive {
	var out naive
	for _, s := range model {
		if common(s, full) > keep && len(s) > keep {
			s = s[:max(keep, 0)]
			if common(s, full) > keep {
				continue
			}
		}
		out = append(out, s)
	}
	// Strings that continue past keep along full's path are gone.
	for i, s := range out {
		if common(s, full) > keep {
			out[i] = s[:keep]
		}
	}
	return out
}

func TestMisusePanics(t *testing.T) {
	tr := New[int]()
	leaf, _, _ := tr.Insert([]int32{1, 2, 3}, 1)
	assert.PanicsWithValue(t, "radix: Shorten out of range", func() { tr.Shorten(leaf, 3) })
	assert.PanicsWithValue(t, "radix: Shorten out of range", func() { tr.Shorten(leaf, 0) })
	assert.PanicsWithValue(t, "radix: Remove of a node that is not a leaf", func() { tr.Remove(tr.Root()) })
	assert.PanicsWithValue(t, "radix: Unpin of a node with no pin", func() { tr.Unpin(leaf) })
	assert.PanicsWithValue(t, "radix: SetValue on a node that is not a leaf", func() { tr.SetValue(tr.Root(), 1) })
}

func TestInsertDisplacesExtendedLeaf(t *testing.T) {
	tr := New[int]()
	tr.Insert([]int32{1, 2}, 7)
	leaf, old, displaced := tr.Insert([]int32{1, 2, 3}, 8)
	require.NotNil(t, leaf)
	assert.True(t, displaced)
	assert.Equal(t, 7, old)
	assert.Equal(t, 1, tr.Leaves())
	leaf, _, _ = tr.Insert([]int32{1}, 9)
	assert.Nil(t, leaf, "a held prefix is not inserted again")
}

// TestRemovedEdgeReused: a removed leaf's array holds the next inserted edge (no
// fresh allocation), and neither the leaf's old tokens nor a split edge sharing an
// array is ever handed out.
func TestRemovedEdgeReused(t *testing.T) {
	tr := New[int]()
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	leaf, _, _ := tr.Insert(a, 1)
	buf := &leaf.buf[0]
	tr.Remove(leaf)
	require.Len(t, tr.free, 1)
	b := []int32{9, 10, 11, 12, 13, 14, 15, 16}
	nb, _, _ := tr.Insert(b, 2)
	assert.Same(t, buf, &nb.key[0], "the removed edge's array is reused")
	assert.Empty(t, tr.free)
	m, _ := tr.Peek(a)
	assert.Zero(t, m, "the removed tokens are gone")
	m, _ = tr.Peek(b)
	assert.Equal(t, len(b), m)

	// A split shares the array between the two halves: removing the lower one must
	// not hand it out while the upper one still reads it.
	c := []int32{9, 10, 11, 12, 99}
	nc, _, _ := tr.Insert(c, 3)
	require.Nil(t, nb.buf, "split: the array is shared")
	p := tr.Remove(nb)
	assert.Empty(t, tr.free)
	if p.Leaf() {
		tr.SetValue(p, 4)
	}
	d := []int32{50, 51, 52, 53, 54, 55}
	tr.Insert(d, 5)
	m, _ = tr.Peek(c)
	assert.Equal(t, len(c), m, "the shared prefix is intact")
	assert.Equal(t, c, nc.Tokens())
	check(t, tr)
}

// TestAppendTokens: a node's tokens go after dst's own, across split edges, and into
// dst's spare room without an allocation.
func TestAppendTokens(t *testing.T) {
	tr := New[int]()
	a, _, _ := tr.Insert([]int32{1, 2, 3, 4, 5}, 1)
	b, _, _ := tr.Insert([]int32{1, 2, 9}, 2) // splits a's edge after 2
	dst := []int32{7}
	assert.Equal(t, []int32{7, 1, 2, 3, 4, 5}, a.AppendTokens(dst))
	assert.Equal(t, []int32{7, 1, 2, 9}, b.AppendTokens(dst))
	assert.Equal(t, []int32{1, 2}, b.Parent().AppendTokens(nil))
	assert.Empty(t, tr.Root().AppendTokens(nil))
	assert.Equal(t, a.Tokens(), a.AppendTokens(nil))
	buf := make([]int32, 0, 8)
	assert.Zero(t, testing.AllocsPerRun(10, func() { buf = a.AppendTokens(buf[:0]) }))
}

// TestDeferReuse: with DeferReuse, a removed edge's array keeps its tokens through the
// next Release and is reused only after the one after it; an edge handed out (Edge)
// reads the same tokens all that time.
func TestDeferReuse(t *testing.T) {
	tr := New[int]()
	tr.DeferReuse()
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	leaf, _, _ := tr.Insert(a, 1)
	edge := leaf.Edge()
	require.Equal(t, a, edge)
	tr.Remove(leaf)
	assert.Empty(t, tr.free, "not free before two Releases")
	b := []int32{9, 10, 11, 12, 13, 14, 15, 16}
	nb, _, _ := tr.Insert(b, 2)
	assert.NotSame(t, &edge[0], &nb.Edge()[0], "a retired array is not reused at once")
	tr.Release()
	tr.Remove(nb)
	c := []int32{17, 18, 19, 20, 21, 22, 23, 24}
	nc, _, _ := tr.Insert(c, 3)
	assert.NotSame(t, &edge[0], &nc.Edge()[0], "nor after one Release")
	assert.Equal(t, a, edge, "the handed-out edge still reads its tokens")
	tr.Release()
	d := []int32{25, 26, 27, 28, 29, 30, 31, 32}
	nd, _, _ := tr.Insert(d, 4)
	assert.Same(t, &edge[0], &nd.Edge()[0], "free after the second Release")
	check(t, tr)

	// A lengthened leaf's old array is retired the same way.
	tr.Insert(append(slices.Clone(d), 33), 5)
	assert.Empty(t, tr.free)
	assert.Equal(t, [][]int32{d}, tr.retired, "the lengthened leaf's old array waits")
	assert.Len(t, tr.aging, 1, "and nb's, removed before the last Release")
}

// TestAnyLeaf: a leaf below a node other than the one named, or nil when that one is
// the only leaf there.
func TestAnyLeaf(t *testing.T) {
	tr := New[int]()
	assert.Nil(t, tr.Root().AnyLeaf(nil), "an empty tree has no leaf")
	a, _, _ := tr.Insert([]int32{1, 2, 3}, 1)
	assert.Same(t, a, tr.Root().AnyLeaf(nil))
	assert.Nil(t, tr.Root().AnyLeaf(a))
	assert.Same(t, a, a.AnyLeaf(nil), "a leaf is its own")
	b, _, _ := tr.Insert([]int32{1, 2, 4, 5}, 2)
	p := b.Parent()
	require.Equal(t, 2, p.Depth())
	assert.Same(t, a, p.AnyLeaf(b))
	assert.Same(t, b, p.AnyLeaf(a))
	got := tr.Root().AnyLeaf(nil)
	assert.True(t, got == a || got == b)
}

// TestEachLeafBelow checks that every leaf under a node, and only those, is visited,
// against the inserted strings, and that fn's false ends the walk.
func TestEachLeafBelow(t *testing.T) {
	tr := New[int]()
	assert.True(t, tr.Root().EachLeafBelow(func(*Node[int]) bool { t.Fatal("an empty tree has no leaf"); return true }))
	r := rand.New(rand.NewPCG(7, 25))
	var made [][]int32
	for i := range 60 {
		s := randomStream(r, made)
		made = append(made, s)
		tr.Insert(s, i)
	}
	for _, q := range made[:20] {
		m, n := tr.Peek(q)
		var got []*Node[int]
		require.True(t, n.EachLeafBelow(func(l *Node[int]) bool { got = append(got, l); return true }))
		want := 0
		tr.EachLeaf(func(l *Node[int]) bool {
			toks := l.Tokens()
			if len(toks) >= n.Depth() && common(toks, q) >= m && (n.Parent() == nil || slices.Equal(toks[:n.Depth()], n.Tokens())) {
				want++
				assert.Contains(t, got, l)
			}
			return true
		})
		assert.Len(t, got, want, "the leaves below the node of %v", q)
	}
	calls := 0
	assert.False(t, tr.Root().EachLeafBelow(func(*Node[int]) bool { calls++; return false }))
	assert.Equal(t, 1, calls, "false ends the walk")
}
