package cuda_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
)

// Many goroutines grow, share, write, check and shrink their own reservations on one
// backing under a tight budget, with the background refill running: no data is lost,
// no waiter hangs, and the books balance at the end.
func TestConcurrentStress(t *testing.T) {
	const workers, rounds, granules = 8, 40, 4
	gov := accounting.NewGovernor()
	auth := gov.Authority("pool", accounting.GPU(0))
	x := fakeBacking(t, cuda.FakeDriverOptions{Granularity: 64 << 10}, cuda.Options{Authority: auth, Low: 4, High: 8, Background: true})
	g := x.g
	// A shared prefix of two granules, mapped read-only by every worker.
	prefix := x.reserve(t, 2)
	require.NoError(t, x.b.Commit(prefix, 0, 2*g))
	want := bytes.Repeat([]byte("prefix"), 2*g/6+1)[:2*g]
	require.NoError(t, x.b.CopyIn(prefix, 0, want))
	// Enough for the prefix, the pool's Low and half the workers' peak: the rest wait.
	require.NoError(t, gov.SetLimit(accounting.GPU(0), int64((2+4+workers*granules/2)*g)))

	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			r, err := x.b.Reserve((2 + granules) * g)
			if !assert.NoError(t, err) {
				return
			}
			defer func() { assert.True(t, x.b.Unreserve(r).OK()) }()
			if !assert.NoError(t, x.b.Share(r, 0, prefix, 0, 2*g, backing.ReadOnly)) {
				return
			}
			for round := range rounds {
				n := 1 + rng.IntN(granules)
				if !assert.NoError(t, x.b.CommitCtx(context.Background(), r, 2*g, n*g)) {
					return
				}
				stamp := []byte{byte(w), byte(round), 0xC5}
				last := 2*g + n*g - len(stamp)
				assert.NoError(t, x.b.CopyIn(r, last, stamp))
				got := make([]byte, len(stamp))
				assert.NoError(t, x.b.CopyOut(got, r, last))
				assert.Equal(t, stamp, got)
				head := make([]byte, 64)
				assert.NoError(t, x.b.CopyOut(head, r, g-32))
				assert.Equal(t, want[g-32:g+32], head, "the shared prefix through worker %d", w)
				if !assert.NoError(t, x.b.Decommit(r, 2*g, n*g)) {
					return
				}
				if rng.IntN(8) == 0 {
					_, err := x.b.Trim(rng.IntN(4))
					assert.NoError(t, err)
				}
			}
		}()
	}
	wg.Wait()
	assert.Zero(t, gov.Stats(accounting.GPU(0)).Waiters)
	// The last commits nudged the background refill, which may be creating a handle
	// (charged, not yet counted by the pool): let it land before reading the books.
	x.b.Quiesce()
	x.checkBooks(t, "after the workers")
	require.True(t, x.b.Unreserve(prefix).OK())
}
