package arena_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
)

func ExampleArena() {
	gov := accounting.NewGovernor()
	mem, _ := host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10})
	buf, _ := arena.NewBuffer(mem, 1<<30, gov.Authority("activations", accounting.HostKey))
	a, err := arena.NewArena(buf, arena.ArenaOptions{})
	if err != nil {
		panic(err)
	}
	defer a.Close()

	for step := range 3 {
		x, _ := arena.MakeTensor[arena.F16](a, 8, 4096)  // hidden states of 8 tokens
		h, _ := arena.MakeTensor[arena.F16](a, 8, 14336) // MLP activations
		scores, _ := arena.Make[float32](a, 8*32*1024)   // attention scores
		fmt.Println(step, x.Offset(), h.Offset(), len(scores), a.Used(), a.Committed())
		_ = a.Reset() // everything above is dead now; the granules stay committed
	}
	fmt.Println(gov.Stats(accounting.HostKey).Used)
	// Output:
	// 0 0 65536 262144 1343488 1376256
	// 1 0 65536 262144 1343488 1376256
	// 2 0 65536 262144 1343488 1376256
	// 1376256
}

func ExampleArena_Mark() {
	mem, _ := host.NewPrivate(host.PrivateOptions{})
	buf, _ := arena.NewBuffer(mem, 1<<20, accounting.NewGovernor().Authority("x", accounting.HostKey))
	a, _ := arena.NewArena(buf, arena.ArenaOptions{})
	defer a.Close()

	keep, _ := arena.Make[float32](a, 100)
	m := a.Mark()
	for range 3 {
		scratch, _ := arena.Make[float32](a, 1000) // per-layer scratch
		scratch[0] = 1
		a.Rewind(m) // frees the scratch, keeps keep
	}
	fmt.Println(len(keep), a.Used(), a.HighWater())
	// Output:
	// 100 400 4448
}

// ExampleAllocator: code written against the plain eager-allocator contract runs on
// an Arena, and can ask what more it can do.
func ExampleAllocator() {
	mem, _ := host.NewPrivate(host.PrivateOptions{})
	buf, _ := arena.NewBuffer(mem, 1<<20, accounting.NewGovernor().Authority("x", accounting.HostKey))
	a, _ := arena.NewArena(buf, arena.ArenaOptions{})
	defer a.Close()

	var alloc arena.Allocator = a
	x, _ := alloc.Allocate(1000, 256)
	y, _ := alloc.Allocate(24, 8)
	fmt.Println(x.Ptr%256 == 0, y.Ptr-x.Ptr, alloc.Device())
	fmt.Println(alloc.Release(y)) // the latest: taken back
	fmt.Println(alloc.Release(x)) // freed at the next Reset
	fmt.Println(arena.IsVirtual(alloc), arena.CanShare(alloc))
	// Output:
	// true 1000 host:0
	// complete (unmapped 0, residual 0)
	// complete (unmapped 0, residual 0)
	// true false
}

// ExampleEager: memory of a size known up front (weights, a fixed scratch area),
// committed at once outside the Go heap and given back whole.
func ExampleEager() {
	gov := accounting.NewGovernor()
	mem, _ := host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10})
	eager, _ := arena.NewEager(mem, gov.Authority("weights", accounting.HostKey))

	var alloc arena.Allocator = eager
	w, err := alloc.Allocate(100<<10, 4096)
	if err != nil {
		panic(err)
	}
	copy(eager.Bytes(w), "weights")
	fmt.Println(w.Ptr%4096 == 0, len(eager.Bytes(w)), gov.Stats(accounting.HostKey).Used)
	fmt.Println(arena.IsVirtual(alloc), arena.CanShare(alloc))
	fmt.Println(alloc.Release(w))
	// Output:
	// true 102400 131072
	// false false
	// complete (unmapped 131072, residual 0)
}
