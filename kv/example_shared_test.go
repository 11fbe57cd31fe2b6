//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// A system prompt is prefilled once, frozen into a prefix, and shared by two
// requests that then decode on their own.
func Example() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 1<<30)
	pool, err := host.NewShared(host.SharedOptions{
		Granularity: 64 << 10,
		Authority:   gov.Authority("kv", accounting.HostKey),
	})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	cache, err := kv.New(pool, kv.Config{Model: kv.Llama3_8B(), MaxTokens: 4096})
	if err != nil {
		panic(err)
	}
	defer cache.Close()

	sys, _ := cache.NewSequence()
	_ = sys.Append(100) // prefill the system prompt (its K/V writes omitted)
	prefix, _ := sys.Freeze(100)
	sys.Close()

	var reqs []*kv.Sequence
	for range 2 {
		s, _ := cache.NewSequenceFrom(prefix)
		for range 20 { // decode 20 tokens
			if err := s.AppendCtx(context.Background(), 1); err != nil {
				panic(err)
			}
		}
		// Layer 31's K: [blocks, BlockTokens, KVHeads, HeadDim] in the default layout.
		k, _ := kv.View[arena.F16](s, 31, kv.K)
		t, bt := s.Len()-1, s.BlockTokens()
		k.Set(arena.F16FromFloat32(0.5), t/bt, t%bt, 0, 0) // the newest token's K
		reqs = append(reqs, s)
	}
	prefix.Release()

	st := cache.Stats()
	fmt.Printf("%d sequences, %d tokens, %d KiB shared\n", st.Sequences, st.Tokens, st.Shared>>10)
	for _, s := range reqs {
		fmt.Println(s.Close())
	}
	// Output:
	// 2 sequences, 240 tokens, 25600 KiB shared
	// complete (unmapped 15728640, residual 0)
	// complete (unmapped 15728640, residual 0)
}
