package snapshot_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/snapshot"
)

// A server's sessions share one budget: a snapshot that would take more is refused
// and only that session loses its cache.
func ExampleFactory() {
	g := accounting.NewGovernor()
	_ = g.SetLimit(accounting.HostKey, 8<<20) // 8 MiB for every session together
	f, err := snapshot.NewFactory(g, snapshot.Options{})
	if err != nil {
		panic(err)
	}
	defer f.Close()
	ctx := context.Background()

	a, _ := f.New(ctx)
	defer a.Close()
	b, _ := f.New(ctx)
	defer b.Close()

	buf, _ := a.Prepare(ctx, 5<<20) // the session's serialized state
	copy(buf, "state of session a")
	_ = a.Commit(ctx, len(buf))

	_, err = b.Prepare(ctx, 5<<20)
	fmt.Println("b refused:", errors.Is(err, accounting.ErrBudgetExceeded), "b holds", b.Cap())

	_ = a.Reset(ctx) // a's conversation ended: its memory goes back
	_, err = b.Prepare(ctx, 5<<20)
	fmt.Println("b now:", err, "holds", b.Cap()>>20, "MiB")
	// Output:
	// b refused: true b holds 0
	// b now: <nil> holds 6 MiB
}

// A Store's snapshot grows turn by turn on one base address.
func ExampleStore_Prepare() {
	f, err := snapshot.NewFactory(accounting.NewGovernor(), snapshot.Options{})
	if err != nil {
		panic(err)
	}
	defer f.Close()
	ctx := context.Background()
	s, _ := f.New(ctx)
	defer s.Close()

	var base uintptr
	for turn := 1; turn <= 3; turn++ {
		buf, _ := s.Prepare(ctx, turn*3<<20)
		if turn == 1 {
			base = s.Base()
		}
		buf[len(buf)-1] = byte(turn)
		_ = s.Commit(ctx, len(buf))
		fmt.Printf("turn %d: %d MiB snapshot, %d MiB held, same base: %v\n", turn, s.Len()>>20, s.Cap()>>20, s.Base() == base)
	}
	_ = s.Reset(ctx)
	fmt.Println("after Reset:", s.Len(), s.Cap())
	// Output:
	// turn 1: 3 MiB snapshot, 4 MiB held, same base: true
	// turn 2: 6 MiB snapshot, 6 MiB held, same base: true
	// turn 3: 9 MiB snapshot, 10 MiB held, same base: true
	// after Reset: 0 0
}
