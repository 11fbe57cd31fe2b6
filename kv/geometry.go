package kv

import (
	"fmt"
	"math"
	"strings"

	"github.com/vmarena/vmarena/arena"
)

// Geometry is the shape of a model's KV cache: per layer, one K and one V tensor of
// KVHeads × HeadDim elements per token.
type Geometry struct {
	Name    string
	Layers  int
	KVHeads int
	HeadDim int
	DType   arena.DType
	// Scales asks a cache of FP8 elements to keep dequantization scales, per tensor
	// or per KV head (Cache.Scales); the zero value keeps none.
	Scales ScaleMode
}

// MaxLayers is the most layers a Geometry or a Model may have. The deepest models
// served have a few hundred; the bound keeps what a cache builds per layer (its
// tensors' places, a PerLayer sequence's ranges) small whatever a Config says.
const MaxLayers = 1 << 12

// Presets of real models (and a tiny one for tests), fp16.
var (
	Llama3_8B  = Geometry{Name: "llama3-8b", Layers: 32, KVHeads: 8, HeadDim: 128, DType: arena.Float16}
	Llama3_70B = Geometry{Name: "llama3-70b", Layers: 80, KVHeads: 8, HeadDim: 128, DType: arena.Float16}
	Qwen25_7B  = Geometry{Name: "qwen2.5-7b", Layers: 28, KVHeads: 4, HeadDim: 128, DType: arena.Float16}
	// Small models, for replaying long prompts within a small machine.
	Llama32_1B = Geometry{Name: "llama3.2-1b", Layers: 16, KVHeads: 8, HeadDim: 64, DType: arena.Float16}
	Qwen25_05B = Geometry{Name: "qwen2.5-0.5b", Layers: 24, KVHeads: 2, HeadDim: 64, DType: arena.Float16}
	Tiny       = Geometry{Name: "tiny", Layers: 2, KVHeads: 2, HeadDim: 16, DType: arena.Float16}
)

// Presets returns the preset geometries.
func Presets() []Geometry {
	return []Geometry{Llama3_8B, Llama3_70B, Qwen25_7B, Llama32_1B, Qwen25_05B, Tiny}
}

// Preset returns the preset named name (case-insensitive), or an error matching
// ErrUnknownModel that lists the names it knows.
func Preset(name string) (Geometry, error) {
	return byName(Presets(), name, func(g Geometry) string { return g.Name })
}

// byName returns the preset of all whose name is name (case-insensitive), or an error
// matching ErrUnknownModel that lists the names it knows.
func byName[T any](all []T, name string, nameOf func(T) string) (T, error) {
	names := make([]string, 0, len(all))
	for _, p := range all {
		if strings.EqualFold(nameOf(p), name) {
			return p, nil
		}
		names = append(names, nameOf(p))
	}
	var zero T
	return zero, fmt.Errorf("%w %q (known: %s)", ErrUnknownModel, name, strings.Join(names, ", "))
}

// Validate reports a geometry with a non-positive dimension, more than MaxLayers
// layers, an unknown element type, a head dim that is not a whole number of the
// element type's blocks (32 values for Q8_0), scales for an element type that is not
// FP8, or a token size that overflows.
func (g Geometry) Validate() error {
	if g.Layers <= 0 || g.KVHeads <= 0 || g.HeadDim <= 0 {
		return fmt.Errorf("%w: layers %d, KV heads %d, head dim %d must be positive", ErrGeometry, g.Layers, g.KVHeads, g.HeadDim)
	}
	if g.Layers > MaxLayers {
		return fmt.Errorf("%w: %d layers, more than MaxLayers (%d)", ErrGeometry, g.Layers, MaxLayers)
	}
	if !g.DType.Valid() {
		return fmt.Errorf("%w: element type %v", ErrGeometry, g.DType)
	}
	hb, err := g.DType.Bytes(g.HeadDim)
	if err != nil {
		return fmt.Errorf("%w: head dim %d of %v: %w", ErrGeometry, g.HeadDim, g.DType, err)
	}
	if err := g.Scales.validate(g.DType); err != nil {
		return err
	}
	if g.KVHeads > math.MaxInt32/hb/2/g.Layers {
		return fmt.Errorf("%w: a token of %d layers × %d KV heads × %d bytes is too large", ErrGeometry, g.Layers, g.KVHeads, hb)
	}
	return nil
}

// TokenBytes returns the bytes of one token of one layer's K (or V) tensor: KVHeads
// heads of HeadDim values each, counted by the element type (a Q8_0 head of 128
// values is 4 blocks of 34 bytes). It is 0 for an invalid element type or a head dim
// that is not a whole number of its blocks.
func (g Geometry) TokenBytes() int {
	hb, err := g.DType.Bytes(g.HeadDim)
	if err != nil {
		return 0
	}
	return g.KVHeads * hb
}

// BytesPerToken returns the bytes of one token across all layers, K and V.
func (g Geometry) BytesPerToken() int { return g.Layers * len(g.kinds()) * g.TokenBytes() }

func (g Geometry) String() string {
	return fmt.Sprintf("%s (%d layers × %d KV heads × %d, %v: %d B/token)", g.Name, g.Layers, g.KVHeads, g.HeadDim, g.DType, g.BytesPerToken())
}

// kinds returns the tensors each layer of g has, in order: K and V. The slice is
// shared: callers MUST NOT modify it.
func (g Geometry) kinds() []Kind { return keyValue }

// keyValue is the kinds of a layer with a K and a V tensor.
var keyValue = []Kind{K, V}
