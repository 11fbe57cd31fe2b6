package kv

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/vmarena/vmarena/arena"
)

// Model is the shape of a model's KV cache as a list of layer groups: each of its
// layers is in exactly one group, and each group has its own attention kind, tensors
// and element type. A model whose every layer is full attention of one shape is one
// group (Uniform). A server takes one from Preset or a preset function, or builds one
// for a model none covers, and puts it in Config.Model.
//
// A Model is pure description: Validate and Size allocate nothing, and the cache is
// meant to lay each group out in ranges of its own (so groups need no common page
// size and no padding) and to give back a window group's granules below FirstLive.
type Model struct {
	Name   string
	Layers int // the model's layers; every index in [0, Layers) is in one group
	Groups []Group
}

// MaxLayers is the most layers a Model may have (Validate refuses more): a bound a
// server reading a model's shape from a file may check first. The deepest models
// served have a few hundred; the bound keeps what a cache builds per layer (its
// tensors' places, a PerLayer sequence's ranges) small whatever a Config says.
const MaxLayers = 1 << 12

// Uniform returns the model of layers layers, each full attention with one K and one V
// tensor of kvHeads heads of headDim values of dt per token: one FullAttention group
// of layers 0 to layers-1, in order: the model to write for a dense transformer no
// preset names. Set the group's Scales to keep FP8 scales. The
// group of a model with fewer than 1 or more than MaxLayers layers lists none
// (Model.Validate refuses the model).
func Uniform(name string, layers, kvHeads, headDim int, dt arena.DType) Model {
	var ls []int
	if layers > 0 && layers <= MaxLayers {
		ls = make([]int, layers)
	}
	for i := range ls {
		ls[i] = i
	}
	return Model{Name: name, Layers: layers, Groups: []Group{{
		Kind: FullAttention, Layers: ls, KVHeads: kvHeads, HeadDim: headDim, DType: dt,
	}}}
}

// uniform reports whether m, a valid model, is one full-attention group of layers 0 to
// Layers-1 in order: the shape Uniform makes, whose one group's token size and blocks
// Size reports on their own and whose tier namespace is the one such a model has
// always had (TierNamespace).
func (m Model) uniform() bool {
	if len(m.Groups) != 1 || m.Groups[0].Kind != FullAttention {
		return false
	}
	for i, l := range m.Groups[0].Layers {
		if l != i {
			return false
		}
	}
	return true
}

// Validate reports, with an error matching ErrModel that says what, a model with
// no layers, more than MaxLayers or no groups, a group that is wrong on its own (an
// unknown kind, no layers, a window missing or larger than maxTokens, an MLA group
// with V, a recurrent group with tensors, a shape its element type can not hold), a
// layer index outside the model, a layer listed twice or in no group, or a token size
// that overflows. maxTokens is the cache's per-sequence maximum; 0 means none is
// given. New calls it; a server calls it itself on a model it built, before sizing it.
func (m Model) Validate(maxTokens int) error {
	if m.Layers <= 0 {
		return fmt.Errorf("%w: model %q has %d layers (must be positive)", ErrModel, m.Name, m.Layers)
	}
	if len(m.Groups) == 0 {
		return fmt.Errorf("%w: model %q has no layer groups", ErrModel, m.Name)
	}
	if maxTokens < 0 {
		return fmt.Errorf("%w: max tokens %d", ErrConfig, maxTokens)
	}
	if m.Layers > MaxLayers {
		return fmt.Errorf("%w: model %q has %d layers, more than MaxLayers (%d)", ErrModel, m.Name, m.Layers, MaxLayers)
	}
	owner := make([]int, m.Layers) // group index + 1 of each layer, 0 while unseen
	total := 0
	for i, g := range m.Groups {
		if err := g.validate(i, maxTokens); err != nil {
			return err
		}
		for _, l := range g.Layers {
			switch {
			case l < 0 || l >= m.Layers:
				return fmt.Errorf("%w: group %d lists layer %d of a %d-layer model", ErrModel, i, l, m.Layers)
			case owner[l] != 0:
				return fmt.Errorf("%w: layer %d is listed twice (groups %d and %d)", ErrModel, l, owner[l]-1, i)
			}
			owner[l] = i + 1
		}
		if bpt := g.BytesPerToken(); total > math.MaxInt32-bpt {
			return fmt.Errorf("%w: a token of model %q is too large", ErrModel, m.Name)
		}
		total += g.BytesPerToken()
	}
	if l := slices.Index(owner, 0); l >= 0 {
		return fmt.Errorf("%w: layer %d of model %q is in no group", ErrModel, l, m.Name)
	}
	return nil
}

// clone returns a copy of m that shares no slice with it.
func (m Model) clone() Model {
	m.Groups = slices.Clone(m.Groups)
	for i := range m.Groups {
		m.Groups[i].Layers = slices.Clone(m.Groups[i].Layers)
	}
	return m
}

// BytesPerToken returns the bytes one token adds across all groups, block scales
// included: the recurrent groups add none. It is the quick figure for a budget;
// Size adds what granules, blocks and windows make of it.
func (m Model) BytesPerToken() int {
	n := 0
	for _, g := range m.Groups {
		n += g.BytesPerToken()
	}
	return n
}

// Uniform returns m with its sliding-window and chunked-local groups made full
// attention: the cache a server holds when it keeps every token of every layer.
func (m Model) Uniform() Model {
	u := Model{Name: m.Name + " (full attention)", Layers: m.Layers, Groups: slices.Clone(m.Groups)}
	for i, g := range u.Groups {
		if g.Kind == SlidingWindow || g.Kind == ChunkedLocal {
			u.Groups[i].Kind, u.Groups[i].Window = FullAttention, 0
		}
	}
	return u
}

// byName returns the preset of all whose name is name (case-insensitive), or an error
// matching ErrUnknownModel that lists the names it knows.
func byName(all []Model, name string) (Model, error) {
	names := make([]string, 0, len(all))
	for _, m := range all {
		if strings.EqualFold(m.Name, name) {
			return m, nil
		}
		names = append(names, m.Name)
	}
	return Model{}, fmt.Errorf("%w %q (known: %s)", ErrUnknownModel, name, strings.Join(names, ", "))
}
