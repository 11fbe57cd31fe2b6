package cuda_test

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

func ExampleNew() {
	// On a GPU machine leave Driver nil: New loads libcuda.so.1. The fake driver
	// stands in here so the example runs anywhere.
	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	gov := accounting.NewGovernor()
	pool := gov.Authority("gpu pool", accounting.GPU(0))
	b, err := cuda.New(cuda.Options{Authority: pool, Driver: fake.Driver(), Low: 2})
	if errors.Is(err, backing.ErrUnsupported) {
		fmt.Println("no usable GPU:", err) // no driver, no device, or no VMM: fall back
		return
	}
	if err != nil {
		panic(err)
	}
	defer b.Close()

	g := b.Granularity()
	r, err := b.Reserve(64 * g) // 128 MiB of device address space, no memory yet
	if err != nil {
		panic(err)
	}
	base := b.Base(r)
	if err := b.Commit(r, 0, 2*g); err != nil { // maps the two pooled handles
		panic(err)
	}
	if err := b.CopyIn(r, 0, []byte("hello")); err != nil {
		panic(err)
	}
	out := make([]byte, 5)
	if err := b.CopyOut(out, r, 0); err != nil {
		panic(err)
	}
	if err := b.Commit(r, 2*g, g); err != nil { // grows in place: a new handle
		panic(err)
	}
	fmt.Printf("%s; base moved: %v\n", out, b.Base(r) != base)
	fmt.Printf("owned %d MiB, mapped %d MiB\n", b.PoolStats().Owned>>20, b.PoolStats().Mapped>>20)
	fmt.Println(b.Unreserve(r))
	fmt.Printf("idle in the pool: %d MiB\n", b.PoolStats().Idle>>20)
	// Output:
	// hello; base moved: false
	// owned 6 MiB, mapped 6 MiB
	// complete (unmapped 6291456, residual 0)
	// idle in the pool: 6 MiB
}

func ExampleBacking_Share() {
	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	pool := accounting.NewGovernor().Authority("gpu pool", accounting.GPU(0))
	b, err := cuda.New(cuda.Options{Authority: pool, Driver: fake.Driver()})
	if err != nil {
		panic(err)
	}
	defer b.Close()
	g := b.Granularity()

	// A prompt prefix written once...
	prefix, _ := b.Reserve(g)
	_ = b.Commit(prefix, 0, g)
	_ = b.CopyIn(prefix, 0, []byte("You are a helpful assistant."))
	_ = b.Synchronize() // writes are visible through other mappings once complete

	// ...mapped read-only into four sequences: owned once, mapped five times.
	var seqs []*cuda.Reservation
	for range 4 {
		s, _ := b.Reserve(4 * g)
		if err := b.Share(s, 0, prefix, 0, g, backing.ReadOnly); err != nil {
			panic(err)
		}
		seqs = append(seqs, s)
	}
	got := make([]byte, 8)
	_ = b.CopyOut(got, seqs[3], 0)
	st := b.PoolStats()
	fmt.Printf("%q: owned %d MiB, mapped %d MiB\n", got, st.Owned>>20, st.Mapped>>20)
	fmt.Println(errors.Is(b.CopyIn(seqs[0], 0, []byte("x")), cuda.ErrReadOnly))

	// The prefix's handle returns to the pool only with its last mapping.
	b.Unreserve(prefix)
	for _, s := range seqs {
		b.Unreserve(s)
	}
	fmt.Printf("idle %d MiB, mapped %d MiB\n", b.PoolStats().Idle>>20, b.PoolStats().Mapped>>20)
	// Output:
	// "You are ": owned 2 MiB, mapped 10 MiB
	// true
	// idle 2 MiB, mapped 0 MiB
}
