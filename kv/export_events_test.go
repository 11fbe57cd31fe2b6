package kv

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
