package kv

import "github.com/vmarena/vmarena/arena"

// Presets of dense models of full attention (and a tiny one for tests), fp16: one
// group each (Uniform). A server that serves one of these models puts its preset in
// Config.Model; one that takes the model by name calls Preset.

// Llama3_8B returns llama3-8b: 32 layers, 8 KV heads × 128, fp16: the Config.Model of
// a server that serves it, and the model examples/kvcache serves by default.
func Llama3_8B() Model { return Uniform("llama3-8b", 32, 8, 128, arena.Float16) }

// Llama3_70B returns llama3-70b: 80 layers, 8 KV heads × 128, fp16: the Config.Model
// of a server that serves it.
func Llama3_70B() Model { return Uniform("llama3-70b", 80, 8, 128, arena.Float16) }

// Qwen25_7B returns qwen2.5-7b: 28 layers, 4 KV heads × 128, fp16: the Config.Model
// of a server that serves it.
func Qwen25_7B() Model { return Uniform("qwen2.5-7b", 28, 4, 128, arena.Float16) }

// Llama32_1B returns llama3.2-1b: 16 layers, 8 KV heads × 64, fp16; a small model, for
// replaying long prompts within a small machine.
func Llama32_1B() Model { return Uniform("llama3.2-1b", 16, 8, 64, arena.Float16) }

// Qwen25_05B returns qwen2.5-0.5b: 24 layers, 2 KV heads × 64, fp16; a small model,
// for a server tried on a laptop.
func Qwen25_05B() Model { return Uniform("qwen2.5-0.5b", 24, 2, 64, arena.Float16) }

// Tiny returns tiny: 2 layers, 2 KV heads × 16, fp16; for tests and examples, never
// a real model.
func Tiny() Model { return Uniform("tiny", 2, 2, 16, arena.Float16) }

// The figures of the layer-group presets below come from each model's config.json on Hugging Face
// (named with each function). That site could not be reached from the machine the
// presets were written on, so each figure was checked against a copy of the file or of
// the code that encodes it, found in public repositories and named below; a figure that
// could not be checked is said to be so. KV is in the model's dtype (bf16) unless a
// server chooses otherwise.

// GPTOSS20B returns gpt-oss-20b: 24 layers alternating a 128-token sliding window
// (even layers) and full attention (odd layers), 8 KV heads × 64, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/openai/gpt-oss-20b, config.json (num_hidden_layers 24,
// num_key_value_heads 8, head_dim 64, sliding_window 128, layer_types). Checked against
// the config summaries in EchoCog/gpt-oss-20b (docs/gpt-oss-20b-architecture.md) and
// ParagEkbote/hf-model-inspector (model_inspection_report.md), and the layer_types
// default of transformers' models/gpt_oss/configuration_gpt_oss.py ("sliding_attention"
// if (i+1) % 2 else "full_attention": layer 0 slides).
func GPTOSS20B() Model { return gptOSS("gpt-oss-20b", 24) }

// GPTOSS120B returns gpt-oss-120b: gpt-oss-20b's attention with 36 layers.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/openai/gpt-oss-120b, config.json (num_hidden_layers 36; the
// attention figures as gpt-oss-20b's). Checked against the GptOssConfig defaults for the
// 120b variant found by code search (num_hidden_layers 36, num_key_value_heads 8,
// sliding_window 128); head_dim 64 is taken as the 20b's, not checked separately.
func GPTOSS120B() Model { return gptOSS("gpt-oss-120b", 36) }

func gptOSS(name string, layers int) Model {
	return Model{Name: name, Layers: layers, Groups: []Group{
		{Kind: SlidingWindow, Window: 128, Layers: every(layers, func(i int) bool { return i%2 == 0 }), KVHeads: 8, HeadDim: 64, DType: arena.BFloat16},
		{Kind: FullAttention, Layers: every(layers, func(i int) bool { return i%2 == 1 }), KVHeads: 8, HeadDim: 64, DType: arena.BFloat16},
	}}
}

