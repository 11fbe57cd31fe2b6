package kv

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/vmarena/vmarena/arena"
)

// ScaleMode says whether a cache of FP8 elements keeps dequantization scales, and how
// many: a stored value x stands for x.Float32() × scale, so a kernel that writes K or
// V divides by the scale before narrowing and multiplies after widening. vLLM's FP8 KV
// cache keeps such a scale per layer's K and V ("k_scale", "v_scale"). A server sets
// it in Group.Scales when its kernels quantize K and V to FP8 with scales.
type ScaleMode uint8

const (
	// NoScales, the zero value, keeps none: values are stored as they are. Every
	// element type but FP8 has this mode only.
	NoScales ScaleMode = iota
	// ScalePerTensor keeps one float32 per layer's K or V tensor: for a checkpoint
	// with one k_scale and one v_scale per layer.
	ScalePerTensor
	// ScalePerHead keeps one float32 per KV head of each layer's K or V tensor: for
	// kernels that quantize each head with a scale of its own.
	ScalePerHead
)

// String returns the mode's name as logs print it ("per-head").
func (m ScaleMode) String() string {
	switch m {
	case NoScales:
		return "none"
	case ScalePerTensor:
		return "per-tensor"
	case ScalePerHead:
		return "per-head"
	}
	return fmt.Sprintf("ScaleMode(%d)", uint8(m))
}

// validate reports a scale mode that g's element type can not have.
func (m ScaleMode) validate(dt arena.DType) error {
	switch {
	case m > ScalePerHead:
		return fmt.Errorf("%w: scale mode %v", ErrModel, m)
	case m != NoScales && dt != arena.Float8E4M3 && dt != arena.Float8E5M2:
		return fmt.Errorf("%w: %v scales are for FP8 element types, not %v", ErrModel, m, dt)
	}
	return nil
}

// scalesPerTensor returns the scales of each of g's tensors: 1, KVHeads, or 0
// without scales.
func (g Group) scalesPerTensor() int {
	switch g.Scales {
	case ScalePerTensor:
		return 1
	case ScalePerHead:
		return g.KVHeads
	}
	return 0
}

// scales is where a cache keeps its FP8 scales: one range of its backing, committed
// at New for the cache's life, float32 in the machine's byte order (little-endian on
// every supported platform). Each layer group that asks for scales has its own run
// of them, group after group in the model's order: scalesPerTensor of them for each
// tensor of the group, its layers in the group's order, each layer's kinds in order,
// row-major, so that a layer of one tensor (an MLA latent) needs nothing of its own.
type scales struct {
	buf    buffer        // nil without scales
	groups []groupScales // one per layer group; per 0 for a group without scales
}

// groupScales is where one layer group's scales lie in the scales' range.
type groupScales struct {
	off int // bytes from the range's start
	per int // scales per tensor; 0: the group keeps none
}

// newScales reserves and commits c's scales and sets every one to 1.
func (c *Cache) newScales() error {
	gs := make([]groupScales, len(c.groups))
	n := 0
	for i := range c.groups {
		g := &c.groups[i]
		per := g.spec.scalesPerTensor()
		gs[i] = groupScales{off: n, per: per}
		n += len(g.spec.Layers) * len(g.kinds) * per * 4
	}
	if n == 0 {
		return nil
	}
	capac := (n + c.gran - 1) / c.gran * c.gran
	buf, err := c.st.newBuffer(capac, c.cfg.Authority)
	if err != nil {
		return err
	}
	// NB: commit before making the ones: the budget bounds n, and the heap copy
	// must not be made for scales the budget refuses.
	if err = buf.Resize(n); err == nil {
		ones := make([]byte, n)
		for i := 0; i < n; i += 4 {
			binary.NativeEndian.PutUint32(ones[i:], math.Float32bits(1))
		}
		err = buf.writeAt(0, ones)
	}
	if err != nil {
		return errors.Join(err, releaseError(buf.Close()))
	}
	c.scales = scales{buf: buf, groups: gs}
	return nil
}

// isClosed reports whether Close has closed c.
func (c *Cache) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// closeScales gives back the scales' range: at Close, when nothing can read them.
func (c *Cache) closeScales() error {
	if c.scales.buf == nil {
		return nil
	}
	// NB: buf stays set: Scales and the others test c.closed first, and New alone
	// writes the field, so no reader races with Close.
	return releaseError(c.scales.buf.Close())
}

// Scales returns the cache's FP8 scales as a float32 tensor of [Layers, 2, H], K
// before V (a layer's tensors in order), H = 1 per tensor or KVHeads per head,
// row-major: scale (layer, kind, head) is element [layer, kind, head % H], at a base
// address that never changes while the cache is open. On a device the tensor gives
// only that address (for a kernel); on the host its elements may also be read (write
// them with SetScales, which checks them).
// A cache without scales fails with ErrScale. The tensor is valid until Close.
// A server hands it to the kernels of a one-group model, which read the scales in place.
//
// It is GroupScales(0) on a model of one group, and fails with ErrScale on a model of
// more: each group's scales are then GroupScales'.
func (c *Cache) Scales() (arena.Tensor[float32], error) {
	if len(c.groups) > 1 && !c.isClosed() {
		return arena.Tensor[float32]{}, fmt.Errorf("%w: model %q has %d layer groups, each with scales of its own (GroupScales)", ErrScale, c.cfg.Model.Name, len(c.groups))
	}
	return c.GroupScales(0)
}

