package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// A prefill writes a layer's K for all its tokens in one call, as a model computes
// it, and reads it back the same way; on the host, kv.Run walks the tensor's
// contiguous runs without a call per element.
func ExampleSequence_WriteTokens() {
	gov := accounting.NewGovernor()
	mem, err := host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10})
	if err != nil {
		panic(err)
	}
	// kv.Tiny(): 2 layers, 2 KV heads of 16 float16s: 64 bytes a token and tensor. A
	// 64 KiB block holds 256 tokens of every layer.
	cache, err := kv.New(mem, kv.Config{Model: kv.Tiny(), MaxTokens: 1024, Authority: gov.Authority("kv", accounting.HostKey)})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	s, _ := cache.NewSequence()
	defer s.Close()
	const n = 300
	_ = s.Append(n)

	k := make([]arena.F16, n*2*16) // layer 1's K, token after token
	for i := range k {
		k[i] = arena.F16FromFloat32(float32(i % 7))
	}
	src := make([]byte, 2*len(k))
	for i, h := range k {
		src[2*i], src[2*i+1] = byte(h), byte(h>>8)
	}
	if err := s.WriteTokens(1, kv.K, 0, n, src); err != nil {
		panic(err)
	}
	back := make([]byte, len(src))
	_ = s.ReadTokens(1, kv.K, 0, n, back)
	fmt.Println("read back what was written:", string(back) == string(src))

	var sum float32
	runs := 0
	for t := 0; t < n; runs++ {
		run, err := kv.Run[arena.F16](s, 1, kv.K, t)
		if err != nil {
			panic(err)
		}
		for _, h := range run {
			sum += h.Float32()
		}
		t += len(run) / (2 * 16)
	}
	fmt.Printf("%d runs (a block's tokens each), sum %v\n", runs, sum)
	// Output:
	// read back what was written: true
	// 2 runs (a block's tokens each), sum 28794
}
