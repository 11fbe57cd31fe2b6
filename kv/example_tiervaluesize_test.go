package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/kv"
)

// A server sizes its tiers before it makes the cache: the largest value the cache
// stores must fit each tier's bound on a value (kvtier/redistier's MaxValueSize, 8
// MiB by default), or every such store is a counted drop. On Qwen3-Next a value
// carries, beside a block of K/V, the recurrent states checkpointed at its end.
func ExampleTierValueSize() {
	cfg := kv.Config{Model: kv.Qwen3Next80B(), MaxTokens: 32 << 10}
	size, err := kv.TierValueSize(cfg, 2<<20) // a CUDA granule
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s: values of %.1f MiB: a Redis tier needs MaxValueSize >= %d\n", cfg.Model.Name, float64(size)/(1<<20), size)
	// Output: qwen3-next-80b-a3b: values of 43.7 MiB: a Redis tier needs MaxValueSize >= 45810856
}
