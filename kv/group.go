package kv

import (
	"fmt"
	"math"

	"github.com/vmarena/vmarena/arena"
)

// Attention is the kind of a layer group's attention: what its KV holds per token and
// which of a sequence's tokens the next step reads. A server names one in Group.Kind
// when it describes a model no preset covers.
type Attention uint8

// The attention kinds. The zero value is none of them, so a Group must name its kind.
const (
	// FullAttention keeps every token: each step reads all of them. Most models'
	// layers are of this kind; a model of nothing else is Uniform.
	FullAttention Attention = iota + 1
	// SlidingWindow keeps the last Window tokens: a token at position p reads the
	// keys at p-Window+1 .. p (itself included), as Hugging Face's sliding_window
	// and vLLM's SlidingWindowSpec count it: the local layers of gpt-oss and Gemma 3.
	SlidingWindow
	// ChunkedLocal splits the sequence into chunks of Window tokens from position 0:
	// a token reads the earlier tokens of its own chunk only (Llama 4's
	// attention_chunk_size).
	ChunkedLocal
	// MLALatent is multi-head latent attention (DeepSeek-V2/V3): one compressed
	// latent per token and layer (kv_lora_rank + qk_rope_head_dim values), no V, and
	// every token read, as in FullAttention.
	MLALatent
	// Recurrent is a linear-attention or state-space layer (Gated DeltaNet, Mamba): a
	// fixed state of StateBytes per sequence and layer, whatever the sequence's
	// length, and no tokens.
	Recurrent

	numAttention
)

// String returns the kind's name as logs and errors print it ("sliding-window").
func (a Attention) String() string {
	switch a {
	case FullAttention:
		return "full"
	case SlidingWindow:
		return "sliding-window"
	case ChunkedLocal:
		return "chunked-local"
	case MLALatent:
		return "mla-latent"
	case Recurrent:
		return "recurrent"
	}
	return fmt.Sprintf("Attention(%d)", uint8(a))
}

// Group is a set of a model's layers that share one KV shape: their attention kind,
// per-token tensors and element type. A Model is a list of groups. A server writes
// groups only for a model no preset (Presets) or Uniform describes.
type Group struct {
	Kind Attention
	// Layers are the indices of the model's layers in this group, each in [0,
	// Model.Layers) and in exactly one group of the model.
	Layers []int
	// Window is the tokens of a SlidingWindow group's window or of a ChunkedLocal
	// group's chunk; it must be 0 for the other kinds.
	Window int
	// KVHeads and HeadDim shape each per-token tensor of a layer: KVHeads heads of
	// HeadDim values (an MLALatent group: 1 head of the latent's width). They must
	// be 0 for a Recurrent group.
	KVHeads int
	HeadDim int
	// DType is the element type of the tensors: its bytes for n values include a
	// block type's scales (Q8_0: 34 bytes per 32 values).
	DType arena.DType
	// Scales asks for FP8 dequantization scales, per tensor or per KV head; they are
	// kept with the cache, not per sequence (Cache.GroupScales).
	Scales ScaleMode
	// Tensors is the per-token tensors of each layer: 0 means the kind's own (2, K
	// and V, for the attention kinds; 1, the latent, for MLALatent; none for
	// Recurrent). Any other count is refused: an MLA group has no V.
	Tensors int
	// StateBytes is a Recurrent group's state per sequence and layer; it must be 0
	// for the other kinds.
	StateBytes int
}

// tensorsPerLayer returns the per-token tensors of each of g's layers: 2 (K and V),
// 1 for an MLA latent, 0 for a recurrent state.
func (g Group) tensorsPerLayer() int {
	switch g.Kind {
	case MLALatent:
		return 1
	case Recurrent:
		return 0
	}
	return 2
}

// kinds returns the tensors each of g's layers has, in order: K and V, the latent
// alone (as K) for MLALatent, none for Recurrent. The slice is shared: callers MUST
// NOT modify it.
func (g Group) kinds() []Kind {
	switch g.Kind {
	case MLALatent:
		return latentOnly
	case Recurrent:
		return nil
	}
	return keyValue
}

// keyValue is the kinds of a layer with a K and a V tensor.
var keyValue = []Kind{K, V}

// latentOnly is the kinds of an MLA layer: its one latent tensor, addressed as K.
var latentOnly = []Kind{K}

// TokenBytes returns the bytes of one token of one of g's per-token tensors: KVHeads
// heads of HeadDim values counted by the element type, block scales included. It is 0
// for a Recurrent group and for a shape its element type can not hold. It is the
// length of the buffer ReadToken and WriteToken take for a layer of g.
func (g Group) TokenBytes() int {
	if g.Kind == Recurrent {
		return 0
	}
	hb, err := g.DType.Bytes(g.HeadDim)
	if err != nil {
		return 0
	}
	return g.KVHeads * hb
}

