package main

import (
	"bytes"
	"fmt"
	"slices"
	"strings"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// layerPlan is what the replay keeps in one layer of the model: its per-token tensors
// (K and V of tokenBytes each; the latent alone, as K, in an MLA layer), or, in a
// recurrent layer, a state of stateBytes per sequence. The state is written whole at
// prefill, as the state after the prompt; a decode step's update of it is the
// kernel's, in place, not a copy through the memory layer, so the replay does not
// rewrite it per token. group is the layer's group, whose FirstLive says which tokens
// a later step still reads.
type layerPlan struct {
	kinds      []baseline.Kind
	tokenBytes int
	stateBytes int
	group      kv.Group
}

var (
	keyValue = []baseline.Kind{baseline.K, baseline.V}
	latent   = []baseline.Kind{baseline.K}
)

// planLayers returns, layer by layer, what the replay writes into m: nil for a model
// of nil, whose every layer keeps K and V of one shape (the Workload's TokenBytes).
func planLayers(m *kv.Model) []layerPlan {
	if m == nil {
		return nil
	}
	plan := make([]layerPlan, m.Layers)
	for _, g := range m.Groups {
		p := layerPlan{tokenBytes: g.TokenBytes(), stateBytes: g.StateBytes, group: g}
		switch g.Kind {
		case kv.MLALatent:
			p.kinds = latent
		case kv.Recurrent:
		default:
			p.kinds = keyValue
		}
		for _, l := range g.Layers {
			plan[l] = p
		}
	}
	return plan
}

// stateHolder is a sequence with recurrent layers (a vmarena cache on a model with a
// recurrent group).
type stateHolder interface {
	writeState(layer int, src []byte) error
	readState(layer int, dst []byte) error
}

// writeStates writes src's first stateBytes into every recurrent layer of q.
func writeStates(q baseline.Sequence, plan []layerPlan, src []byte) error {
	for l, p := range plan {
		if p.stateBytes == 0 {
			continue
		}
		sh, ok := q.(stateHolder)
		if !ok {
			return fmt.Errorf("layer %d is recurrent, and a %T keeps no state", l, q)
		}
		if err := sh.writeState(l, src[:p.stateBytes]); err != nil {
			return fmt.Errorf("layer %d's state: %w", l, err)
		}
	}
	return nil
}

// tokenReader is a sequence whose tokens can be read back (every strategy's).
type tokenReader interface {
	ReadToken(layer int, v baseline.Kind, token int, dst []byte) error
}

// checkSequence reads back every live token of q in every layer (a window layer's from
// its group's FirstLive on: the tokens a later step reads), and every recurrent
// state, and compares them with what the replay wrote: prompt bytes below
// w.SystemPrompt tokens and fill from there on, fill in the states. buf is scratch of
// at least a state's or a token's bytes. It returns how many tokens' K or V (or MLA
// latents) and states it compared, in all layers.
func checkSequence(q baseline.Sequence, w Workload, prompt, fill, buf []byte) (Verified, error) {
	var v Verified
	plan := w.Plan
	if plan == nil {
		plan = make([]layerPlan, w.Layers)
		for l := range plan {
			plan[l] = layerPlan{kinds: keyValue, tokenBytes: w.TokenBytes}
		}
	}
	rd, ok := q.(tokenReader)
	if !ok {
		return v, fmt.Errorf("a %T can not be read back", q)
	}
	for l, p := range plan {
		if p.stateBytes > 0 {
			sh, ok := q.(stateHolder)
			if !ok {
				return v, fmt.Errorf("layer %d is recurrent, and a %T keeps no state", l, q)
			}
			if err := sh.readState(l, buf[:p.stateBytes]); err != nil {
				return v, fmt.Errorf("layer %d's state: %w", l, err)
			}
			if !bytes.Equal(buf[:p.stateBytes], fill[:p.stateBytes]) {
				return v, fmt.Errorf("layer %d's state: %w", l, errWrongBytes)
			}
			v.States++
		}
		for t := p.group.FirstLive(q.Len()); t < q.Len(); t++ {
			want := fill
			if t < w.SystemPrompt {
				want = prompt
			}
			for _, k := range p.kinds {
				got := buf[:p.tokenBytes]
				if err := rd.ReadToken(l, k, t, got); err != nil {
					return v, fmt.Errorf("token %d of layer %d: %w", t, l, err)
				}
				if !bytes.Equal(got, want[:p.tokenBytes]) {
					return v, fmt.Errorf("token %d of layer %d (%s): %w", t, l, [2]string{"K", "V"}[k], errWrongBytes)
				}
				v.Reads++
			}
		}
	}
	v.Sequences, v.Tokens = 1, int64(q.Len())
	return v, nil
}

// Verified counts what -verify read back and found as written.
type Verified struct {
	Sequences int64 // sequences read back before they closed
	Tokens    int64 // their tokens
	Reads     int64 // token tensors compared: a token's K or V (or latent) in one layer
	States    int64 // recurrent states compared
}

// add adds o's counts to v.
func (v *Verified) add(o Verified) {
	v.Sequences += o.Sequences
	v.Tokens += o.Tokens
	v.Reads += o.Reads
	v.States += o.States
}

// planBytes returns the bytes a layer plan needs for one fill buffer: the largest
// token or state.
func planBytes(plan []layerPlan, tokenBytes int) int {
	n := tokenBytes
	for _, p := range plan {
		n = max(n, p.tokenBytes, p.stateBytes)
	}
	return n
}

// kvDTypes are -kv-dtype's names and the element types they store the KV in.
var kvDTypes = []struct {
	name string
	dt   arena.DType
}{
	{"fp16", arena.Float16},
	{"bf16", arena.BFloat16},
	{"fp8", arena.Float8E4M3},
	{"fp8-e5m2", arena.Float8E5M2},
	{"q8_0", arena.Q8_0},
}

// kvDTypeDefault is -kv-dtype's default: the preset's own element type.
const kvDTypeDefault = "model"

// parseKVDType returns the element type -kv-dtype names, or 0 for the model's own.
func parseKVDType(name string) (arena.DType, error) {
	if name == kvDTypeDefault {
		return 0, nil
	}
	names := []string{kvDTypeDefault}
	for _, d := range kvDTypes {
		if d.name == name {
			return d.dt, nil
		}
		names = append(names, d.name)
	}
	return 0, fmt.Errorf("-kv-dtype %q: want one of %s", name, strings.Join(names, ", "))
}

// withDType returns g and m with their KV stored in dt (their own where dt is 0): every
// group's tensors but the recurrent states, whose element type the model's state
// update fixes. It fails where a head of the model does not fit whole blocks of dt
// (Q8_0's 32 values).
func withDType(g kv.Model, m *kv.Model, dt arena.DType) (kv.Model, *kv.Model, error) {
	if dt == 0 {
		return g, m, nil
	}
	g.Groups = slices.Clone(g.Groups) // the caller's model is the caller's
	g.Groups[0].DType = dt
	if err := g.Validate(0); err != nil {
		return g, m, fmt.Errorf("-kv-dtype %v with %s: %w", dt, g.Name, err)
	}
	if m == nil {
		return g, nil, nil
	}
	out := *m
	out.Groups = append([]kv.Group(nil), m.Groups...)
	for i := range out.Groups {
		if out.Groups[i].Kind != kv.Recurrent {
			out.Groups[i].DType = dt
		}
	}
	if err := out.Validate(0); err != nil {
		return g, m, fmt.Errorf("-kv-dtype %v with %s: %w", dt, m.Name, err)
	}
	return g, &out, nil
}

// withShrink returns g and m with every group's K/V heads times head dim divided by n
// (-kv-shrink; 1: as they are): the same groups, windows and layers, and, on a
// granule n times smaller, the same blocks in tokens, at 1/n of the bytes, so that
// a replay whose tiers would hold more than the machine has keeps its hit rates (a
// hit rate depends on the budget over the ideal cache and on the blocks, not on the
// bytes per token). The heads go first, then the head dim; a shape that n does not
// divide is refused. Their names say so (a tier's values are another model's).
func withShrink(g kv.Model, m *kv.Model, n int) (kv.Model, *kv.Model, error) {
	if n == 1 {
		return g, m, nil
	}
	if n < 1 || n&(n-1) != 0 {
		return g, m, fmt.Errorf("-kv-shrink %d: want a power of two", n)
	}
	shrink := func(in kv.Model) (kv.Model, error) {
		out := in
		out.Name = fmt.Sprintf("%s/%d", in.Name, n)
		out.Groups = slices.Clone(in.Groups)
		for i := range out.Groups {
			gr := &out.Groups[i]
			if gr.Kind == kv.Recurrent {
				continue
			}
			left := n
			for left > 1 && gr.KVHeads%2 == 0 {
				gr.KVHeads, left = gr.KVHeads/2, left/2
			}
			if gr.HeadDim%left != 0 {
				return in, fmt.Errorf("-kv-shrink %d: %s group %d (%d K/V heads × head dim %d) is not divided by it", n, in.Name, i, in.Groups[i].KVHeads, in.Groups[i].HeadDim)
			}
			gr.HeadDim /= left
		}
		if err := out.Validate(0); err != nil {
			return in, fmt.Errorf("-kv-shrink %d with %s: %w", n, in.Name, err)
		}
		return out, nil
	}
	sg, err := shrink(g)
	if err != nil || m == nil {
		return sg, nil, err
	}
	sm, err := shrink(*m)
	if err != nil {
		return g, m, err
	}
	return sg, &sm, nil
}
