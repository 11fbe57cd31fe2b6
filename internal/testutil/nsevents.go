package testutil

import (
	"encoding/json"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// NamespaceEvent is one case of kv/testdata/namespace_events.json, which
// kv/testdata/gen_namespace_events.py computes from vLLM's definition of the block
// hash and its extra keys with Python's cbor2 and hashlib: the blocks a prompt
// inserted in a namespace (Adapter, Salt), first its first Split tokens and then all
// of them, must be announced with, under EventOptions.Hash's LoRA and CacheSalt
// (BaseLoRA, BaseSalt).
type NamespaceEvent struct {
	BaseLoRA  string   `json:"base_lora"`
	BaseSalt  string   `json:"base_salt"`
	Adapter   string   `json:"adapter"`
	Salt      string   `json:"salt"`
	BlockSize int      `json:"block_size"`
	Tokens    []int32  `json:"tokens"`
	Split     int      `json:"split"`
	LoRAName  string   `json:"lora_name"`
	Hashes    []uint64 `json:"hashes"`
	ExtraKeys [][]any  `json:"extra_keys"`
}

// NamespaceEvents reads the cases of the vectors file at path.
func NamespaceEvents(t testing.TB, path string) []NamespaceEvent {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var v struct {
		Cases []NamespaceEvent `json:"cases"`
	}
	require.NoError(t, json.Unmarshal(raw, &v))
	return v.Cases
}

// NoExtraKeys reports whether none of keys (a run of blocks' extra keys) holds any.
func NoExtraKeys(keys [][]any) bool {
	for _, k := range keys {
		if k != nil {
			return false
		}
	}
	return true
}
