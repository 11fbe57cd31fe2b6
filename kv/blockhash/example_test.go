package blockhash_test

import (
	"fmt"

	"github.com/vmarena/vmarena/kv/blockhash"
)

// A block's published hash under vLLM's sha256_cbor with its default seed: what a vLLM
// replica announces for the same 16 tokens.
func ExampleHasher_Chain() {
	h, err := blockhash.New(blockhash.Options{Algorithm: blockhash.SHA256CBOR})
	if err != nil {
		panic(err)
	}
	tokens := make([]int32, 20) // one full block and 4 tokens that have no hash yet
	for i := range tokens {
		tokens[i] = int32(i)
	}
	for _, b := range h.Chain(nil, h.Root(), 0, tokens) {
		fmt.Printf("%d\n", b.Uint64())
	}
	// Output:
	// 2233398808101521225
}