// BytesPerToken returns the bytes of one token across all of g's layers and
// tensors; 0 for a Recurrent group, whose state does not grow with tokens. Use it to
// weigh a group's share of a model's memory; Model.Size counts granules and blocks.
func (g Group) BytesPerToken() int { return len(g.Layers) * g.tensorsPerLayer() * g.TokenBytes() }

// FirstLive returns the first token of a sequence of n tokens that a later step can
// still read: the tokens below it can be given back. A server's attention kernel
// reads from it on; Sequence.FirstHeld says what a live sequence still holds. It is 0 for the kinds that read
// every token (and for Recurrent, which keeps none); for SlidingWindow it is
// max(0, n-Window+1), for ChunkedLocal the start of the chunk the next token falls in,
// n rounded down to a multiple of Window. These are vLLM's
// get_num_skipped_tokens of SlidingWindowManager and ChunkedLocalAttentionManager
// (vllm/v1/core/single_type_kv_cache_manager.py).
func (g Group) FirstLive(n int) int {
	switch g.Kind {
	case SlidingWindow:
		return max(0, n-g.Window+1)
	case ChunkedLocal:
		return n / g.Window * g.Window
	}
	return 0
}

// validate reports what is wrong with g on its own, as group i of a model, for a cache
// of at most maxTokens tokens per sequence (0: no maximum given); Model.Validate
// checks the layer indices across groups.
func (g Group) validate(i, maxTokens int) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: group %d (%v): %s", ErrModel, i, g.Kind, fmt.Sprintf(format, args...))
	}
	if g.Kind == 0 || g.Kind >= numAttention {
		return bad("unknown attention kind")
	}
	if len(g.Layers) == 0 {
		return bad("no layers")
	}
	switch g.Kind {
	case SlidingWindow, ChunkedLocal:
		if g.Window <= 0 {
			return bad("window %d must be positive", g.Window)
		}
		if maxTokens > 0 && g.Window > maxTokens {
			return bad("window of %d tokens is larger than MaxTokens %d", g.Window, maxTokens)
		}
	default:
		if g.Window != 0 {
			return bad("window %d is only for sliding-window and chunked-local groups", g.Window)
		}
	}
	if g.Kind == Recurrent {
		switch {
		case g.StateBytes <= 0:
			return bad("state of %d bytes per layer must be positive", g.StateBytes)
		case g.KVHeads != 0 || g.HeadDim != 0 || g.Tensors != 0 || g.DType != 0 || g.Scales != NoScales:
			return bad("a recurrent state has no per-token tensors (KV heads %d, head dim %d, tensors %d, %v, scales %v)", g.KVHeads, g.HeadDim, g.Tensors, g.DType, g.Scales)
		case g.StateBytes > math.MaxInt32/len(g.Layers):
			return bad("state of %d layers × %d bytes is too large", len(g.Layers), g.StateBytes)
		}
		return nil
	}
	if g.StateBytes != 0 {
		return bad("state bytes %d are only for recurrent groups", g.StateBytes)
	}
	if g.Tensors != 0 && g.Tensors != g.tensorsPerLayer() {
		if g.Kind == MLALatent {
			return bad("%d tensors per layer: an MLA group keeps one latent and no V", g.Tensors)
		}
		return bad("%d tensors per layer: attention keeps K and V", g.Tensors)
	}
	if err := g.validateShape(); err != nil {
		return fmt.Errorf("group %d (%v): %w", i, g.Kind, err)
	}
	return nil
}

// validateShape reports, with an error matching ErrModel, a group of tokens with a
// non-positive dimension, more than MaxLayers layers, an unknown element type, a head
// dim that is not a whole number of the element type's blocks (32 values for Q8_0),
// scales for an element type that is not FP8, or a token size that overflows.
func (g Group) validateShape() error {
	layers := len(g.Layers)
	if layers <= 0 || g.KVHeads <= 0 || g.HeadDim <= 0 {
		return fmt.Errorf("%w: layers %d, KV heads %d, head dim %d must be positive", ErrModel, layers, g.KVHeads, g.HeadDim)
	}
	if layers > MaxLayers {
		return fmt.Errorf("%w: %d layers, more than MaxLayers (%d)", ErrModel, layers, MaxLayers)
	}
	if !g.DType.Valid() {
		return fmt.Errorf("%w: element type %v", ErrModel, g.DType)
	}
	hb, err := g.DType.Bytes(g.HeadDim)
	if err != nil {
		return fmt.Errorf("%w: head dim %d of %v: %w", ErrModel, g.HeadDim, g.DType, err)
	}
	if err := g.Scales.validate(g.DType); err != nil {
		return err
	}
	if g.KVHeads > math.MaxInt32/hb/2/layers {
		return fmt.Errorf("%w: a token of %d layers × %d KV heads × %d bytes is too large", ErrModel, layers, g.KVHeads, hb)
	}
	return nil
}
