package accounting_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/vmarena/vmarena/accounting"
)

func Example() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.GPU(0), 8<<20) // 8 MiB on GPU 0
	kv := gov.Authority("kv-cache", accounting.GPU(0))

	// Take 6 MiB now; a further 4 MiB does not fit.
	_ = kv.TryAcquire(6 << 20)
	err := kv.TryAcquire(4 << 20)
	fmt.Println(errors.Is(err, accounting.ErrBudgetExceeded))

	// Wait for it instead: it is admitted once 2 MiB come back.
	go func() {
		time.Sleep(10 * time.Millisecond)
		kv.Release(2 << 20)
	}()
	if err := kv.Acquire(context.Background(), 4<<20); err != nil {
		panic(err)
	}
	// A prefix owned once but mapped into three sequences.
	kv.Map(3 * (2 << 20))
	s := gov.Stats(accounting.GPU(0))
	fmt.Printf("used %d MiB of %d, mapped %d MiB\n", s.Used>>20, s.Limit>>20, s.Mapped>>20)
	// Output:
	// true
	// used 8 MiB of 8, mapped 6 MiB
}
