//go:build linux || darwin

package arena_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
)

func ExampleBuffer() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 1<<30)
	mem, _ := host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10})

	// Reserve 1 GiB of address space; nothing is committed yet.
	buf, err := arena.NewBuffer(mem, 1<<30, gov.Authority("tensor", accounting.HostKey))
	if err != nil {
		panic(err)
	}
	base := buf.Base()
	for tokens := 1; tokens <= 100; tokens++ {
		_ = buf.Resize(tokens * 2048) // one 2 KiB token at a time
	}
	copy(buf.Bytes(), "hello")
	fmt.Println(buf.Len(), buf.Committed(), buf.Base() == base)
	fmt.Println(gov.Stats(accounting.HostKey).Used)
	fmt.Println(buf.Close())
	// Output:
	// 204800 262144 true
	// 262144
	// complete (unmapped 262144, residual 0)
}

// A worker commits the next two granules ahead of need; the owner adopts them one at a
// time as it grows into them, with no backing call, and the rest waits ahead.
func ExampleBuffer_AdoptAhead() {
	const granule = 64 << 10
	mem, _ := host.NewPrivate(host.PrivateOptions{Granularity: granule})
	auth := accounting.NewGovernor().Authority("tensor", accounting.HostKey)
	buf, err := arena.NewBuffer(mem, 1<<20, auth)
	if err != nil {
		panic(err)
	}
	_ = buf.Resize(granule)
	if err := buf.CommitAhead(granule, 2*granule); err != nil { // on another goroutine, say
		panic(err)
	}
	if err := buf.AdoptAhead(granule); err != nil { // the step that crosses into it
		panic(err)
	}
	off, size := buf.Ahead()
	fmt.Println(buf.Committed()/granule, off/granule, size/granule, auth.Stats().Owned/granule)
	fmt.Println(buf.Close())
	// Output:
	// 2 2 1 3
	// complete (unmapped 131072, residual 0)
}
