package kv_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/kv"
)

// A prefix frozen in one process is lent to another attached to the same node pool,
// which borrows it with no copy and starts a sequence on it. Here both processes are
// this one, with a client each (the owner tells them apart by their connections);
// in a server the loan's bytes go over whatever the two processes already speak.
func ExamplePrefix_Lend() {
	dir, err := os.MkdirTemp("", "node")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "node.sock")
	owner, err := nodepool.Listen(path, nodepool.OwnerOptions{Granularity: 64 << 10})
	if err != nil {
		panic(err)
	}
	defer owner.Close()
	model := kv.Uniform("example", 2, 2, 64, arena.Float16) // 1 KiB a token
	attach := func() (*nodepool.Client, *kv.Cache) {
		cl, err := nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
		if err != nil {
			panic(err)
		}
		c, err := kv.New(cl, kv.Config{Model: model, MaxTokens: 4096})
		if err != nil {
			panic(err)
		}
		return cl, c
	}
	a, cacheA := attach()
	b, cacheB := attach()
	defer a.Close()
	defer b.Close()

	// Process A: a system prompt of 1,000 tokens, frozen and lent to B.
	s, _ := cacheA.NewSequence()
	_ = s.Append(1000)
	p, _ := s.Freeze(1000)
	loan, err := p.Lend(b.Number())
	if err != nil {
		panic(err)
	}
	data, _ := loan.MarshalBinary()

	// Process B: the loan's bytes arrive; borrow it and start a request on it.
	var got kv.PrefixLoan
	if err := got.UnmarshalBinary(data); err != nil {
		panic(err)
	}
	bp, err := cacheB.BorrowPrefix(got)
	if err != nil {
		panic(err)
	}
	fmt.Printf("B borrows %d tokens, %d granules, and owns %d bytes\n", got.Len(), got.Granules(), b.Accounting().Authority().Stats().Owned)
	seq, _ := cacheB.NewSequenceFrom(bp)
	st := cacheB.SequenceStats()[0]
	fmt.Printf("a sequence on it maps %d KiB and commits %d KiB of its own (the tail's block)\n", st.Shared>>10, (st.Committed-st.Shared)>>10)
	_, err = cacheB.BorrowPrefix(kv.PrefixLoan{}) // of no model
	fmt.Println("refused:", errors.Is(err, kv.ErrLoan))

	seq.Close()
	bp.Release()
	p.Release()
	s.Close()
	_ = cacheA.Close()
	_ = cacheB.Close()
	// Output:
	// B borrows 1000 tokens, 16 granules, and owns 0 bytes
	// a sequence on it maps 960 KiB and commits 64 KiB of its own (the tail's block)
	// refused: true
}
