package kv

// HeldTokens returns how many leading tokens of tokens the index holds (no use is
// marked).
func (pc *PrefixCache) HeldTokens(tokens []int32) int {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	m, _ := pc.tree.Peek(tokens)
	return m
}

// IndexPaths returns the tokens of every path from the root to a leaf of the index.
func (pc *PrefixCache) IndexPaths() [][]int32 {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	var out [][]int32
	for leaf := range pc.tree.EachLeaf {
		out = append(out, leaf.Tokens())
	}
	return out
}
