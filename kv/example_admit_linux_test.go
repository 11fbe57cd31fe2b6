package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// Admission with a prefix cache: Match and Need say what a request would match and
// take, with no side effect; Headroom counts what evicting cached prefixes would give
// back; Lookup, called once per admitted request, is what the hit rate counts.
func ExamplePrefixCache_Match() {
	const granule = 64 << 10
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 12*granule)
	pool, err := host.NewShared(host.SharedOptions{Granularity: granule, Authority: gov.Authority("kv", accounting.HostKey)})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	// kv.Tiny()'s tokens take 256 bytes in all: a 64 KiB block holds 256 of them.
	// NB: map-ahead off, so that the figures below are the same on every run: Need
	// counts off what the cache already holds ready (Cache.Headroom's own bytes), and
	// with map-ahead that is a block more whenever its worker has made one by then.
	cache, err := kv.New(pool, kv.Config{Model: kv.Tiny(), MaxTokens: 4096, NoMapAhead: true})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	prompt := func(first, n int) []int32 {
		ids := make([]int32, n)
		for i := range ids {
			ids[i] = int32(first + i)
		}
		return ids
	}
	// admit serves a prompt if it fits now: Match, Need and Headroom change nothing.
	admit := func(ids []int32) {
		m := pc.Match(ids)
		need, err := pc.Need(ids)
		if err != nil {
			panic(err)
		}
		if need > cache.Headroom() {
			fmt.Printf("%d tokens: match %d, need %d KiB, headroom %d KiB: wait\n", len(ids), m, need>>10, cache.Headroom()>>10)
			return
		}
		s, got, err := pc.Lookup(ids)
		if err != nil {
			panic(err)
		}
		if err := s.Append(len(ids) - got); err != nil { // prefill (K/V writes omitted)
			panic(err)
		}
		if err := pc.Insert(s, ids); err != nil {
			panic(err)
		}
		s.Close() // the prefix cache keeps its tokens
		fmt.Printf("%d tokens: match %d, need %d KiB: served\n", len(ids), got, need>>10)
	}
	admit(prompt(0, 2048))                                // a miss: 8 blocks
	admit(append(prompt(0, 1024), prompt(5000, 1024)...)) // 4 blocks cached, 4 new
	admit(prompt(9000, 3328))                             // 13 blocks: more than the limit
	admit(prompt(20000, 2048))                            // evicts what it needs
	st := pc.Stats()
	fmt.Printf("hit rate %.3f over %d admitted prompt tokens\n", st.HitRate(), st.Queries)
	// Output:
	// 2048 tokens: match 0, need 512 KiB: served
	// 2048 tokens: match 1024, need 256 KiB: served
	// 3328 tokens: match 0, need 832 KiB, headroom 768 KiB: wait
	// 2048 tokens: match 0, need 512 KiB: served
	// hit rate 0.167 over 6144 admitted prompt tokens
}
