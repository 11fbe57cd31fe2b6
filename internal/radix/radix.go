// Package radix is a radix tree keyed by token IDs: the index of kv's prefix cache.
//
// Each edge holds a run of tokens; a node's depth is the number of tokens from the root
// to the end of its edge. Leaves carry a value (kv keeps there the cached sequence
// that holds the leaf's tokens); an internal node's tokens are held by any leaf below
// it ([Tree.Cover]). Matching compares token IDs, never hashes, so equal keys are
// equal tokens by construction.
//
// A tree holds any number of namespaces, each a tree of its own under a root of its own
// (Space): no match, insert or pin crosses from one into another, and a namespace's
// root leaves the tree once it holds nothing. The default namespace (the empty key)
// is Root. All namespaces share one use clock and one set of leaves, so that an
// eviction that picks the least recently used leaf picks it across them all.
//
// Nodes carry a use clock for least-recently-used eviction and a pin count; the tree
// splits an edge where a pin ends and where two inserted sequences part, and merges a
// node with its only child once neither is needed. It does no eviction itself: the
// caller picks leaves (LRU, page-aware) and shortens or removes them.
//
// A Tree is not safe for concurrent use; kv guards it with the prefix cache's lock.
package radix

import "slices"

// Node is a node of a Tree. Its fields are read-only to callers.
type Node[V any] struct {
	parent *Node[V]
	key    []int32 // the edge's tokens, from the parent's depth to depth
	// buf is the array key lies at the start of, when no other node's key lies in it
	// (nil once a split shares it): Remove hands it back for the next Insert.
	buf      []int32
	depth    int
	children map[int32]*Node[V] // by first token of the child's edge
	used     uint64
	pins     int
	value    V
	space    string // a root's namespace key ("" for the default)
}

// Depth returns the tokens from the root to the end of the node's edge.
func (n *Node[V]) Depth() int { return n.depth }

// Parent returns the node's parent, or nil for the root.
func (n *Node[V]) Parent() *Node[V] { return n.parent }

// Children returns how many children the node has.
func (n *Node[V]) Children() int { return len(n.children) }

// Leaf reports whether the node has no children and is not the root.
func (n *Node[V]) Leaf() bool { return n.parent != nil && len(n.children) == 0 }

// Used returns the tree clock at the node's last use: lower is older.
func (n *Node[V]) Used() uint64 { return n.used }

// Pinned reports whether a pin ends at the node.
func (n *Node[V]) Pinned() bool { return n.pins > 0 }

// Edge returns the tokens of the node's edge, from its parent's depth to its own: the
// tree's own array, which the caller must not change. It holds them until the tree
// reuses it for another edge once the node has left the tree (see DeferReuse); a
// later Shorten of the node leaves the array as it is.
func (n *Node[V]) Edge() []int32 { return n.key }

// Value returns the leaf's value (the zero V for an internal node).
func (n *Node[V]) Value() V { return n.value }

// Tree is a radix tree of token runs. Its zero value is not usable; call New.
type Tree[V any] struct {
	root Node[V]
	// spaces holds the roots of the namespaces other than the default that hold a
	// token or a pin, by key; void stands for any other (see Space).
	spaces map[string]*Node[V]
	void   Node[V]
	clock  uint64
	leaves map[*Node[V]]struct{}
	// free holds the arrays of removed leaves' edges, for new edges to reuse: a
	// server's cache evicts a prompt and inserts the next one, and a fresh array would
	// cost a page fault per 4 KiB on its first write.
	free [][]int32
	// With DeferReuse, a removed edge's array waits in retired, then in aging (from
	// the next Release on), and is free for reuse from the Release after that.
	deferred       bool
	retired, aging [][]int32
}

// panicVoid is the panic value for an insert or pin under the root Space returns for
// a namespace the tree holds nothing of.
const panicVoid = "radix: insert or pin into a namespace with no root (MakeSpace)"

// maxFree bounds Tree.free.
const maxFree = 8

// newKey returns a copy of tokens in an array of its own, reused from a removed
// edge when one fits without wasting more than half of it.
func (t *Tree[V]) newKey(tokens []int32) (key, buf []int32) {
	for i, b := range t.free {
		if cap(b) >= len(tokens) && cap(b) <= 2*len(tokens)+64 {
			t.free[i] = t.free[len(t.free)-1]
			t.free = t.free[:len(t.free)-1]
			buf = b[:cap(b)]
			key = buf[:len(tokens):len(tokens)]
			copy(key, tokens)
			return key, buf
		}
	}
	key = slices.Clone(tokens)
	return key, key
}

// recycle keeps n's array for a later edge; n must have left the tree.
func (t *Tree[V]) recycle(n *Node[V]) {
	t.retire(n.buf)
	n.buf, n.key = nil, nil
}

