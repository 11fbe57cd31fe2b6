package radix

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// spaceKeys are the namespaces TestSpacesAgainstNaive drives: the default and two
// others.
var spaceKeys = [][]byte{nil, []byte("a"), []byte("b")}

// TestSpacesAgainstNaive inserts, pins and evicts in three namespaces at random and
// checks each against a model of its own: no match ever finds another namespace's
// tokens, and a namespace's root goes once it holds nothing.
func TestSpacesAgainstNaive(t *testing.T) {
	for seed := range uint64(40) {
		r := rand.New(rand.NewPCG(seed, 3))
		tr := New[int]()
		models := make([]naive, len(spaceKeys))
		type pin struct {
			n  *Node[int]
			sp int
		}
		var pins []pin
		for i := range 120 {
			sp := r.IntN(len(spaceKeys))
			key := spaceKeys[sp]
			switch op := r.IntN(10); {
			case op < 5:
				s := randomStream(r, models[sp])
				if len(s) == 0 {
					continue
				}
				leaf, _, _ := tr.InsertFrom(tr.MakeSpace(key), s, i)
				if leaf != nil {
					require.Equal(t, s, leaf.Tokens())
				}
				models[sp] = append(models[sp], s)
			case op < 6 && len(models[sp]) > 0:
				s := models[sp][r.IntN(len(models[sp]))]
				pins = append(pins, pin{tr.PinFrom(tr.MakeSpace(key), s[:r.IntN(len(s)+1)]), sp})
			case op < 7 && len(pins) > 0:
				k := r.IntN(len(pins))
				tr.Unpin(pins[k].n)
				pins = append(pins[:k], pins[k+1:]...)
			default:
				// Remove a random unpinned leaf, as eviction does, and cut its
				// namespace's model.
				var leaf *Node[int]
				tr.EachLeaf(func(n *Node[int]) bool {
					if !n.Pinned() && r.IntN(3) == 0 {
						leaf = n
						return false
					}
					return true
				})
				if leaf == nil {
					continue
				}
				root := leaf
				for root.parent != nil {
					root = root.parent
				}
				owner := -1
				for j, k := range spaceKeys {
					if tr.Space(k) == root {
						owner = j
					}
				}
				require.GreaterOrEqual(t, owner, 0, "a leaf under no namespace's root")
				full, pd := leaf.Tokens(), leaf.parent.depth
				p := tr.Remove(leaf)
				models[owner] = cut(models[owner], full, pd)
				if p.Leaf() {
					tr.SetValue(p, i)
				}
			}
			check(t, tr)
			for j, k := range spaceKeys {
				root := tr.Space(k)
				for _, s := range models[j] {
					m, _ := tr.PeekFrom(root, s)
					require.Equal(t, len(s), m, "seed %d step %d: namespace %d lost a string", seed, i, j)
				}
				q := randomStream(r, models[(j+1)%len(models)])
				m, _ := tr.PeekFrom(root, q)
				require.Equal(t, models[j].longest(q), m, "seed %d step %d: namespace %d matched another's", seed, i, j)
			}
		}
	}
}

func TestSpaceRoots(t *testing.T) {
	tr := New[int]()
	assert.Same(t, tr.Root(), tr.Space(nil), "the empty key is the default namespace")
	void := tr.Space([]byte("x"))
	m, n := tr.MatchFrom(void, []int32{1, 2})
	assert.Equal(t, 0, m)
	assert.Nil(t, tr.Cover(n), "nothing under a namespace the tree does not hold")
	assert.PanicsWithValue(t, panicVoid, func() { tr.InsertFrom(void, []int32{1}, 1) })
	assert.PanicsWithValue(t, panicVoid, func() { tr.PinFrom(void, []int32{1}) })
	leaf, _, _ := tr.InsertFrom(void, nil, 1)
	assert.Nil(t, leaf, "an insert of nothing inserts nothing, anywhere")

	x := tr.MakeSpace([]byte("x"))
	assert.Same(t, x, tr.MakeSpace([]byte("x")))
	leaf, _, _ = tr.InsertFrom(x, []int32{1, 2, 3}, 7)
	require.NotNil(t, leaf)
	assert.Same(t, x, tr.Space([]byte("x")))
	assert.Equal(t, 1, tr.Spaces())
	m, _ = tr.Peek([]int32{1, 2, 3})
	assert.Equal(t, 0, m, "the default namespace does not see x's tokens")
	assert.Equal(t, int64(3), tr.Tokens(), "Tokens counts every namespace")
	assert.Same(t, x, tr.Remove(leaf))
	assert.Equal(t, 0, tr.Spaces(), "a namespace that holds nothing leaves")
	assert.Same(t, void, tr.Space([]byte("x")))

	p := tr.PinFrom(tr.MakeSpace([]byte("y")), []int32{5})
	assert.Equal(t, 1, tr.Spaces(), "a pin of nothing keeps its namespace's root")
	tr.Unpin(p)
	assert.Equal(t, 0, tr.Spaces())
}
