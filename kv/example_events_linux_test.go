package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// printEvents prints what a prefix cache tells it. A real observer (package
// kvevents's publisher) only queues them: it is called under the cache's lock.
type printEvents struct{}

func (printEvents) BlocksStored(e kv.BlocksStored) {
	fmt.Printf("stored %d blocks of %d tokens on %s, after a parent: %t\n", len(e.Hashes), e.BlockSize, e.Medium, e.HasParent)
}

func (printEvents) BlocksRemoved(e kv.BlocksRemoved) {
	fmt.Printf("removed %d blocks\n", len(e.Hashes))
}

func (printEvents) AllBlocksCleared() { fmt.Println("cleared") }

// A prefix cache announces each block of 16 tokens once it holds it whole, chained
// by vLLM's sha256_cbor hashes: a second request that extends the first announces
// only its new block.
func ExampleEventOptions() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 1<<30)
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: gov.Authority("kv", accounting.HostKey)})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	cache, err := kv.New(pool, kv.Config{Model: kv.Llama3_8B(), MaxTokens: 4096})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{Events: kv.EventOptions{
		Observer: printEvents{}, Hash: blockhash.Options{Algorithm: blockhash.SHA256CBOR},
	}})
	if err != nil {
		panic(err)
	}
	prompt := make([]int32, 40)
	for i := range prompt {
		prompt[i] = int32(1000 + i)
	}
	for _, n := range []int{40, 50} { // the second prompt extends the first
		for len(prompt) < n {
			prompt = append(prompt, int32(2000+len(prompt)))
		}
		s, m, _ := pc.Lookup(prompt)
		_ = s.Append(len(prompt) - m) // prefill the rest (its K/V writes omitted)
		_ = pc.Insert(s, prompt)
		s.Close()
	}
	_ = pc.Close()
	// Output:
	// stored 2 blocks of 16 tokens on CPU, after a parent: false
	// stored 1 blocks of 16 tokens on CPU, after a parent: true
	// cleared
}
