//go:build linux || windows

package arena_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

func ExampleBuffer_DecommitBelow() {
	pool := accounting.NewGovernor().Authority("kv", accounting.HostKey)
	mem, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: pool})
	if err != nil {
		panic(err)
	}
	defer mem.Close()
	// A sliding window of 1,000 tokens of 256 bytes each over a sequence that grows.
	const token, window = 256, 1000
	buf, _ := arena.NewBuffer(mem, 1<<30, nil)
	defer buf.Close()
	base := buf.Base()
	for n := 1; n <= 10_000; n++ {
		_ = buf.Resize(n * token)
		_ = buf.DecommitBelow(max(n-window, 0) * token) // the tokens no step attends to
	}
	fmt.Println(buf.Len(), buf.Start(), buf.Committed(), buf.Base() == base)
	fmt.Println(pool.Stats().Mapped)
	// Output:
	// 2560000 2293760 327680 true
	// 327680
}

func ExampleBuffer_ShareRange() {
	pool := accounting.NewGovernor().Authority("kv", accounting.HostKey)
	mem, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: pool})
	if err != nil {
		panic(err)
	}
	defer mem.Close()
	const g = 64 << 10
	seq, _ := arena.NewBuffer(mem, 1<<20, nil)
	defer seq.Close()
	_ = seq.Resize(6 * g)
	copy(seq.Bytes()[4*g:], "live window")
	_ = seq.DecommitBelow(4 * g)

	// A fork maps only the window, at the same offsets, and grows on its own.
	fork, _ := arena.NewBuffer(mem, 1<<20, nil)
	defer fork.Close()
	fmt.Println(fork.ShareRange(seq, 4*g, 4*g, 2*g, backing.ReadOnly))
	_ = fork.Resize(7 * g)
	fmt.Println(fork.Start()/g, fork.Committed()/g, fork.Shared()/g)
	fmt.Println(string(fork.Bytes()[4*g : 4*g+11]))
	// Output:
	// <nil>
	// 4 3 2
	// live window
}
