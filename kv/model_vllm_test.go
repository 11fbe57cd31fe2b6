package kv_test

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
)

// vllmKernelAlignment is the block size, in tokens, that vLLM's attention kernels on
// CUDA need a hybrid attention+Mamba model's block to be a multiple of
// (kernel_block_alignment_size in HybridAttentionMambaModelConfig.
// verify_and_update_config, vllm/model_executor/models/config.py; 16 for the
// FlashAttention backend, an assumption not re-read here).
const vllmKernelAlignment = 16

// vllmSpec is one of vLLM's KV cache specs: the layers of one spec form its groups.
type vllmSpec struct {
	kind      kv.Attention
	window    int
	perToken  int // bytes of one token of one layer (attention)
	state     int // bytes of one layer's state (Mamba)
	blockSize int // tokens per block, after the page sizes are unified
	page      int // bytes of one block of one layer
	layers    int
}

// vllmBytes returns the bytes one sequence of n tokens of m holds in vLLM's hybrid KV
// cache manager (v1) with blocks of blockSize tokens, computed from its rules:
//
//   - A layer's page is blockSize × its bytes per token (a Mamba layer's: its state).
//     With Mamba layers, the attention block grows to the fewest multiple of the
//     kernel alignment whose page holds a Mamba state, and the Mamba page is padded
//     to it (HybridAttentionMambaModelConfig.verify_and_update_config,
//     vllm/model_executor/models/config.py).
//   - Page sizes are unified: a smaller page's block size is scaled up to the
//     largest page, which it must divide (unify_kv_cache_spec_page_size,
//     vllm/v1/core/kv_cache_utils.py).
//   - Layers are grouped by spec into groups of an equal number of layers: the
//     smallest spec's count, or the largest's when that is under 1.5 times the
//     smallest; each spec's last group is padded with empty layers, which take
//     memory as real ones (_get_kv_cache_groups_uniform_page_size, same file). A
//     block of a group takes one page in each of the group-size layer tensors
//     (get_kv_cache_config_from_groups).
//   - A group holds cdiv(n, blockSize) blocks less the whole blocks before its
//     first live token (SlidingWindowManager and ChunkedLocalAttentionManager,
//     get_num_skipped_tokens and remove_skipped_blocks,
//     vllm/v1/core/single_type_kv_cache_manager.py); a Mamba group holds one block
//     (MambaManager without prefix caching of states).
func vllmBytes(m kv.Model, blockSize, n int) (int64, error) {
	if err := m.Validate(0); err != nil {
		return 0, err
	}
	var specs []*vllmSpec
	find := func(g kv.Group) *vllmSpec {
		s := vllmSpec{kind: g.Kind, window: g.Window, state: g.StateBytes}
		if g.Kind != kv.Recurrent {
			s.perToken = g.TensorsPerLayer() * g.TokenBytes()
		}
		for _, o := range specs {
			if o.kind == s.kind && o.window == s.window && o.perToken == s.perToken && o.state == s.state {
				return o
			}
		}
		specs = append(specs, &s)
		return &s
	}
	mamba, attn1 := 0, 0
	for _, g := range m.Groups {
		s := find(g)
		s.layers += len(g.Layers)
		if g.Kind == kv.Recurrent {
			mamba = max(mamba, g.StateBytes)
		} else if attn1 == 0 {
			attn1 = s.perToken
		}
	}
	if mamba > 0 && attn1 > 0 {
		a := vllmKernelAlignment
		blockSize = max(blockSize, a*((mamba+a*attn1-1)/(a*attn1)))
	}
	maxPage := 0
	for _, s := range specs {
		s.blockSize = blockSize
		s.page = blockSize * s.perToken
		if s.kind == kv.Recurrent {
			s.page = max(blockSize*attn1, s.state) // padded to the attention page
		}
		maxPage = max(maxPage, s.page)
	}
	minLayers, maxLayers := m.Layers, 0
	for _, s := range specs {
		if maxPage%s.page != 0 {
			return 0, errors.New("vllm: page sizes can not be unified")
		}
		s.blockSize *= maxPage / s.page
		s.page = maxPage
		minLayers, maxLayers = min(minLayers, s.layers), max(maxLayers, s.layers)
	}
	groupSize := minLayers
	if 2*maxLayers < 3*minLayers {
		groupSize = maxLayers
	}
	var total int64
	for _, s := range specs {
		groups := (s.layers + groupSize - 1) / groupSize
		blocks := 0
		switch bs := s.blockSize; s.kind {
		case kv.Recurrent:
			blocks = min(n, 1)
		case kv.SlidingWindow:
			blocks = (n+bs-1)/bs - max(0, n-s.window+1)/bs
		case kv.ChunkedLocal:
			blocks = (n+bs-1)/bs - n/s.window*s.window/bs
		default:
			blocks = (n + bs - 1) / bs
		}
		total += int64(groups) * int64(blocks) * int64(s.page) * int64(groupSize)
	}
	return total, nil
}