// retire keeps buf, an array no edge uses any more, for a later edge (nil: nothing).
func (t *Tree[V]) retire(buf []int32) {
	switch {
	case buf == nil:
	case !t.deferred:
		if len(t.free) < maxFree {
			t.free = append(t.free, buf)
		}
	case len(t.retired) < maxFree:
		t.retired = append(t.retired, buf)
	}
}

// DeferReuse makes the tree hold each removed edge's array back from reuse until the
// second Release after its removal, for a reader outside the tree's lock that was
// handed edges (Node.Edge) and reads them later: the caller calls Release only once
// every such reader handed an edge before the previous Release is done with it, so
// that no array is written while a reader may still read it. (An edge's array is
// otherwise never written once it holds the edge: a split shares it, a merge and a
// lengthened leaf copy into fresh ones.)
func (t *Tree[V]) DeferReuse() { t.deferred = true }

// Release makes the arrays of the edges removed before the previous Release free for
// reuse (see DeferReuse).
func (t *Tree[V]) Release() {
	for _, b := range t.aging {
		if len(t.free) == maxFree {
			break
		}
		t.free = append(t.free, b)
	}
	clear(t.aging)
	t.aging, t.retired = t.retired, t.aging[:0]
}

// New returns an empty tree.
func New[V any]() *Tree[V] {
	return &Tree[V]{root: Node[V]{children: map[int32]*Node[V]{}}, leaves: map[*Node[V]]struct{}{}, spaces: map[string]*Node[V]{}}
}

// Root returns the root node (depth 0) of the default namespace.
func (t *Tree[V]) Root() *Node[V] { return &t.root }

// Space returns the root of the namespace key: Root for the empty key; for another,
// its root when the tree holds a token or a pin of it, else an empty root that stands
// for every such namespace, which Match, Peek and Cover find nothing under and which
// must not be inserted into or pinned (MakeSpace). A lookup allocates nothing.
func (t *Tree[V]) Space(key []byte) *Node[V] {
	if len(key) == 0 {
		return &t.root
	}
	if n := t.spaces[string(key)]; n != nil {
		return n
	}
	return &t.void
}

// MakeSpace returns the root of the namespace key, as Space does, made when the tree
// holds nothing of it yet: the root to insert or pin under. A root made and left
// empty stays until the next Remove or Unpin under it.
func (t *Tree[V]) MakeSpace(key []byte) *Node[V] {
	n := t.Space(key)
	if n == &t.void {
		n = &Node[V]{children: map[int32]*Node[V]{}, space: string(key)}
		t.spaces[n.space] = n
	}
	return n
}

// Spaces returns how many namespaces other than the default the tree holds roots of.
func (t *Tree[V]) Spaces() int { return len(t.spaces) }

// prune drops root, a namespace's root other than the default, from the tree once it
// holds no token and no pin.
func (t *Tree[V]) prune(root *Node[V]) {
	if root != &t.root && root != &t.void && len(root.children) == 0 && root.pins == 0 {
		delete(t.spaces, root.space)
	}
}

// Leaves returns how many leaves the tree has.
func (t *Tree[V]) Leaves() int { return len(t.leaves) }

// AnyLeaf returns a leaf at or below n other than not, or nil when there is none: the
// first child found at each node, no use clock compared (Cover follows the most
// recently used).
func (n *Node[V]) AnyLeaf(not *Node[V]) *Node[V] {
	for len(n.children) > 0 {
		var next *Node[V]
		for _, c := range n.children {
			if c != not {
				next = c
				break
			}
		}
		if next == nil {
			return nil
		}
		n = next
	}
	if n == not || n.parent == nil {
		return nil
	}
	return n
}

// EachLeafBelow calls fn for every leaf at or below n, in no particular order, until
// fn returns false, and reports whether fn never did. fn must not change the tree.
func (n *Node[V]) EachLeafBelow(fn func(*Node[V]) bool) bool {
	if len(n.children) == 0 {
		return n.parent == nil || fn(n)
	}
	for _, c := range n.children {
		if !c.EachLeafBelow(fn) {
			return false
		}
	}
	return true
}

// EachLeaf calls fn for every leaf, in no particular order, until fn returns false.
// fn must not change the tree.
func (t *Tree[V]) EachLeaf(fn func(*Node[V]) bool) {
	for l := range t.leaves {
		if !fn(l) {
			return
		}
	}
}

// common returns how many leading elements a and b share.
func common(a, b []int32) int {
	n := min(len(a), len(b))
	// NB: compare eight at a time first; the compiler keeps the loop bounds-check free.
	i := 0
	for ; i+8 <= n; i += 8 {
		if [8]int32(a[i:i+8]) != [8]int32(b[i:i+8]) {
			break
		}
	}
	for ; i < n; i++ {
		if a[i] != b[i] {
			break
		}
	}
	return i
}

