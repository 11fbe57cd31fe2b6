package kv

import (
	"fmt"
	"math"
	"strings"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
)

// Geometry is the shape of a model's KV cache: per layer, one K and one V tensor of
// KVHeads × HeadDim elements per token.
type Geometry struct {
	Name    string
	Layers  int
	KVHeads int
	HeadDim int
	DType   arena.DType
}

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
	var names []string
	for _, g := range Presets() {
		if strings.EqualFold(g.Name, name) {
			return g, nil
		}
		names = append(names, g.Name)
	}
	return Geometry{}, fmt.Errorf("%w %q (known: %s)", ErrUnknownModel, name, strings.Join(names, ", "))
}

// Validate reports a geometry with a non-positive dimension, an unknown element type,
// or a token size that overflows.
func (g Geometry) Validate() error {
	if g.Layers <= 0 || g.KVHeads <= 0 || g.HeadDim <= 0 {
		return fmt.Errorf("%w: layers %d, KV heads %d, head dim %d must be positive", ErrGeometry, g.Layers, g.KVHeads, g.HeadDim)
	}
	if g.DType.Size() <= 0 {
		return fmt.Errorf("%w: element type %v", ErrGeometry, g.DType)
	}
	if g.KVHeads > math.MaxInt32/g.HeadDim || g.KVHeads*g.HeadDim > math.MaxInt32/g.DType.Size()/2/g.Layers {
		return fmt.Errorf("%w: a token of %d×%d×%d×%d bytes is too large", ErrGeometry, g.Layers, g.KVHeads, g.HeadDim, g.DType.Size())
	}
	return nil
}

// TokenBytes returns the bytes of one token of one layer's K (or V) tensor.
func (g Geometry) TokenBytes() int { return g.KVHeads * g.HeadDim * g.DType.Size() }

// BytesPerToken returns the bytes of one token across all layers, K and V.
func (g Geometry) BytesPerToken() int { return 2 * g.Layers * g.TokenBytes() }

func (g Geometry) String() string {
	return fmt.Sprintf("%s (%d layers × %d KV heads × %d, %v: %d B/token)", g.Name, g.Layers, g.KVHeads, g.HeadDim, g.DType, g.BytesPerToken())
}

// Layout says how a sequence's K and V tensors lie in address space.
type Layout uint8

const (
	// PerSequence, the default, puts all layers in one range, token-major (token,
	// layer, K|V, head, dim): one growth frontier, at most one partly filled granule
	// per sequence, and one commit per growth step; each layer's tensor is strided by
	// BytesPerToken. Measured fastest and least wasteful with 2 MiB granules (see
	// BENCHMARKS.md).
	PerSequence Layout = iota
	// PerLayer gives every (layer, K|V) tensor its own range: each tensor is
	// contiguous (Sequence.Bytes), and a sequence has 2 × Layers growth frontiers, so
	// up to 2 × Layers partly filled granules: up to 128 MiB per sequence for
	// Llama-3-8B at 2 MiB granules, 4 MiB at 64 KiB.
	PerLayer
)

func (l Layout) String() string {
	switch l {
	case PerLayer:
		return "per-layer"
	case PerSequence:
		return "per-sequence"
	}
	return fmt.Sprintf("Layout(%d)", uint8(l))
}

// buffers returns how many ranges a sequence has and the bytes one token takes in each.
func (l Layout) buffers(g Geometry) (n, row int) {
	if l == PerSequence {
		return 1, g.BytesPerToken()
	}
	return 2 * g.Layers, g.TokenBytes()
}

// Sizing is what a configuration needs; see Size.
type Sizing struct {
	TokenBytes    int     // one token of one layer's K or V
	BytesPerToken int     // one token, all layers, K and V
	Buffers       int     // address ranges per sequence
	Used          int64   // bytes of the tokens themselves
	Committed     int64   // bytes of the granules that hold them
	Waste         int64   // Committed - Used: partly filled granules
	WastePercent  float64 // Waste as a share of Committed
	Reserved      int64   // address space reserved per sequence (MaxTokens)
}

// Size returns what one sequence of tokens tokens needs under layout with granule
// bytes per granule, reserving room for maxTokens. It allocates nothing.
func Size(g Geometry, layout Layout, granule, tokens, maxTokens int) (Sizing, error) {
	if err := g.Validate(); err != nil {
		return Sizing{}, err
	}
	if !backing.IsPowerOfTwo(granule) || tokens < 0 || maxTokens < tokens {
		return Sizing{}, fmt.Errorf("%w: granule %d, tokens %d, max tokens %d", ErrConfig, granule, tokens, maxTokens)
	}
	n, row := layout.buffers(g)
	if maxTokens > math.MaxInt/row-granule {
		return Sizing{}, fmt.Errorf("%w: %d tokens of %d bytes overflow", ErrConfig, maxTokens, row)
	}
	committed, _ := backing.AlignUp(tokens*row, granule)
	reserved, _ := backing.AlignUp(maxTokens*row, granule)
	if reserved > 0 && int64(n) > math.MaxInt64/int64(reserved) {
		return Sizing{}, fmt.Errorf("%w: %d ranges of %d bytes overflow", ErrConfig, n, reserved)
	}
	s := Sizing{
		TokenBytes:    g.TokenBytes(),
		BytesPerToken: g.BytesPerToken(),
		Buffers:       n,
		Used:          int64(tokens) * int64(g.BytesPerToken()),
		Committed:     int64(n) * int64(committed),
		Reserved:      int64(n) * int64(reserved),
	}
	s.Waste = s.Committed - s.Used
	if s.Committed > 0 {
		s.WastePercent = 100 * float64(s.Waste) / float64(s.Committed)
	}
	return s, nil
}