func TestVLLMBytes(t *testing.T) {
	mib := int64(1 << 20)
	// gpt-oss-20b: 12 sliding + 12 full layers, one page size (16 tokens × 2 KiB),
	// groups of 12 layers, no padding. At 8,192 tokens the full group holds 512
	// blocks, the sliding one the 8 blocks from token 8065's.
	got, err := vllmBytes(kv.GPTOSS20B(), 16, 8192)
	require.NoError(t, err)
	page := int64(16 * 2 * 8 * 64 * 2)
	assert.Equal(t, (512+(512-504))*page*12, got)

	// gemma-3-27b: 52 sliding and 10 full layers make groups of 10: six sliding
	// groups, the last padded with 8 empty layers, so 60 layers of window.
	got, err = vllmBytes(kv.Gemma3_27B(), 16, 32768)
	require.NoError(t, err)
	page = 16 * 2 * 16 * 128 * 2
	sw := int64(2048 - (32768-1024+1)/16)
	assert.Equal(t, (6*sw+2048)*page*10, got)

	// Qwen3-Next: the attention block grows to hold a Gated DeltaNet state (1,097,728
	// bytes, 2 KiB per attention token: 536 tokens, 544 at the alignment of 16) and
	// the state's page is padded to 544 × 2 KiB. Groups of 12 layers: one full, three
	// recurrent of one block each.
	got, err = vllmBytes(kv.Qwen3Next80B(), 16, 8192)
	require.NoError(t, err)
	page = 544 * 2048
	assert.Equal(t, (16+3)*page*12, got, "cdiv(8192, 544) = 16 blocks")
	assert.Less(t, int64(0), got/mib)

	// A uniform model is one group of all its layers.
	got, err = vllmBytes(kv.Qwen3_8B(), 16, 100)
	require.NoError(t, err)
	assert.Equal(t, int64(7*16*2*8*128*2*36), got)

	// Pages that do not divide are refused, as vLLM refuses them.
	bad := kv.Model{Name: "odd", Layers: 2, Groups: []kv.Group{
		{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 3, HeadDim: 16, DType: arena.Float16},
		{Kind: kv.SlidingWindow, Window: 8, Layers: []int{1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
	}}
	_, err = vllmBytes(bad, 16, 10)
	assert.Error(t, err)
	_, err = vllmBytes(kv.Model{}, 16, 10)
	assert.ErrorIs(t, err, kv.ErrModel)
}

// tableModels returns the presets of memoryTable: the models of layer groups, and the
// uniform qwen3-8b and -32b beside them.
func tableModels() []kv.Model {
	return []kv.Model{kv.GPTOSS20B(), kv.GPTOSS120B(), kv.Gemma3_27B(), kv.Gemma3_12B(), kv.Llama4Scout(),
		kv.DeepSeekV3(), kv.DeepSeekR1(), kv.Qwen3_8B(), kv.Qwen3_32B(), kv.Qwen3Next80B()}
}

// memoryTable returns, for each of tableModels at 8K, 32K and 128K tokens, what one sequence
// holds: in vmarena (each group in a range of its own on 2 MiB granules, cut into
// blocks of the fewest granules that hold a token of every layer, window groups
// holding their live blocks; and the packed floor of the same ranges, with no block
// tails), in a uniform full-attention cache of the model (every token of every
// layer, packed), and in vLLM's hybrid scheme with 16-token blocks; and the exact
// bytes of the live tokens. Figures are MiB.
func memoryTable() ([]string, error) {
	const granule = 2 << 20
	rows := []string{
		"| model | tokens | exact need | vmarena blocks | vmarena packed | uniform full | vLLM hybrid | full / packed | vLLM / blocks | vLLM / packed |",
		"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
	}
	for _, m := range tableModels() {
		for _, n := range []int{8 << 10, 32 << 10, 128 << 10} {
			s, err := m.Size(granule, 0, n)
			if err != nil {
				return nil, err
			}
			u, err := m.Uniform().Size(granule, 0, n)
			if err != nil {
				return nil, err
			}
			v, err := vllmBytes(m, 16, n)
			if err != nil {
				return nil, err
			}
			mb := func(b int64) float64 { return float64(b) / (1 << 20) }
			rows = append(rows, fmt.Sprintf("| %s | %dK | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f |",
				m.Name, n>>10, mb(s.Need), mb(s.Committed), mb(s.Packed), mb(u.Packed), mb(v),
				float64(u.Packed)/float64(s.Packed), float64(v)/float64(s.Committed), float64(v)/float64(s.Packed)))
		}
	}
	return rows, nil
}

// TestMemoryTable checks the table's figures against what they must satisfy and
// prints it with -v (the table in BENCHMARKS.md).
func TestMemoryTable(t *testing.T) {
	rows, err := memoryTable()
	require.NoError(t, err)
	require.Len(t, rows, 2+3*len(tableModels()))
	for _, m := range tableModels() {
		for _, n := range []int{8 << 10, 32 << 10, 128 << 10} {
			s, err := m.Size(2<<20, 0, n)
			require.NoError(t, err)
			u, err := m.Uniform().Size(2<<20, 0, n)
			require.NoError(t, err)
			v, err := vllmBytes(m, 16, n)
			require.NoError(t, err)
			windowed := false
			for _, g := range m.Groups {
				windowed = windowed || g.Kind == kv.SlidingWindow || g.Kind == kv.ChunkedLocal
			}
			if windowed && n > 8<<10 {
				assert.Less(t, s.Packed, u.Packed, "%s at %d: the window holds less than all tokens", m.Name, n)
			} else {
				assert.LessOrEqual(t, s.Packed, u.Packed, m.Name)
			}
			// Every scheme holds at least the live tokens' bytes, less what vLLM's
			// one partly filled 16-token block per group does not hold of a
			// window's front (the tokens it keeps below FirstLive are extra, never
			// missing).
			assert.LessOrEqual(t, s.Need, s.Packed, m.Name)
			assert.LessOrEqual(t, s.Packed, s.Committed, m.Name)
			// NB: vLLM's figure is before the next step, which reads from FirstLive(n);
			// Size's is after the last, which read from FirstLive(n-1).
			next := s.Need
			for i, g := range m.Groups {
				next -= int64(g.FirstLive(n)-s.Groups[i].FirstLive) * int64(g.BytesPerToken())
			}
			assert.LessOrEqual(t, next, v, "%s at %d: vLLM holds every token the next step reads", m.Name, n)
			if m.Name == "gemma-3-27b" || m.Name == "qwen3-next-80b-a3b" {
				assert.Greater(t, v, s.Packed, "%s at %d: vLLM's padding costs more than the packed floor", m.Name, n)
			}
		}
	}
	if testing.Verbose() {
		for _, r := range rows {
			fmt.Fprintln(os.Stdout, r)
		}
	}
}
