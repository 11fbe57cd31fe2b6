//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// A prefix the device tier had to give up comes back from host memory: eviction wrote
// its whole blocks down into a host tier of its own budget, and the next request for
// it loads them instead of prefilling them again.
func ExamplePrefixCacheOptions_tiers() {
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
	tier, err := hosttier.New(hosttier.Options{Budget: 64 << 20})
	if err != nil {
		panic(err)
	}
	defer tier.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{
		Tiers:      []kv.Tier{tier},
		TierPrefix: "llama-3.2-1b-instruct rev 1", // what the geometry can not tell
		TierWait:   10 * time.Second,              // a lookup's longest wait on the tiers
		TierLoads:  8,                             // lookups that load from the tiers at once
	})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	prompt := make([]int32, 1000)
	for i := range prompt {
		prompt[i] = int32(1000 + i)
	}
	for req := range 2 {
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
		// The last token is never cached; nor, from a tier, the part of a block
		// before it.
		fmt.Printf("request %d: %d of %d prompt tokens cached\n", req, cached, len(prompt))
		s.Close()
		if req == 0 {
			// Memory ran short: the governor took the cached prompt back.
			if _, err := pc.Evict(1 << 40); err != nil {
				panic(err)
			}
		}
	}
	st := pc.Stats().Tiers[0]
	fmt.Printf("%s tier: %d tokens hit, %d KiB stored, %d KiB loaded\n", st.Name, st.Hits, st.StoreBytes>>10, st.LoadBytes>>10)
	// Output:
	// request 0: 0 of 1000 prompt tokens cached
	// request 1: 998 of 1000 prompt tokens cached
	// host tier: 998 tokens hit, 32027 KiB stored, 31963 KiB loaded
}

// Under a reuse threshold only prefixes that were hit go down into the tier, and with
// write-through they go as soon as they reach it, not when they are evicted: here the
// prompt hit once is found again by a prefix cache made after the first one closed,
// and the prompt never hit is not.
func ExamplePrefixCacheOptions_reuseThreshold() {
	gov := accounting.NewGovernor()
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
	tier, err := hosttier.New(hosttier.Options{Budget: 64 << 20})
	if err != nil {
		panic(err)
	}
	defer tier.Close()
	opts := kv.PrefixCacheOptions{
		Tiers:            []kv.Tier{tier},
		TierMinHits:      1,    // store only what was reused
		TierWriteThrough: true, // and store it once it is, off the token path
		// A wait no machine runs out of: a store or load past it is dropped, and the
		// output below would then depend on the machine's speed.
		TierWait: 10 * time.Second,
	}
	pc, err := kv.NewPrefixCache(cache, opts)
	if err != nil {
		panic(err)
	}
	serve := func(pc *kv.PrefixCache, prompt []int32) int {
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
		s.Close()
		return cached
	}
	hot, cold := make([]int32, 1000), make([]int32, 1000)
	for i := range hot {
		hot[i], cold[i] = int32(1000+i), int32(5000+i)
	}
	serve(pc, hot)
	serve(pc, cold)
	serve(pc, hot) // a hit: hot's blocks go down now
	if err := pc.Close(); err != nil {
		panic(err)
	}
	pc, err = kv.NewPrefixCache(cache, opts)
	if err != nil {
		panic(err)
	}
	defer pc.Close()
	fmt.Printf("hot: %d tokens cached, cold: %d\n", serve(pc, hot), serve(pc, cold))
	// Output:
	// hot: 998 tokens cached, cold: 0
}