// walk returns how many leading tokens the tree holds and the node whose edge holds
// the last of them (the root when none).
func (t *Tree[V]) walk(root *Node[V], tokens []int32) (int, *Node[V]) {
	n, pos := root, 0
	for pos < len(tokens) {
		c := n.children[tokens[pos]]
		if c == nil {
			break
		}
		k := common(c.key, tokens[pos:])
		pos += k
		n = c
		if k < len(c.key) {
			break
		}
	}
	return pos, n
}

// Match returns how many leading tokens of tokens the tree holds and the node whose
// edge holds the last of them (the root when none), and marks the path used.
func (t *Tree[V]) Match(tokens []int32) (int, *Node[V]) { return t.MatchFrom(&t.root, tokens) }

// MatchFrom is Match in the namespace whose root is root (Space).
func (t *Tree[V]) MatchFrom(root *Node[V], tokens []int32) (int, *Node[V]) {
	m, n := t.walk(root, tokens)
	t.touch(n)
	return m, n
}

// Peek is Match without marking anything used.
func (t *Tree[V]) Peek(tokens []int32) (int, *Node[V]) { return t.walk(&t.root, tokens) }

// PeekFrom is Peek in the namespace whose root is root (Space).
func (t *Tree[V]) PeekFrom(root *Node[V], tokens []int32) (int, *Node[V]) {
	return t.walk(root, tokens)
}

// touch marks n and its ancestors used now.
func (t *Tree[V]) touch(n *Node[V]) {
	t.clock++
	for ; n != nil; n = n.parent {
		n.used = t.clock
	}
}

// Touch marks n and its ancestors used now.
func (t *Tree[V]) Touch(n *Node[V]) { t.touch(n) }

// Cover returns a leaf at or below n, following the most recently used child: its
// value holds n's tokens. For the root of an empty tree it returns nil.
func (t *Tree[V]) Cover(n *Node[V]) *Node[V] {
	for len(n.children) > 0 {
		var best *Node[V]
		for _, c := range n.children {
			if best == nil || c.used > best.used {
				best = c
			}
		}
		n = best
	}
	if n.parent == nil {
		return nil // a root: its namespace holds nothing
	}
	return n
}

// split makes the first k tokens of n's edge a node of their own, n's parent, and
// returns it. 0 < k < len(n.key).
func (t *Tree[V]) split(n *Node[V], k int) *Node[V] {
	p := n.parent
	mid := &Node[V]{parent: p, key: n.key[:k:k], depth: n.depth - len(n.key) + k, used: n.used, children: map[int32]*Node[V]{}}
	n.buf = nil // mid's key lies in it too
	p.children[n.key[0]] = mid
	n.key = n.key[k:]
	n.parent = mid
	mid.children[n.key[0]] = n
	return mid
}

// at returns the node that ends at depth m on the path of n (n's edge holds token
// m-1), splitting n's edge when m falls inside it.
func (t *Tree[V]) at(n *Node[V], m int) *Node[V] {
	if n.parent == nil || m == n.depth {
		return n
	}
	return t.split(n, len(n.key)-(n.depth-m))
}

// Insert adds tokens to the tree, the new leaf carrying v, and marks its path used.
// It returns the new leaf, or nil when the tree holds every token already (then v is
// not stored). When the new leaf extends a leaf, that leaf becomes internal and its
// value is returned with displaced true: the caller drops it (the new leaf's value
// holds its tokens).
func (t *Tree[V]) Insert(tokens []int32, v V) (leaf *Node[V], old V, displaced bool) {
	return t.InsertFrom(&t.root, tokens, v)
}

// InsertFrom is Insert in the namespace whose root is root (MakeSpace); an insert of
// tokens under the empty root Space returns for a namespace the tree has none of
// panics.
func (t *Tree[V]) InsertFrom(root *Node[V], tokens []int32, v V) (leaf *Node[V], old V, displaced bool) {
	m, n := t.walk(root, tokens)
	if m == len(tokens) {
		t.touch(n)
		return nil, old, false
	}
	if root == &t.void {
		panic(panicVoid)
	}
	n = t.at(n, m)
	if n.Leaf() {
		old, displaced = n.value, true
		if n.pins == 0 {
			// Lengthen the leaf's edge rather than hang a lone child from it.
			prev := n.buf
			// NB: Clip makes append copy into a fresh array, n's alone.
			n.key = append(slices.Clip(n.key), tokens[m:]...)
			n.buf = n.key
			t.retire(prev)
			n.depth = len(tokens)
			n.value = v
			t.touch(n)
			return n, old, true
		}
		var zero V
		n.value = zero
		delete(t.leaves, n)
	}
	key, buf := t.newKey(tokens[m:])
	leaf = &Node[V]{parent: n, key: key, buf: buf, depth: len(tokens), value: v}
	if n.children == nil {
		n.children = map[int32]*Node[V]{}
	}
	n.children[tokens[m]] = leaf
	t.leaves[leaf] = struct{}{}
	t.touch(leaf)
	return leaf, old, displaced
}