// Gemma3_27B returns gemma-3-27b: 62 layers, five with a 1,024-token sliding window
// before each global one (layers 5, 11, …, 59: 10 global, 52 local), 16 KV heads ×
// 128, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/google/gemma-3-27b-it, config.json (text_config:
// num_hidden_layers 62, num_key_value_heads 16, head_dim 128, sliding_window 1024,
// sliding_window_pattern 6). Checked against a copy of that text_config in a table of
// cached Hugging Face configs found by code search (get_hf_config, "google/gemma-3-27b")
// and the layer_types
// rule of transformers' models/gemma3/configuration_gemma3.py ("sliding_attention" if
// (i+1) % 6 else "full_attention").
func Gemma3_27B() Model { return gemma3("gemma-3-27b", 62, 16, 128) }

// Gemma3_12B returns gemma-3-12b: 48 layers in gemma-3-27b's pattern (8 global, 40
// local), 8 KV heads × 256, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/google/gemma-3-12b-it, config.json (text_config:
// num_hidden_layers 48, num_key_value_heads 8, head_dim 256, sliding_window 1024).
// Checked against the same table's entry that precedes gemma-3-27b's (48 layers, 8 KV
// heads, head dim 256, window 1024; its name was not in the part read).
func Gemma3_12B() Model { return gemma3("gemma-3-12b", 48, 8, 256) }

func gemma3(name string, layers, heads, dim int) Model {
	global := func(i int) bool { return (i+1)%6 == 0 }
	return Model{Name: name, Layers: layers, Groups: []Group{
		{Kind: SlidingWindow, Window: 1024, Layers: every(layers, func(i int) bool { return !global(i) }), KVHeads: heads, HeadDim: dim, DType: arena.BFloat16},
		{Kind: FullAttention, Layers: every(layers, global), KVHeads: heads, HeadDim: dim, DType: arena.BFloat16},
	}}
}

// Llama4Scout returns Llama-4-Scout-17B-16E: 48 layers, three of every four with
// chunked-local attention in chunks of 8,192 tokens and every fourth (3, 7, …, 47: no
// RoPE) global, 8 KV heads × 128, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/meta-llama/Llama-4-Scout-17B-16E, config.json (text_config:
// num_hidden_layers 48, num_key_value_heads 8, head_dim 128, attention_chunk_size 8192,
// no_rope_layers). Checked against the Llama4TextConfig defaults in
// Shameerisb/llama-4-scout_Implementation_Pytorch (configs/text_config.py:
// no_rope_layer_interval 4, attention_chunk_size 8192). Which layers chunk follows
// transformers' no_rope_layers rule ((i+1) % 4 != 0 keeps RoPE and chunks), not
// checked against the file here.
func Llama4Scout() Model {
	global := func(i int) bool { return (i+1)%4 == 0 }
	return Model{Name: "llama-4-scout", Layers: 48, Groups: []Group{
		{Kind: ChunkedLocal, Window: 8192, Layers: every(48, func(i int) bool { return !global(i) }), KVHeads: 8, HeadDim: 128, DType: arena.BFloat16},
		{Kind: FullAttention, Layers: every(48, global), KVHeads: 8, HeadDim: 128, DType: arena.BFloat16},
	}}
}

// DeepSeekV3 returns DeepSeek-V3 (DeepSeek-R1 has the same attention): 61 layers of
// multi-head latent attention, one latent of kv_lora_rank 512 + qk_rope_head_dim 64 =
// 576 values per token and layer, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/deepseek-ai/DeepSeek-V3, config.json (num_hidden_layers 61,
// kv_lora_rank 512, qk_rope_head_dim 64); DeepSeek-R1's config.json has the same.
// Checked against a copy of those fields for a model of the same attention (kimi_k2:
// num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64) found by code search; the
// V3 file itself was not read here. vLLM caches the 576 values as one head
// (MLAAttentionSpec).
func DeepSeekV3() Model { return deepSeek("deepseek-v3") }

// DeepSeekR1 returns DeepSeek-R1: DeepSeek-V3's attention.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
func DeepSeekR1() Model { return deepSeek("deepseek-r1") }

func deepSeek(name string) Model {
	return Model{Name: name, Layers: 61, Groups: []Group{
		{Kind: MLALatent, Layers: every(61, func(int) bool { return true }), KVHeads: 1, HeadDim: 512 + 64, DType: arena.BFloat16},
	}}
}

