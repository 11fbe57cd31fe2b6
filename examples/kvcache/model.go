package main

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/vmarena/vmarena/kv"
)

// lookupModel resolves -model: one of kv.Presets. For a model of one full-attention
// group it returns that model and a nil model of groups, which every strategy runs.
// For any other model (window groups, an MLA latent, a recurrent state, groups of
// different shapes) it returns the model itself as the second result, whose every
// group the replay writes in its own shape (planLayers), and as the first a uniform
// model of its layers in the shape of its largest per-token tensor (kv.Uniform), which
// names the model in the report. An unknown name lists every known one.
func lookupModel(name string) (kv.Model, *kv.Model, error) {
	m, err := kv.Preset(name)
	if err != nil {
		if errors.Is(err, kv.ErrUnknownModel) {
			return kv.Model{}, nil, fmt.Errorf("-model: %w %q (known: %s)", kv.ErrUnknownModel, name, modelNames())
		}
		return kv.Model{}, nil, fmt.Errorf("-model %s: %w", name, err)
	}
	largest := -1
	for i, gr := range m.Groups {
		if gr.Kind != kv.Recurrent && (largest < 0 || gr.TokenBytes() > m.Groups[largest].TokenBytes()) {
			largest = i
		}
	}
	if largest < 0 {
		return kv.Model{}, nil, fmt.Errorf("-model %s: every group is recurrent: the replay needs tokens to write", m.Name)
	}
	if len(m.Groups) == 1 && m.Groups[0].Kind == kv.FullAttention {
		return m, nil, nil // one full-attention group: every strategy models it
	}
	first := m.Groups[largest]
	g := kv.Uniform(m.Name, m.Layers, first.KVHeads, first.HeadDim, first.DType)
	g.Groups[0].Scales = first.Scales
	return g, &m, nil
}

// modelNames lists -model's names.
func modelNames() string {
	var names []string
	for _, m := range kv.Presets() {
		names = append(names, m.Name)
	}
	return strings.Join(names, ", ")
}

// groupsOnly checks what the flags ask of a model of layer groups, where kv and the
// baselines can do less: eager and append model full attention only, paged full
// attention and sliding windows of one token size (pagedWindows), and kv's prefix
// cache keeps tiers beside window groups, and checkpoints of their states beside
// recurrent groups (checkpoints.go), which go down into the tiers too. A flag left at
// its default is turned off, and said so in notes; a flag set to what can not run is
// refused with an error naming the model and what refused it.
func (c *config) groupsOnly(m *kv.Model, names []string) ([]string, []string, error) {
	kinds := groupKinds(*m)
	var notes []string
	if c.prefix && hasRecurrent(m) {
		notes = append(notes, fmt.Sprintf("the prefill records the recurrent states at each %d-token block boundary (kv.Sequence.Checkpoint), where a hit may start; %s replays the full-attention layers alone at the same budget, for the ratio of hit rates", MooncakeBlockTokens, nameFullLayers))
	}
	var kept []string
	for _, n := range names {
		if base, _ := splitAhead(n); slices.Contains(groupStrategies(c.prefix, m), base) || c.prefix && base == namePrefixTiers {
			kept = append(kept, n)
			continue
		}
		if c.set["strategies"] {
			return nil, nil, fmt.Errorf("-model %s (%s): strategy %s models full attention only, and would hold every token of the window layers; run -strategies %s", m.Name, kinds, n, strings.Join(groupStrategies(c.prefix, m), ","))
		}
	}
	paged := slices.Contains(kept, namePaged)
	switch {
	case paged && len(kept) < len(names):
		notes = append(notes, "eager and append model full attention only: vmarena and paged run, paged with a block table per layer group that gives back a window group's blocks behind the window (vLLM's hybrid KV cache manager); the uniform full-attention cache of the same model is computed (kv.Model.Uniform)")
	case paged:
		notes = append(notes, "paged keeps a block table per layer group and gives back a window group's blocks behind the window (vLLM's hybrid KV cache manager)")
	case len(kept) < len(names):
		notes = append(notes, "the baselines model full attention only: vmarena alone runs; the uniform full-attention cache of the same model is computed (kv.Model.Uniform)")
	}
	if len(kept) == 0 {
		return nil, nil, fmt.Errorf("-model %s (%s): -strategies %s: none of them can run on layer groups (only %s)", m.Name, kinds, c.strategies, strings.Join(groupStrategies(c.prefix, m), ", "))
	}
	if c.system > 0 {
		// Each clause only where it applies: a recurrent group, a backing that can not share.
		n := "the system prompt is a sequence of its own that every request forks from (ForkAt works per group"
		if slices.ContainsFunc(m.Groups, func(g kv.Group) bool { return g.Kind == kv.Recurrent }) {
			n += " and copies the recurrent state, which kv's Freeze refuses"
		}
		n += ")"
		if c.backing == "private" {
			n += ", copied: the private backing can not share granules"
		}
		notes = append(notes, n)
	}
	if c.layout != kv.Blocked.String() {
		return nil, nil, fmt.Errorf("-model %s (%s): -layout %s: the per-group figures read the Blocked layout's blocks; use -layout %s", m.Name, kinds, c.layout, kv.Blocked)
	}
	return kept, notes, nil
}

// groupStrategies returns the strategies that run on the model of layer groups m: in
// the prefix-cache replay (prefix) or the plain one, where paged runs too if it can
// model m (pagedWindows).
func groupStrategies(prefix bool, m *kv.Model) []string {
	if prefix {
		return []string{namePrefixOn, namePrefixOff}
	}
	if _, ok := pagedWindows(m); ok {
		return []string{nameCache, namePaged}
	}
	return []string{nameCache}
}

// pagedWindows returns, layer by layer, the sliding window of m's layers (0: full
// attention) for the paged baseline (baseline.PagedOptions.Windows), and false where
// the paged baseline can not model m: a group neither full attention nor a sliding
// window (chunked-local, an MLA latent, a recurrent state), or groups whose tokens
// differ in size (its blocks are of one size, its shape of one token size).
func pagedWindows(m *kv.Model) ([]int, bool) {
	ws := make([]int, m.Layers)
	for _, g := range m.Groups {
		switch {
		case g.Kind != kv.FullAttention && g.Kind != kv.SlidingWindow:
			return nil, false
		case g.TokenBytes() != m.Groups[0].TokenBytes():
			return nil, false
		}
		for _, l := range g.Layers {
			if g.Kind == kv.SlidingWindow {
				ws[l] = g.Window
			}
		}
	}
	return ws, true
}

// groupKinds describes m's groups: "2 groups: sliding-window 128 ×12, full ×12".
func groupKinds(m kv.Model) string {
	parts := make([]string, len(m.Groups))
	for i, g := range m.Groups {
		parts[i] = groupName(g)
	}
	return fmt.Sprintf("%d groups: %s", len(m.Groups), strings.Join(parts, ", "))
}

// groupName names one group for the report and the plot: "sliding-window 128 ×12".
func groupName(g kv.Group) string {
	if g.Window > 0 {
		return fmt.Sprintf("%v %d ×%d", g.Kind, g.Window, len(g.Layers))
	}
	return fmt.Sprintf("%v ×%d", g.Kind, len(g.Layers))
}
