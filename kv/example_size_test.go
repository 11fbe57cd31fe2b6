package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/kv"
)

// The cost of each layout for Llama-3-8B: waste is the partly filled granules, at
// worst one per growth frontier (2 × 32 of them per-layer), and in the blocked layout
// the free tokens of the last block (16 tokens a 2 MiB block).
func ExampleConfig_Size() {
	for _, granule := range []int{64 << 10, 2 << 20} {
		for _, layout := range []kv.Layout{kv.Blocked, kv.PerLayer} {
			var worst, sum int64
			for tokens := 1; tokens <= 2048; tokens++ {
				s, err := kv.Config{Model: kv.Llama3_8B(), Layout: layout, MaxTokens: 2048}.Size(granule, tokens)
				if err != nil {
					panic(err)
				}
				worst = max(worst, s.Waste)
				sum += s.Waste
			}
			s, _ := kv.Config{Model: kv.Llama3_8B(), Layout: layout, MaxTokens: 2048}.Size(granule, 1000)
			fmt.Printf("granule %4d KiB %-9v ranges %2d  at 1,000 tokens: %5.1f MiB waste (%4.1f%%)  worst %5.1f MiB, mean %5.1f MiB\n",
				granule>>10, layout, s.Buffers, float64(s.Waste)/(1<<20), s.WastePercent,
				float64(worst)/(1<<20), float64(sum)/2048/(1<<20))
		}
	}
	// Output:
	// granule   64 KiB blocked   ranges  1  at 1,000 tokens:   0.0 MiB waste ( 0.0%)  worst   0.0 MiB, mean   0.0 MiB
	// granule   64 KiB per-layer ranges 64  at 1,000 tokens:   3.0 MiB waste ( 2.3%)  worst   3.9 MiB, mean   1.9 MiB
	// granule 2048 KiB blocked   ranges  1  at 1,000 tokens:   1.0 MiB waste ( 0.8%)  worst   1.9 MiB, mean   0.9 MiB
	// granule 2048 KiB per-layer ranges 64  at 1,000 tokens:   3.0 MiB waste ( 2.3%)  worst 127.9 MiB, mean  63.9 MiB
}
