package kv

import (
	"fmt"
	"math"
	"strings"
)

// A cache on a Model (Config.Model) lays each layer group out on ranges of its own,
// as a one-group cache lays out its geometry: Blocked, one range per group cut into
// the group's own blocks; PerLayer, one range per tensor of the group. The groups
// need no common page size and no padding, since each one's blocks are whole
// granules of the one pool. A sequence's ranges are the groups' ranges, group after
// group (group.first says where each group's start).

// group is where a cache puts one layer group of a sequence: its shape (the layout
// arithmetic of its ranges), the group it lays out, and where its ranges start among
// a sequence's.
type group struct {
	shape
	spec  Group
	first int // index of the group's first range among a sequence's ranges
	bpt   int // spec.BytesPerToken()
}

// fullLike reports whether g keeps every token in one layout as a full group does:
// full attention, or MLA (one latent per layer, addressed as K).
func (g *group) fullLike() bool {
	return g.spec.Kind == FullAttention || g.spec.Kind == MLALatent
}

// windowed reports whether g gives back the tokens no later step reads.
func (g *group) windowed() bool {
	return g.spec.Kind == SlidingWindow || g.spec.Kind == ChunkedLocal
}

// ranges returns g's ranges among a sequence's ranges bufs.
func (g *group) ranges(bufs []buffer) []buffer { return bufs[g.first : g.first+g.nbuf] }

// used returns the bytes of what a sequence of n tokens whose first held token is
// held keeps in g: its held tokens, or its state.
func (g *group) used(n, held int) int64 {
	if g.state > 0 {
		return int64(g.extent(n))
	}
	return int64(n-held) * int64(g.bpt)
}

// layerRef is where a model's layer lies: its group and its index among the group's
// layers, and where each of its tensors lies (tensors, by Kind), worked out once at
// New so that the one-token path finds a tensor with no division and no search.
type layerRef struct {
	group, local int
	tensors      [2]tensorRef
}

// tensorRef is where a layer's tensor of one kind lies: the index of its range among a
// sequence's ranges and the offset of its token 0 there; ok is false where the layer
// has no tensor of that kind (the V of an MLA layer, a recurrent layer).
type tensorRef struct {
	buf, off int
	ok       bool
}

// newGroups returns the groups of a cache on m (which must be valid) and where each
// of m's layers lies.
func newGroups(m Model, layout Layout, granule, blockTokens, runTokens, maxTokens int) ([]group, []layerRef, error) {
	groups := make([]group, len(m.Groups))
	layers := make([]layerRef, m.Layers)
	first := 0
	var reserved int64 // a sequence's address space, which Size adds up in an int64
	for i, spec := range m.Groups {
		bt, rt := blockTokens, runTokens
		if spec.Kind == Recurrent {
			bt, rt = 0, 0 // a state has no blocks
		}
		sh, err := newGroupShape(spec, layout, granule, bt, rt, maxTokens)
		if err != nil {
			return nil, nil, fmt.Errorf("group %d (%v): %w", i, spec.Kind, err)
		}
		r := int64(sh.nbuf) * int64(sh.capac) // newGroupShape checked that it fits
		if reserved > math.MaxInt64-r {
			return nil, nil, fmt.Errorf("%w: %d tokens of model %q overflow a sequence's address space", ErrConfig, maxTokens, m.Name)
		}
		reserved += r
		groups[i] = group{shape: sh, spec: spec, first: first, bpt: spec.BytesPerToken()}
		first += sh.nbuf
		for j, l := range spec.Layers {
			r := layerRef{group: i, local: j}
			for _, kind := range []Kind{K, V} {
				if b, off, ok := sh.tensor(j, kind); ok {
					r.tensors[kind] = tensorRef{buf: groups[i].first + b, off: off, ok: true}
				}
			}
			layers[l] = r
		}
	}
	return groups, layers, nil
}

// model returns cfg's Model once Model.Validate takes it for MaxTokens.
func (cfg Config) model() (Model, error) {
	if err := cfg.Model.Validate(cfg.MaxTokens); err != nil {
		return Model{}, err
	}
	return cfg.Model, nil
}

// where returns where layer's tensor of kind lies: the index of its group, the index
// of its range among a sequence's ranges and the offset of its token 0 there. ok is
// false for a layer the model does not have, a V of an MLA group, or a recurrent
// layer.
func (c *Cache) where(layer int, kind Kind) (gi, buf, off int, ok bool) {
	if uint(layer) >= uint(len(c.layers)) || kind > V {
		return 0, 0, 0, false
	}
	r := &c.layers[layer]
	t := r.tensors[kind]
	return r.group, t.buf, t.off, t.ok
}

// noTensor returns the error for a layer's tensor that does not exist.
func (c *Cache) noTensor(layer int, kind Kind) error {
	if uint(layer) < uint(len(c.layers)) {
		switch g := &c.groups[c.layers[layer].group]; g.spec.Kind {
		case MLALatent:
			return fmt.Errorf("%w: layer %d is in an MLA group, which keeps one latent per layer (K) and no V", ErrRange, layer)
		case Recurrent:
			return fmt.Errorf("%w: layer %d is recurrent: it has a state (ReadState, WriteState), no tensors", ErrRange, layer)
		}
	}
	return fmt.Errorf("%w: layer %d %v of %d layers", ErrRange, layer, kind, len(c.layers))
}

// groupKinds describes m's groups for an error: "2 groups (sliding-window, full)".
func groupKinds(m Model) string {
	kinds := make([]string, len(m.Groups))
	for i, g := range m.Groups {
		kinds[i] = g.Kind.String()
	}
	return fmt.Sprintf("%d groups (%s)", len(m.Groups), strings.Join(kinds, ", "))
}
