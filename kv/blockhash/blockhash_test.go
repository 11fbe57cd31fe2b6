package blockhash_test

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv/blockhash"
)

// vectorCase is one chain of testdata/vectors.json, made by testdata/gen_vectors.py
// with Python's cbor2 and hashlib.
type vectorCase struct {
	Algorithm string   `json:"algorithm"`
	BlockSize int      `json:"block_size"`
	Seed      string   `json:"seed"`
	LoRA      string   `json:"lora"`
	CacheSalt string   `json:"cache_salt"`
	Tokens    []int32  `json:"tokens"`
	Root      string   `json:"root"`
	Hashes    []string `json:"hashes"`
	Published []uint64 `json:"published"`
	Payloads  []string `json:"payloads"`
}

func loadVectors(t *testing.T) []vectorCase {
	t.Helper()
	raw, err := os.ReadFile("testdata/vectors.json")
	require.NoError(t, err)
	var v struct{ Cases []vectorCase }
	require.NoError(t, json.Unmarshal(raw, &v))
	require.NotEmpty(t, v.Cases)
	return v.Cases
}

// hexOf returns h as the vectors write it: the whole digest for sha256_cbor, the
// 64-bit value for fnv64_cbor.
func hexOf(a blockhash.Algorithm, h blockhash.Hash) string {
	if a == blockhash.SHA256CBOR {
		return hex.EncodeToString(h[:])
	}
	return fmt.Sprintf("%016x", h.Uint64())
}

// TestVectors checks every chain against Python's: the root (vLLM's NONE_HASH), each
// block's CBOR payload byte for byte, its hash, and the 64-bit value an event
// publishes.
func TestVectors(t *testing.T) {
	algos := map[string]blockhash.Algorithm{"sha256_cbor": blockhash.SHA256CBOR, "fnv64_cbor": blockhash.FNV64CBOR}
	for i, vc := range loadVectors(t) {
		t.Run(fmt.Sprintf("%d-%s-bs%d", i, vc.Algorithm, vc.BlockSize), func(t *testing.T) {
			a, ok := algos[vc.Algorithm]
			require.True(t, ok, vc.Algorithm)
			h, err := blockhash.New(blockhash.Options{BlockSize: vc.BlockSize, Algorithm: a, Seed: vc.Seed, LoRA: vc.LoRA, CacheSalt: vc.CacheSalt})
			require.NoError(t, err)
			assert.Equal(t, vc.Root, hexOf(a, h.Root()), "root")
			chain := h.Chain(nil, h.Root(), 0, vc.Tokens)
			require.Len(t, chain, len(vc.Hashes))
			parent := h.Root()
			for j, got := range chain {
				block := vc.Tokens[j*vc.BlockSize : (j+1)*vc.BlockSize]
				assert.Equal(t, vc.Payloads[j], hex.EncodeToString(h.Payload(parent, block, h.ExtraKeys(j))), "payload of block %d", j)
				assert.Equal(t, vc.Hashes[j], hexOf(a, got), "block %d", j)
				assert.Equal(t, vc.Published[j], got.Uint64(), "published hash of block %d", j)
				parent = got
			}
			// A chain resumed from block k after its parent is the same chain.
			if k := len(chain) / 2; k > 0 {
				rest := h.Chain(nil, chain[k-1], k, vc.Tokens[k*vc.BlockSize:])
				assert.Equal(t, chain[k:], rest)
			}
		})
	}
}

// TestChainProperties checks what a router relies on: equal prefixes give equal
// hashes, a differing token, seed, LoRA name or salt gives different ones from there.
func TestChainProperties(t *testing.T) {
	toks := make([]int32, 64)
	for i := range toks {
		toks[i] = int32(i * 7919 % 50000)
	}
	for _, a := range []blockhash.Algorithm{blockhash.FNV64CBOR, blockhash.SHA256CBOR} {
		t.Run(a.String(), func(t *testing.T) {
			h, err := blockhash.New(blockhash.Options{Algorithm: a})
			require.NoError(t, err)
			assert.Equal(t, blockhash.DefaultBlockSize, h.BlockSize())
			base := h.Chain(nil, h.Root(), 0, toks)
			require.Len(t, base, 4)
			other := append([]int32(nil), toks...)
			other[40]++ // block 2
			changed := h.Chain(nil, h.Root(), 0, other)
			assert.Equal(t, base[:2], changed[:2])
			assert.NotEqual(t, base[2], changed[2])
			assert.NotEqual(t, base[3], changed[3], "a change reaches every later block")
			for _, o := range []blockhash.Options{{Algorithm: a, Seed: "s"}, {Algorithm: a, LoRA: "l"}, {Algorithm: a, CacheSalt: "c"}} {
				g, err := blockhash.New(o)
				require.NoError(t, err)
				assert.NotEqual(t, base[0], g.Chain(nil, g.Root(), 0, toks)[0], "%+v", o)
			}
			assert.Len(t, h.Chain(nil, h.Root(), 0, toks[:15]), 0, "a block that is not full has no hash")
		})
	}
}

func TestBadInputs(t *testing.T) {
	_, err := blockhash.New(blockhash.Options{BlockSize: -1})
	assert.ErrorIs(t, err, blockhash.ErrConfig)
	_, err = blockhash.New(blockhash.Options{Algorithm: 9})
	assert.ErrorIs(t, err, blockhash.ErrConfig)
	assert.Equal(t, "Algorithm(9)", blockhash.Algorithm(9).String())
	h, err := blockhash.New(blockhash.Options{BlockSize: 4})
	require.NoError(t, err)
	assert.PanicsWithValue(t, blockhash.PanicBlockLength, func() { h.Block(h.Root(), []int32{1, 2, 3}, nil) })
	assert.PanicsWithValue(t, blockhash.PanicExtraKey, func() { h.Block(h.Root(), []int32{1, 2, 3, 4}, []any{1.5}) })
	assert.NotPanics(t, func() {
		h.Block(h.Root(), []int32{1, 2, 3, 4}, []any{nil, true, false, "s", []byte{1}, 1, int32(-2), int64(-300), uint32(70000), uint64(1 << 40), []any{"mm", 3}})
	})
}

func BenchmarkBlock(b *testing.B) {
	toks := make([]int32, blockhash.DefaultBlockSize)
	for i := range toks {
		toks[i] = int32(100000 + i)
	}
	for _, a := range []blockhash.Algorithm{blockhash.FNV64CBOR, blockhash.SHA256CBOR} {
		b.Run("algorithm="+a.String(), func(b *testing.B) {
			h, _ := blockhash.New(blockhash.Options{Algorithm: a})
			p := h.Root()
			for b.Loop() {
				p = h.Block(p, toks, nil)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(toks)), "ns/token")
		})
	}
}
