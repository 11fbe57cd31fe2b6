package hosttier_test

import (
	"context"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// A tier below a CUDA cache: the device copies a block straight into the tier's
// pinned memory on the tier's stream, and back. The fake driver stands in for a GPU.
func Example_cuda() {
	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	gpu, err := cuda.New(cuda.Options{Authority: accounting.NewGovernor().Authority("kv", accounting.GPU(0)), Driver: fake.Driver()})
	if err != nil {
		panic(err)
	}
	defer gpu.Close()
	r, _ := gpu.Reserve(2 << 20)
	defer gpu.Unreserve(r)
	_ = gpu.Commit(r, 0, 2<<20)
	_ = gpu.CopyIn(r, 0, []byte("a block on the device"))

	tier, err := hosttier.New(hosttier.Options{Budget: 64 << 20, CUDA: gpu})
	if err != nil {
		panic(err)
	}
	defer tier.Close() // before gpu.Close: deferred calls run last first
	ctx := context.Background()
	_ = tier.WaitPinned(ctx) // or not: memory not pinned yet works, staged
	s := tier.Stream()
	key := tierval.Key{Namespace: 1, Hash: 42}

	// Evicting the block: DtoH into the tier's memory.
	err = tier.Store(ctx, key, 2<<20, func(dst []byte) error {
		if err := s.CopyOutAsync(dst, r, 0); err != nil {
			return err
		}
		return s.Synchronize()
	})
	fmt.Println("stored:", err, "pinned:", tier.Stats().Pinned>>20, "MiB")

	// A later hit: HtoD back into fresh device memory.
	_ = gpu.Memset(r, 0, 2<<20, 0)
	err = tier.Load(ctx, key, func(src []byte) error {
		if err := s.CopyInAsync(r, 0, src); err != nil {
			return err
		}
		return s.Synchronize()
	})
	got := make([]byte, 21)
	_ = gpu.CopyOut(got, r, 0)
	fmt.Printf("loaded: %v %q\n", err, got)
	// Output:
	// stored: <nil> pinned: 64 MiB
	// loaded: <nil> "a block on the device"
}
