package nodepool_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// An owner holds a node's budget of 2 granules; two clients (in one process here,
// in two in real use) commit against it, and the second is refused until the first
// gives a granule back, then waits for it.
func Example() {
	dir, _ := os.MkdirTemp("", "node")
	defer os.RemoveAll(dir)
	o, err := nodepool.Listen(filepath.Join(dir, "node.sock"), nodepool.OwnerOptions{Granularity: 1 << 16})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer o.Close()
	_ = o.Governor().SetLimit(accounting.HostKey, 2<<16)

	a, _ := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
	b, _ := nodepool.Attach(o.Path(), nodepool.ClientOptions{})
	defer a.Close()
	defer b.Close()
	ra, _ := a.Reserve(2 << 16)
	rb, _ := b.Reserve(1 << 16)
	defer b.Unreserve(rb)

	fmt.Println("a commits 2 granules:", a.Commit(ra, 0, 2<<16))
	err = b.Commit(rb, 0, 1<<16)
	fmt.Println("b is refused:", errors.Is(err, accounting.ErrBudgetExceeded))
	_ = a.CopyIn(ra, 0, []byte("hello"))
	fmt.Println("a decommits one:", a.Decommit(ra, 1<<16, 1<<16))
	// NB: a's granule reaches the owner after Decommit returns (a free needs no
	// answer), so b waits for it in the node's queue rather than racing it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fmt.Println("b commits:", b.CommitCtx(ctx, rb, 0, 1<<16))
	u, _ := b.Usage()
	fmt.Printf("node: %d of %d bytes used, b holds %d\n", u.NodeUsed, u.NodeLimit, u.Owned)
	fmt.Println("a unreserves:", a.Unreserve(ra))
	// Output:
	// a commits 2 granules: <nil>
	// b is refused: true
	// a decommits one: <nil>
	// b commits: <nil>
	// node: 131072 of 131072 bytes used, b holds 65536
	// a unreserves: complete (unmapped 65536, residual 0)
}
