//go:build linux || windows

package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// A server serves two requests that share a system prompt: the second starts on the
// K/V the first one cached, and prefills only the rest.
func ExamplePrefixCache() {
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
	cache, err := kv.New(pool, kv.Config{Geometry: kv.Llama32_1B, MaxTokens: 4096})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{MaxBytes: 256 << 20})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	system := make([]int32, 1000) // the system prompt's token IDs
	for i := range system {
		system[i] = int32(1000 + i)
	}
	for req, question := range [][]int32{{7, 8, 9}, {4, 5}} {
		prompt := append(append([]int32{}, system...), question...)
		s, cached, err := pc.Lookup(prompt)
		if err != nil {
			panic(err)
		}
		// Prefill the uncached part (its K/V writes omitted), then cache the prompt.
		if err := s.Append(len(prompt) - cached); err != nil {
			panic(err)
		}
		if err := pc.Insert(s, prompt); err != nil {
			panic(err)
		}
		fmt.Printf("request %d: %d of %d prompt tokens cached\n", req, cached, len(prompt))
		s.Close()
	}
	st := pc.Stats()
	fmt.Printf("queries %d, hits %d, cached %d tokens in %d KiB\n", st.Queries, st.Hits, st.CachedTokens, st.CachedBytes>>10)
	// Output:
	// request 0: 0 of 1003 prompt tokens cached
	// request 1: 1000 of 1002 prompt tokens cached
	// queries 2005, hits 1000, cached 1005 tokens in 32192 KiB
}
