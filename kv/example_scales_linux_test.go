package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// An FP8 cache with a scale per KV head: the kernel gets the scales' address and
// layout from Scales, and a token's K is stored divided by its head's scale.
func ExampleCache_Scales() {
	gov := accounting.NewGovernor()
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: gov.Authority("kv", accounting.HostKey)})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	g := withScales(kv.Uniform("fp8", 2, 2, 4, arena.Float8E4M3), kv.ScalePerHead)
	cache, err := kv.New(pool, kv.Config{Model: g, MaxTokens: 128, Layout: kv.PerLayer})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	_ = cache.SetScales(1, kv.K, []float32{0.5, 4}) // calibrated per head of layer 1's K

	scales, _ := cache.Scales()
	fmt.Println("scales", scales.Shape(), "at a stable address:", scales.DevicePtr() != 0)

	s, _ := cache.NewSequence()
	defer s.Close()
	_ = s.Append(1)
	k, _ := kv.View[arena.F8E4M3](s, 1, kv.K)
	for h := range g.Groups[0].KVHeads {
		scale := scales.At(1, int(kv.K), h)
		x := float32(100) // the value to store in dimension 0 of head h
		k.Set(arena.F8E4M3FromFloat32Sat(x/scale), 0, h, 0)
		fmt.Printf("head %d: scale %v, stored %v, read back %v\n", h, scale, k.At(0, h, 0), k.At(0, h, 0).Float32()*scale)
	}
	// Output:
	// scales [2 2 2] at a stable address: true
	// head 0: scale 0.5, stored 192, read back 96
	// head 1: scale 4, stored 24, read back 96
}

// A hybrid model whose window group is FP8 with a scale per KV head, and whose full
// group is fp16: the window group's scales are a tensor of their own, over the
// group's layers in its order, for the kernel that reads that group.
func ExampleCache_GroupScales() {
	gov := accounting.NewGovernor()
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: gov.Authority("kv", accounting.HostKey)})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	m := kv.Model{Name: "hybrid-fp8", Layers: 3, Groups: []kv.Group{
		{Kind: kv.SlidingWindow, Window: 64, Layers: []int{0, 2}, KVHeads: 2, HeadDim: 16, DType: arena.Float8E4M3, Scales: kv.ScalePerHead},
		{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
	}}
	cache, err := kv.New(pool, kv.Config{Model: m, MaxTokens: 128})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	_ = cache.SetScales(2, kv.V, []float32{0.25, 8}) // layer 2 is the group's second

	w, _ := cache.GroupScales(0)
	fmt.Println("window group's scales", w.Shape(), "layer 2's V:", w.At(1, int(kv.V), 0), w.At(1, int(kv.V), 1))
	_, err = cache.GroupScales(1)
	fmt.Println("full group:", err)
	// Output:
	// window group's scales [2 2 2] layer 2's V: 0.25 8
	// full group: kv: invalid FP8 scales: layer group 1 (full, float16) keeps none (Scales none)
}
