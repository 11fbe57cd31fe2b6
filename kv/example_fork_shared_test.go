//go:build linux || windows

package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// Speculative decoding: checkpoint the accepted tokens with ForkAt, draft past them,
// and keep the checkpoint when the draft is rejected. The checkpoint maps the whole
// granules it shares and copies only its tail.
func ExampleSequence_ForkAt() {
	gov := accounting.NewGovernor()
	pool, err := host.NewShared(host.SharedOptions{
		Granularity: 64 << 10, // 1,024 tokens of one kv.Tiny() tensor per granule
		Authority:   gov.Authority("kv", accounting.HostKey),
	})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	cache, err := kv.New(pool, kv.Config{Model: kv.Tiny(), MaxTokens: 4096, Layout: kv.PerLayer})
	if err != nil {
		panic(err)
	}
	defer cache.Close()

	seq, _ := cache.NewSequence()
	_ = seq.Append(3000) // accepted so far (K/V writes omitted)
	draft, err := seq.ForkAt(3000)
	if err != nil {
		panic(err)
	}
	_ = draft.Append(8) // 8 drafted tokens, written in the draft only
	fmt.Printf("draft: %d tokens, writable from %d\n", draft.Len(), draft.Writable())
	fmt.Printf("origin: %d tokens, writable from %d\n", seq.Len(), seq.Writable())

	fmt.Printf("%d KiB shared\n", cache.Stats().Shared>>10)

	fmt.Println("rejected:", draft.Close()) // the origin is as it was
	fmt.Printf("origin: %d tokens\n", seq.Len())
	fmt.Println(seq.Close())
	// Output:
	// draft: 3008 tokens, writable from 2048
	// origin: 3000 tokens, writable from 2048
	// 512 KiB shared
	// rejected: complete (unmapped 786432, residual 0)
	// origin: 3000 tokens
	// complete (unmapped 786432, residual 0)
}