// Shorten cuts leaf's edge so that its depth becomes depth, which must lie above its
// parent's depth and below its own.
func (t *Tree[V]) Shorten(leaf *Node[V], depth int) {
	if !leaf.Leaf() || depth <= leaf.parent.depth || depth >= leaf.depth {
		panic("radix: Shorten out of range")
	}
	leaf.key = leaf.key[: depth-leaf.parent.depth : depth-leaf.parent.depth]
	leaf.depth = depth
}

// Remove takes leaf out of the tree and returns its parent. When the parent is left
// with no child (it is not the root), it becomes a leaf and must be given a value with
// SetValue; when it is left with one child and no pin, it is merged with that child.
func (t *Tree[V]) Remove(leaf *Node[V]) *Node[V] {
	if !leaf.Leaf() {
		panic("radix: Remove of a node that is not a leaf")
	}
	p := leaf.parent
	delete(p.children, leaf.key[0])
	delete(t.leaves, leaf)
	leaf.parent = nil
	t.recycle(leaf)
	switch {
	case p.parent == nil:
		t.prune(p)
	case len(p.children) == 0:
		t.leaves[p] = struct{}{}
	}
	t.mergeDown(p)
	return p
}

// SetValue gives leaf its value.
func (t *Tree[V]) SetValue(leaf *Node[V], v V) {
	if !leaf.Leaf() {
		panic("radix: SetValue on a node that is not a leaf")
	}
	leaf.value = v
}

// mergeDown merges n into its only child when n is an unpinned internal node.
func (t *Tree[V]) mergeDown(n *Node[V]) {
	if n.parent == nil || n.pins > 0 || len(n.children) != 1 {
		return
	}
	var c *Node[V]
	for _, c = range n.children {
	}
	key := make([]int32, 0, len(n.key)+len(c.key))
	c.key = append(append(key, n.key...), c.key...)
	c.buf = c.key // a fresh array; NB: n's may still hold a pin's view of its tokens
	c.parent = n.parent
	c.used = max(c.used, n.used)
	n.parent.children[c.key[0]] = c
	n.parent, n.children = nil, nil
}

// Pin pins the longest held prefix of tokens, splitting an edge where it ends, and
// returns the pinned node (the root when nothing matched: a pin of nothing).
func (t *Tree[V]) Pin(tokens []int32) *Node[V] { return t.PinFrom(&t.root, tokens) }

// PinFrom is Pin in the namespace whose root is root (MakeSpace); the empty root
// Space returns for a namespace the tree has none of panics.
func (t *Tree[V]) PinFrom(root *Node[V], tokens []int32) *Node[V] {
	if root == &t.void {
		panic(panicVoid)
	}
	m, n := t.walk(root, tokens)
	n = t.at(n, m)
	n.pins++
	t.touch(n)
	return n
}

// Unpin drops a pin taken by Pin. Unpinning a node with no pin panics.
func (t *Tree[V]) Unpin(n *Node[V]) {
	if n.pins <= 0 {
		panic("radix: Unpin of a node with no pin")
	}
	n.pins--
	if n.parent != nil {
		t.mergeDown(n)
	} else {
		t.prune(n)
	}
}

// Tokens returns the tokens the tree holds: the sum of its edges' lengths.
func (t *Tree[V]) Tokens() int64 {
	var n int64
	var walk func(*Node[V])
	walk = func(x *Node[V]) {
		n += int64(len(x.key))
		for _, c := range x.children {
			walk(c)
		}
	}
	walk(&t.root)
	for _, r := range t.spaces {
		walk(r)
	}
	return n
}

// Tokens returns the tokens from the root to the end of n's edge (a copy).
func (n *Node[V]) Tokens() []int32 { return n.AppendTokens(nil) }

// AppendTokens returns dst with the tokens from the root to the end of n's edge
// appended: no allocation when dst has room for them.
func (n *Node[V]) AppendTokens(dst []int32) []int32 {
	start := len(dst)
	dst = slices.Grow(dst, n.depth)[:start+n.depth]
	out := dst[start:]
	for ; n != nil && n.parent != nil; n = n.parent {
		copy(out[n.depth-len(n.key):n.depth], n.key)
	}
	return dst
}