// Qwen3_8B returns Qwen3-8B: 36 full-attention layers, 8 KV heads × 128, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/Qwen/Qwen3-8B, config.json (num_hidden_layers 36,
// num_key_value_heads 8, head_dim 128). Not checked against a copy here: the issue's
// figures.
func Qwen3_8B() Model { return Uniform("qwen3-8b", 36, 8, 128, arena.BFloat16) }

// Qwen3_32B returns Qwen3-32B: 64 full-attention layers, 8 KV heads × 128, bf16.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/Qwen/Qwen3-32B, config.json (num_hidden_layers 64,
// num_key_value_heads 8, head_dim 128). Not checked against a copy here: the issue's
// figures.
func Qwen3_32B() Model { return Uniform("qwen3-32b", 64, 8, 128, arena.BFloat16) }

// Qwen3Next80B returns Qwen3-Next-80B-A3B: 48 layers, every fourth (3, 7, …, 47) full
// attention with 2 KV heads × 256, the other 36 Gated DeltaNet linear attention, whose
// state per sequence and layer is a convolution state of (conv kernel 4 - 1) ×
// (16 key heads × 128 × 2 + 32 value heads × 128) = 3 × 8,192 values and a recurrent
// state of 32 value heads × 128 × 128 = 524,288 values, both bf16: 1,097,728 bytes.
// A server that serves it passes it as Config.Model; a planner sizes its KV with
// Size before loading it.
//
// Source: huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct, config.json
// (num_hidden_layers 48, full_attention_interval 4, num_key_value_heads 2, head_dim 256,
// linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
// linear_value_head_dim 128, linear_conv_kernel_dim 4). Checked against a copy of that
// config.json found by code search and the state shapes of vLLM's
// model_executor/layers/mamba/mamba_utils.py (gated_delta_net_state_shape). The state's
// element type is the model dtype under vLLM's default mamba_ssm_cache_dtype "auto"; a
// server that keeps the recurrent state in float32 holds 2,146,304 bytes per layer.
func Qwen3Next80B() Model {
	full := func(i int) bool { return (i+1)%4 == 0 }
	const conv, state = 3 * (16*128*2 + 32*128), 32 * 128 * 128
	return Model{Name: "qwen3-next-80b-a3b", Layers: 48, Groups: []Group{
		{Kind: Recurrent, Layers: every(48, func(i int) bool { return !full(i) }), StateBytes: 2 * (conv + state)},
		{Kind: FullAttention, Layers: every(48, full), KVHeads: 2, HeadDim: 256, DType: arena.BFloat16},
	}}
}

// every returns the layers in [0, n) for which keep is true.
func every(n int, keep func(int) bool) []int {
	var ls []int
	for i := range n {
		if keep(i) {
			ls = append(ls, i)
		}
	}
	return ls
}

// Presets returns the presets, for a server that lists the models it knows (a flag's
// help), each a fresh value that the caller may change: the
// fp16 full-attention models llama3-8b, llama3-70b, qwen2.5-7b, llama3.2-1b,
// qwen2.5-0.5b and tiny, then the layer-group models gpt-oss-20b and -120b,
// gemma-3-27b and -12b, llama-4-scout, deepseek-v3 and -r1, qwen3-8b and -32b,
// qwen3-next-80b-a3b.
func Presets() []Model {
	return []Model{Llama3_8B(), Llama3_70B(), Qwen25_7B(), Llama32_1B(), Qwen25_05B(), Tiny(),
		GPTOSS20B(), GPTOSS120B(), Gemma3_27B(), Gemma3_12B(), Llama4Scout(),
		DeepSeekV3(), DeepSeekR1(), Qwen3_8B(), Qwen3_32B(), Qwen3Next80B()}
}

// Preset returns a fresh copy of the preset named name (case-insensitive), or an error
// matching ErrUnknownModel that lists the names it knows: for a server that takes its
// model by name, from a flag or a configuration file.
func Preset(name string) (Model, error) { return byName(Presets(), name) }
