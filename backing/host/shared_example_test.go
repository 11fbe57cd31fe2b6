//go:build linux || windows

package host_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

// A prompt prefix is committed once and mapped read-only into a sequence's range:
// the pool owns it once, and the ledger attributes both mappings.
func ExampleNewShared() {
	gov := accounting.NewGovernor()
	ledger := gov.Authority("kv", accounting.HostKey)
	s, err := host.NewShared(host.SharedOptions{Authority: ledger}) // 2 MiB granules
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	g := s.Granularity()

	prefix, _ := s.Reserve(4 * g)
	defer s.Unreserve(prefix)
	_ = s.Commit(prefix, 0, g)
	_ = s.CopyIn(prefix, 0, []byte("You are a helpful assistant."))

	seq, _ := s.Reserve(8 * g)
	defer s.Unreserve(seq)
	_ = s.Share(seq, 0, prefix, 0, g, backing.ReadOnly) // the sequence starts with the prefix
	_ = s.Commit(seq, g, g)                             // and grows into its own granule

	head := make([]byte, 28)
	_ = s.CopyOut(head, seq, 0)
	fmt.Printf("%s\n", head)
	st := ledger.Stats()
	fmt.Printf("owned %d MiB, mapped %d MiB\n", st.Owned>>20, st.Mapped>>20)
	fmt.Println(s.CopyIn(seq, 0, []byte("x")) != nil) // the shared prefix is read-only here
	// Output:
	// You are a helpful assistant.
	// owned 4 MiB, mapped 6 MiB
	// true
}

// Decommitted granules stay in the pool, resident, for the next commit.
func ExampleShared_Prefill() {
	gov := accounting.NewGovernor()
	s, err := host.NewShared(host.SharedOptions{Authority: gov.Authority("kv", accounting.HostKey)})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	_ = s.Prefill(2) // off the token path
	p := s.PoolStats()
	fmt.Println("idle", p.Idle>>20, "MiB, resident", p.Resident>>20, "MiB")

	r, _ := s.Reserve(2 * s.Granularity())
	_ = s.Commit(r, 0, 2*s.Granularity()) // maps the prefilled granules
	p = s.PoolStats()
	fmt.Println("idle", p.Idle>>20, "MiB, mapped", p.Mapped>>20, "MiB, owned", p.Owned>>20, "MiB")
	fmt.Println(s.Unreserve(r))
	n, _ := s.Trim(0)
	fmt.Println("trimmed", n>>20, "MiB")
	// Output:
	// idle 4 MiB, resident 4 MiB
	// idle 0 MiB, mapped 4 MiB, owned 4 MiB
	// complete (unmapped 4194304, residual 0)
	// trimmed 4 MiB
}