// GroupScales returns the FP8 scales of the cache's layer group gi (an index into
// Model.Groups; 0 for a one-group model) as a float32 tensor of [L, T, H]: L the group's
// layers in the group's order (Group.Layers), T its tensors per layer (K before V;
// an MLA group's latent alone, as K), H = 1 per tensor or KVHeads per head,
// row-major, at a base address that never changes while the cache is open, as
// Scales says. A group without scales (a recurrent one, one of another element
// type, or one that asks for none) fails with ErrScale, and an index outside the
// model with ErrRange. The tensor is valid until Close. It is Scales for a model of
// layer groups: a server hands each group's to that group's kernels. Every group's scales lie in
// the cache's one range of scales (of its own backing, from New to Close), group
// after group.
func (c *Cache) GroupScales(gi int) (arena.Tensor[float32], error) {
	if c.isClosed() {
		return arena.Tensor[float32]{}, ErrClosed
	}
	if uint(gi) >= uint(len(c.groups)) {
		return arena.Tensor[float32]{}, fmt.Errorf("%w: layer group %d of %d", ErrRange, gi, len(c.groups))
	}
	gs, err := c.groupScales(gi)
	if err != nil {
		return arena.Tensor[float32]{}, err
	}
	g := &c.groups[gi]
	return arena.NewTensor[float32](c.scales.buf, gs.off, len(g.spec.Layers), len(g.kinds), gs.per)
}

// groupScales returns where group gi's scales lie, or ErrScale when it keeps none.
func (c *Cache) groupScales(gi int) (groupScales, error) {
	if c.scales.buf == nil || c.scales.groups[gi].per == 0 {
		if c.cfg.Model.uniform() {
			return groupScales{}, fmt.Errorf("%w: model %q keeps none (Scales %v)", ErrScale, c.cfg.Model.Name, c.cfg.Model.Groups[0].Scales)
		}
		g := c.groups[gi].spec
		return groupScales{}, fmt.Errorf("%w: layer group %d (%v, %v) keeps none (Scales %v)", ErrScale, gi, g.Kind, g.DType, g.Scales)
	}
	return c.scales.groups[gi], nil
}

// SetScales sets the scales of layer's K or V tensor to src: one value per tensor, or
// KVHeads per head; layer is the model's layer index, on a Model too. Each must be
// finite and positive. A server calls it once the model's scales are known (a
// checkpoint's k_scale and v_scale), before the kernels read them. It works on any
// backing (through the backing's copier on a device). It must not run while a kernel or a reader uses that tensor's scales; for
// different tensors it may run concurrently.
func (c *Cache) SetScales(layer int, kind Kind, src []float32) error {
	off, err := c.scaleRange(layer, kind, len(src))
	if err != nil {
		return err
	}
	p := make([]byte, 4*len(src))
	for i, v := range src {
		if !(v > 0 && v <= math.MaxFloat32) {
			return fmt.Errorf("%w: scale %d of layer %d %v is %v (must be finite and positive)", ErrScale, i, layer, kind, v)
		}
		binary.NativeEndian.PutUint32(p[4*i:], math.Float32bits(v))
	}
	return c.scales.buf.writeAt(off, p)
}

// ReadScales copies the scales of layer's K or V tensor into dst, which must hold one
// value per tensor, or KVHeads per head: to check or log them (kernels read them in
// place, through Scales or GroupScales). It works on any backing.
func (c *Cache) ReadScales(layer int, kind Kind, dst []float32) error {
	off, err := c.scaleRange(layer, kind, len(dst))
	if err != nil {
		return err
	}
	p := make([]byte, 4*len(dst))
	if err := c.scales.buf.readAt(off, p); err != nil {
		return err
	}
	for i := range dst {
		dst[i] = math.Float32frombits(binary.NativeEndian.Uint32(p[4*i:]))
	}
	return nil
}

// scaleRange returns the byte offset of the n scales of layer's K or V tensor.
func (c *Cache) scaleRange(layer int, kind Kind, n int) (int, error) {
	if c.isClosed() {
		return 0, ErrClosed
	}
	if uint(layer) >= uint(len(c.layers)) {
		if _, err := c.groupScales(0); err != nil && len(c.groups) == 1 {
			return 0, err // a one-group cache without scales says so first, as ever
		}
		return 0, c.noTensor(layer, kind)
	}
	r := c.layers[layer]
	g := &c.groups[r.group]
	i, ok := g.tensorIndex(r.local, kind)
	if !ok && len(c.groups) > 1 {
		return 0, c.noTensor(layer, kind) // a recurrent layer, an MLA layer's V
	}
	gs, err := c.groupScales(r.group)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, c.noTensor(layer, kind)
	}
	if n != gs.per {
		return 0, fmt.Errorf("%w: %d scales for a tensor that has %d (%v)", ErrScale, n, gs.per, g.spec.Scales)
	}
	return gs.off + i*gs.per*4, nil
}