// A scheduler admits a request whose prompt a tier holds without waiting for the
// tier's reads: LookupAsync maps what the device holds and returns, the loads run
// while the scheduler goes on with the other requests' steps, and Wait hands over
// the sequence once they end, holding exactly what they loaded.
func ExamplePrefixCache_LookupAsync() {
	gov := accounting.NewGovernor()
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
	tier, err := hosttier.New(hosttier.Options{Budget: 64 << 20})
	if err != nil {
		panic(err)
	}
	defer tier.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierWait: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	prompt := make([]int32, 1000)
	for i := range prompt {
		prompt[i] = int32(1000 + i)
	}
	// An earlier request's prompt, since evicted into the tier.
	s, _, err := pc.Lookup(prompt)
	if err != nil {
		panic(err)
	}
	if err := s.Append(len(prompt)); err != nil {
		panic(err)
	}
	if err := pc.Insert(s, prompt); err != nil {
		panic(err)
	}
	s.Close()
	if _, err := pc.Evict(1 << 40); err != nil {
		panic(err)
	}

	// A request bounded by its own deadline: loads past it are left to the prefill.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := pc.LookupAsync(ctx, kv.Namespace{}, prompt)
	if err != nil {
		panic(err)
	}
	fmt.Printf("on the device: %d tokens\n", p.Device())
	for wait := true; wait; {
		select {
		case <-p.Done():
			wait = false
		default:
			// The other requests' decode step.
		}
	}
	s, cached := p.Wait()
	defer s.Close()
	// Prefill the rest from cached on (its K/V writes omitted).
	if err := s.Append(len(prompt) - cached); err != nil {
		panic(err)
	}
	fmt.Printf("ready: %d of %d prompt tokens cached\n", cached, len(prompt))
	// Output:
	// on the device: 0 tokens
	// ready: 998 of 1000 prompt tokens cached
}

// A scheduler asks, before it admits a request, where its prompt's tokens are held
// and what the lookup would commit, and moves nothing: here a prompt of gpt-oss-20b
// (sliding-window layers beside full ones) that eviction wrote down into a host
// tier. Probe reads the heads of the tier's values to say how far the window rule
// lets a lookup serve, and the Lookup then starts exactly there.
func ExamplePrefixCache_Probe() {
	gov := accounting.NewGovernor()
	pool, err := host.NewShared(host.SharedOptions{
		Granularity: 64 << 10,
		Authority:   gov.Authority("kv", accounting.HostKey),
	})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	cache, err := kv.New(pool, kv.Config{Model: kv.GPTOSS20B(), MaxTokens: 4096})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	tier, err := hosttier.New(hosttier.Options{Budget: 256 << 20})
	if err != nil {
		panic(err)
	}
	defer tier.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}, TierWait: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	prompt := make([]int32, 1000)
	for i := range prompt {
		prompt[i] = int32(1000 + i)
	}
	// An earlier request's prompt, since evicted into the tier.
	s, _, err := pc.Lookup(prompt)
	if err != nil {
		panic(err)
	}
	if err := s.Append(len(prompt)); err != nil {
		panic(err)
	}
	if err := pc.Insert(s, prompt); err != nil {
		panic(err)
	}
	s.Close()
	if _, err := pc.Evict(1 << 40); err != nil {
		panic(err)
	}

	// Two requests: one that continues the prompt, and one that shares its first
	// 600 tokens only. At the end of its 600th token the tier's values hold no
	// sliding-window units (the prefill's window gave them back before the insert),
	// so no lookup can start there: the step would read them.
	cont := append(slices.Clone(prompt), make([]int32, 200)...)
	branch := append(slices.Clone(prompt[:600]), make([]int32, 200)...)
	for _, next := range [][]int32{cont, branch} {
		p, err := pc.Probe(next)
		if err != nil {
			panic(err)
		}
		fmt.Printf("device %d, host tier %d, to prefill %d of %d, commits %d MiB\n",
			p.Device, p.Tiers[0], len(next)-p.Total, len(next), p.Commit>>20)
		s, cached, err := pc.Lookup(next)
		if err != nil {
			panic(err)
		}
		fmt.Printf("the lookup starts on %d tokens\n", cached)
		// The prefill and decode steps, then:
		s.Close()
	}
	// Output:
	// device 0, host tier 1000, to prefill 200 of 1200, commits 46 MiB
	// the lookup starts on 1000 tokens
	// device 0, host tier 0, to prefill 800 of 800, commits 0 MiB
	// the lookup starts on 0 tokens
}
