//go:build linux || windows

package kv_test

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// The quick start of README.md, which TestQuickStartInREADME keeps identical to this
// function's body: a governor with a budget, a cache for a preset, two requests that
// share a prompt, their K/V written and read back, a refusal for budget handled, and
// everything closed in order.
func Example_quickStart() {
	check := func(err error) { // a server returns these; the example stops
		if err != nil {
			panic(err)
		}
	}
	// One governor per process: a 64 MiB budget for host memory.
	gov := accounting.NewGovernor()
	check(gov.SetLimit(accounting.HostKey, 64<<20))
	// A pool of physical granules that the budget pays for and sequences share.
	pool, err := host.NewShared(host.SharedOptions{
		Granularity: 64 << 10,
		Authority:   gov.Authority("kv", accounting.HostKey),
	})
	check(err)
	model, err := kv.Preset("llama3-8b") // 128 KiB of K and V a token
	check(err)
	cache, err := kv.New(pool, kv.Config{Model: model, MaxTokens: 8192})
	check(err)
	tb := model.Groups[0].TokenBytes() // one token of one layer's K (or V)

	// Prefill a prompt once: append its tokens, write each layer's K and V, freeze it.
	const prompt = 100
	kvOut := bytes.Repeat([]byte{7}, prompt*tb) // what the model computed
	sys, err := cache.NewSequence()
	check(err)
	check(sys.Append(prompt))
	for layer := range model.Layers {
		check(sys.WriteTokens(layer, kv.K, 0, prompt, kvOut))
		check(sys.WriteTokens(layer, kv.V, 0, prompt, kvOut))
	}
	prefix, err := sys.Freeze(prompt)
	check(err)
	sys.Close()

	// Two requests start on the prompt: its memory is mapped into both, not copied.
	var reqs []*kv.Sequence
	for range 2 {
		s, err := cache.NewSequenceFrom(prefix)
		check(err)
		reqs = append(reqs, s)
	}
	prefix.Release() // the requests hold it now

	// A decode step appends a token to each and writes its K and V in every layer.
	tok := bytes.Repeat([]byte{9}, tb)
	for _, s := range reqs {
		check(s.Append(1))
		t := s.Len() - 1
		for layer := range model.Layers {
			check(s.WriteTokens(layer, kv.K, t, t+1, tok))
			check(s.WriteTokens(layer, kv.V, t, t+1, tok))
		}
	}
	got := make([]byte, 2*tb) // the last prompt token and the new one
	check(reqs[1].ReadTokens(31, kv.V, prompt-1, prompt+1, got))
	fmt.Println("read back:", bytes.Equal(got, append(kvOut[:tb], tok...)))

	// A growth the budget can not cover is refused, and nothing is held for it:
	// preempt a request, or wait (AppendCtx), and step again.
	const more = 1000
	err = reqs[0].Append(more)
	var refused *accounting.BudgetError
	if errors.As(err, &refused) {
		fmt.Printf("refused: %d tokens of %d MiB over a budget of %d MiB\n",
			more, more*model.BytesPerToken()>>20, refused.Limit>>20)
	}
	st := cache.Stats()
	fmt.Printf("%d requests, %d tokens, %d MiB mapped from the prompt\n", st.Sequences, st.Tokens, st.Shared>>20)

	// Close in order: the sequences, then the cache, then the pool.
	for _, s := range reqs {
		check(s.Close().Err)
	}
	check(cache.Close())
	check(pool.Close())
	fmt.Println("held after close:", gov.Stats(accounting.HostKey).Used)
	// Output:
	// read back: true
	// refused: 1000 tokens of 125 MiB over a budget of 64 MiB
	// 2 requests, 202 tokens, 25 MiB mapped from the prompt
	// held after close: 0
}
