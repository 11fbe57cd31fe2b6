package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// A prefix is owned once: a sequence started on it maps its full blocks and owns only
// the copy of the last token, past them (Blocked layout: 2 tokens a 64 KiB block), and
// its Started report says so.
func ExampleSequence_Started() {
	ledger := accounting.NewGovernor().Authority("kv", accounting.HostKey)
	mem := backingtest.NewFake(backingtest.FakeOptions{Authority: ledger}) // 64 KiB granules, sharing
	cache, err := kv.New(mem, kv.Config{Model: kv.Llama32_1B(), MaxTokens: 4096})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	root, err := cache.NewSequence()
	if err != nil {
		panic(err)
	}
	_ = root.Append(91) // the system prompt (its K/V writes omitted)
	p, err := root.Freeze(91)
	if err != nil {
		panic(err)
	}
	defer p.Release()
	root.Close()
	fmt.Printf("prefix: %d tokens, %d KiB requested, %d KiB mapped, %d KiB committed\n",
		p.Len(), p.Requested()>>10, p.Mapped()>>10, p.Committed()>>10)

	s, err := cache.NewSequenceFrom(p)
	if err != nil {
		panic(err)
	}
	defer s.Close()
	r := s.Started()
	fmt.Printf("started on it: %d KiB newly owned, %d KiB newly mapped, %d granules\n", r.Owned>>10, r.Mapped>>10, r.Granules)
	// Output:
	// prefix: 91 tokens, 2912 KiB requested, 2944 KiB mapped, 2944 KiB committed
	// started on it: 64 KiB newly owned, 2944 KiB newly mapped, 46 granules
}
