package main

import (
	"fmt"
	"iter"
	"sync"

	"github.com/vmarena/vmarena/kv"
)

// groupMeter reads what each layer group of a cache on a model of groups commits,
// and what a uniform full-attention cache of the same model (kv.Model.Uniform)
// would commit for the same sequences. kv reports a sequence's committed bytes as one
// figure; in the Blocked layout a group is one range cut into its own blocks, so a
// group of a sequence of n tokens whose first held token is h (Sequence.FirstHeld)
// commits the blocks from h's to n's: (ceil(n/BlockTokens) - h/BlockTokens) ×
// BlockStride. A recurrent group commits its states, rounded up to whole granules
// (kv.Model.Size's BlockBytes), once a sequence has a token. The replay's test checks
// that these add up to kv's Stats.Committed.
type groupMeter struct {
	model   kv.Model
	uniform kv.Config // the uniform cache, for Config.Size
	granule int
	first   []int        // a layer of each group, to read its strides and FirstHeld
	strides []kv.Strides // each group's blocks
	states  []int64      // each recurrent group's committed state per sequence; 0 for the others

	mu     sync.Mutex
	live   map[*kv.Sequence]struct{}
	prefix *kv.Sequence // the held system prompt every other live sequence starts on, or nil
}

// newGroupMeter returns the meter of c, a cache in the Blocked layout on m.
func newGroupMeter(c *kv.Cache, m kv.Model) (*groupMeter, error) {
	cfg := c.Config()
	if cfg.Layout != kv.Blocked {
		return nil, fmt.Errorf("the per-group figures need the %v layout, not %v", kv.Blocked, cfg.Layout)
	}
	gm := &groupMeter{model: m, granule: c.Granularity(), live: map[*kv.Sequence]struct{}{},
		uniform: kv.Config{Model: m.Uniform(), MaxTokens: cfg.MaxTokens, Layout: kv.Blocked, BlockTokens: cfg.BlockTokens}}
	sz, err := m.Size(gm.granule, cfg.BlockTokens, 1)
	if err != nil {
		return nil, err
	}
	for i, g := range m.Groups {
		st, err := c.LayerStrides(g.Layers[0])
		if err != nil {
			return nil, err
		}
		var state int64
		if g.Kind == kv.Recurrent {
			state = sz.Groups[i].Committed
		}
		gm.states = append(gm.states, state)
		if st.Group != i || (st.BlockTokens <= 0 && state == 0) {
			return nil, fmt.Errorf("layer %d: group %d with blocks of %d tokens, want group %d in blocks", g.Layers[0], st.Group, st.BlockTokens, i)
		}
		gm.first = append(gm.first, g.Layers[0])
		gm.strides = append(gm.strides, st)
	}
	return gm, nil
}

func (gm *groupMeter) add(q *kv.Sequence) {
	gm.mu.Lock()
	gm.live[q] = struct{}{}
	gm.mu.Unlock()
}

// setPrefix makes q the held system prompt (measured with the others), or forgets
// the one there is when q is nil.
func (gm *groupMeter) setPrefix(q *kv.Sequence) {
	gm.mu.Lock()
	defer gm.mu.Unlock()
	if q == nil {
		delete(gm.live, gm.prefix)
	} else {
		gm.live[q] = struct{}{}
	}
	gm.prefix = q
}

func (gm *groupMeter) remove(q *kv.Sequence) {
	gm.mu.Lock()
	delete(gm.live, q)
	gm.mu.Unlock()
}

// groupUse is one reading of a cache on layer groups: per group, what vmarena commits
// and what the uniform cache would; and the exact need of the live tokens (each
// window group's live window, every token of the full groups).
type groupUse struct {
	Committed, Uniform []int64
	Need               int64
}

// read measures the live sequences now.
func (gm *groupMeter) read() (groupUse, error) {
	gm.mu.Lock()
	defer gm.mu.Unlock()
	u := groupUse{Committed: make([]int64, len(gm.first)), Uniform: make([]int64, len(gm.first))}
	for q := range gm.live {
		n := q.Len()
		if n == 0 {
			continue
		}
		for i, l := range gm.first {
			if gm.states[i] > 0 {
				u.Committed[i] += gm.states[i]
				continue
			}
			st := gm.strides[i]
			blocks := (n+st.BlockTokens-1)/st.BlockTokens - q.FirstHeld(l)/st.BlockTokens
			u.Committed[i] += int64(blocks) * int64(st.BlockStride)
		}
		us, err := gm.uniform.Size(gm.granule, n)
		if err != nil {
			return groupUse{}, err
		}
		for i, g := range us.Groups {
			u.Uniform[i] += g.Committed
		}
	}
	u.Need = gm.need()
	return u, nil
}

// need returns the bytes of the live tokens, gm.mu held: each group's tokens from its
// FirstLive on in every sequence, and the system prompt's once; a recurrent group's
// state in every sequence with a token, the prompt's own included. A sequence on the
// prompt holds its own tokens past it; of the prompt's, a group needs those from the
// first that the prompt's own next step or any sequence on it still reads.
func (gm *groupMeter) need() int64 {
	var need int64
	p := 0
	if gm.prefix != nil {
		p = gm.prefix.Len()
	}
	for _, g := range gm.model.Groups {
		if g.Kind == kv.Recurrent {
			for q := range gm.live {
				if q.Len() > 0 {
					need += int64(len(g.Layers)) * int64(g.StateBytes)
				}
			}
			continue
		}
		need += windowNeed(g, int64(g.BytesPerToken()), p, gm.prefix != nil, func(yield func(int) bool) {
			for q := range gm.live {
				if q != gm.prefix && !yield(q.Len()) {
					return
				}
			}
		})
	}
	return need
}

// windowNeed returns the bytes group g, of bpt bytes a token, needs for live sequences
// of the lengths lens yields: each one's tokens from g's FirstLive on, and, where they
// start on a shared prompt of p tokens (shared), the prompt's tokens once, from the
// first that the prompt's own next step or any sequence on it still reads.
func windowNeed(g kv.Group, bpt int64, p int, shared bool, lens iter.Seq[int]) int64 {
	var need int64
	from := g.FirstLive(p) // of the prompt's tokens, the first one read
	for n := range lens {
		own := g.FirstLive(n)
		if shared {
			from, own = min(from, own), max(own, p)
		}
		need += int64(n-own) * bpt
	}
	if shared {
		need += int64(p-from) * bpt
	}
	return need
}
