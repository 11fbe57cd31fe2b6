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

// EventsQueued returns how many changes the prefix cache queued for its events'
// goroutine, in all (0 without an observer).
func (pc *PrefixCache) EventsQueued() int64 {
	if pc.ev == nil {
		return 0
	}
	pc.ev.mu.Lock()
	defer pc.ev.mu.Unlock()
	return pc.ev.queued
}
