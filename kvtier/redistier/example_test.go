package redistier_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// ExampleNew makes a tier over a client of the caller's, here of a server that is
// not running: a load fails and a store is dropped, both counted, and the calls
// after them fail at once while the tier backs off. The cache counts all of them as
// misses and goes on.
func ExampleNew() {
	client := redis.NewClient(&redis.Options{
		Addr:                  "127.0.0.1:1", // nothing listens here
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
	})
	defer client.Close()
	tier, err := redistier.New(client, redistier.Options{Prefix: "example:", Timeout: 200 * time.Millisecond, Backoff: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx := context.Background()
	key := tierval.Key{Namespace: 1, Hash: 2}
	fmt.Println(tier.Key(key))

	err = tier.Load(ctx, key, func([]byte) error { return nil })
	fmt.Println("load failed:", err != nil, "a miss:", errors.Is(err, kv.ErrTierMiss))
	err = tier.Store(ctx, key, 3, func(dst []byte) error { copy(dst, "kv!"); return nil })
	fmt.Println("store backing off:", errors.Is(err, redistier.ErrUnavailable))
	st := tier.Stats()
	fmt.Printf("errors %d, dropped stores %d, back-offs %d\n", st.Errors, st.DroppedStores, st.Backoffs)
	// Output:
	// example:0000000000000001:0000000000000002
	// load failed: true a miss: false
	// store backing off: true
	// errors 2, dropped stores 1, back-offs 1
}
