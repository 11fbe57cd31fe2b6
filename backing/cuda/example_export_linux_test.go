package cuda_test

import (
	"fmt"
	"syscall"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

func ExampleBacking_Export() {
	// Two processes in one here: each Backing has a driver of its own (fakes, whose
	// exportable allocations are memfds). Between real processes the descriptors
	// travel by SCM_RIGHTS over a Unix socket.
	owner, err := cuda.New(cuda.Options{
		Authority:  accounting.NewGovernor().Authority("owner", accounting.GPU(0)),
		Driver:     cudatest.NewFakeDriver(cudatest.FakeDriverOptions{}).Driver(),
		Exportable: true, // every handle exportable as a POSIX descriptor
	})
	if err != nil {
		panic(err) // errors.Is(err, backing.ErrUnsupported): the device can not export
	}
	defer owner.Close()
	g := owner.Granularity()
	r, _ := owner.Reserve(2 * g)
	if err := owner.Commit(r, 0, 2*g); err != nil {
		panic(err)
	}
	_ = owner.CopyIn(r, 0, []byte("system prompt"))
	fds, err := owner.Export(r, 0, 2*g) // one descriptor per granule, the caller's to close
	if err != nil {
		panic(err)
	}

	client, _ := cuda.New(cuda.Options{
		Authority: accounting.NewGovernor().Authority("client", accounting.GPU(0)),
		Driver:    cudatest.NewFakeDriver(cudatest.FakeDriverOptions{}).Driver(),
	})
	defer client.Close()
	cr, _ := client.Reserve(4 * g)
	if err := client.Import(cr, 2*g, fds, backing.ReadOnly); err != nil {
		panic(err)
	}
	for _, fd := range fds {
		_ = syscall.Close(fd) // the mappings do not need them
	}
	out := make([]byte, 13)
	_ = client.CopyOut(out, cr, 2*g)
	fmt.Printf("%s; client owns %d MiB, maps %d MiB\n", out, client.PoolStats().Owned>>20, client.PoolStats().Mapped>>20)
	fmt.Println("write:", client.CopyIn(cr, 2*g, []byte("x")) != nil)
	fmt.Println(client.Unreserve(cr))
	fmt.Println(owner.Unreserve(r))
	fmt.Printf("owner pool: %d MiB owned, %d MiB idle\n", owner.PoolStats().Owned>>20, owner.PoolStats().Idle>>20)
	// Output:
	// system prompt; client owns 0 MiB, maps 4 MiB
	// write: true
	// complete (unmapped 4194304, residual 0)
	// complete (unmapped 4194304, residual 0)
	// owner pool: 0 MiB owned, 0 MiB idle
}
