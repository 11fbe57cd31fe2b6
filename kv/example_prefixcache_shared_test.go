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
	cache, err := kv.New(pool, kv.Config{Model: kv.Llama32_1B(), MaxTokens: 4096})
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

// On gpt-oss-20b, whose sliding-window layers (128 tokens) alternate with full ones,
// a hit needs the full layers' every token before it and the window layers' last
// window before it: a conversation's next turn hits its first turn whole, and a
// prompt that branches inside the first turn hits up to the branch, since the cache
// keeps every window unit the first turn held.
func ExamplePrefixCache_slidingWindow() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 4<<30)
	pool, err := host.NewShared(host.SharedOptions{
		Granularity: 2 << 20,
		Authority:   gov.Authority("kv", accounting.HostKey),
	})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	cache, err := kv.New(pool, kv.Config{Model: kv.GPTOSS20B(), MaxTokens: 8192})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	turn1 := make([]int32, 2000)
	for i := range turn1 {
		turn1[i] = int32(i)
	}
	turn2 := append(append([]int32{}, turn1...), 1, 2, 3)
	branch := append(append([]int32{}, turn1[:1500]...), 7)
	for _, prompt := range [][]int32{turn1, turn2, branch} {
		s, cached, err := pc.Lookup(prompt)
		if err != nil {
			panic(err)
		}
		// Prefill the uncached part (its K/V writes omitted), then cache the prompt.
		if err := s.Append(len(prompt) - cached); err != nil {
			panic(err)
		}
		fmt.Printf("%d of %d prompt tokens cached; window layer 0 holds from token %d\n", cached, len(prompt), s.FirstHeld(0))
		if err := pc.Insert(s, prompt); err != nil {
			panic(err)
		}
		s.Close()
	}
	// Output:
	// 0 of 2000 prompt tokens cached; window layer 0 holds from token 0
	// 2000 of 2003 prompt tokens cached; window layer 0 holds from token 1856
	// 1500 of 1501 prompt tokens cached; window layer 0 holds from token 1344
}
