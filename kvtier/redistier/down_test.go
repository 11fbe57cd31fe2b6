package redistier_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// block is what the workers of TestServerKilled store: a value in the tier value
// format, so that a Load that returns anything but the block's own bytes is caught.
func block(i int) (tierval.Key, []int32, []byte) {
	key := tierval.Key{Namespace: 99, Hash: uint64(i)*0x9e3779b97f4a7c15 + 1}
	tokens := []int32{int32(i), int32(i + 1), int32(i + 2)}
	payload := bytes.Repeat([]byte{byte(i), byte(i >> 8)}, 2048+i%7)
	return key, tokens, payload
}

func storeBlock(ctx context.Context, tier kv.Tier, i int) error {
	key, tokens, payload := block(i)
	return tier.Store(ctx, key, tierval.Size(len(tokens), len(payload)), func(dst []byte) error {
		return tierval.Encode(dst, key, tokens, len(payload), func(p []byte) error { copy(p, payload); return nil })
	})
}

// loadBlock loads block i; a value that decodes to other bytes is errWrong.
func loadBlock(ctx context.Context, tier kv.Tier, i int) error {
	key, tokens, payload := block(i)
	return tier.Load(ctx, key, func(src []byte) error {
		got, err := tierval.Decode(src, key, tokens, len(payload))
		if err != nil || !bytes.Equal(got, payload) {
			return fmt.Errorf("%w: block %d: %v", errWrong, i, err)
		}
		return nil
	})
}

var errWrong = errors.New("a wrong value")

// TestServerKilled kills the server under a running load of stores and loads and
// starts it again: while it is down loads fail and stores are dropped, counted, and
// soon answered at once by the back-off; nothing wrong is ever loaded; after the
// restart the tier serves again.
func TestServerKilled(t *testing.T) {
	s := startServer(t, false)
	tier := newTier(t, newClient(t, s.addr()), redistier.Options{Timeout: 300 * time.Millisecond, Backoff: 50 * time.Millisecond})
	ctx := context.Background()
	for i := range 20 {
		require.NoError(t, storeBlock(ctx, tier, i))
	}

	var phase atomic.Int32 // 0 up, 1 down, 2 restarted
	var wrong, unavailable, failedWhileDown, okAfter atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for r := 0; ; r++ {
				select {
				case <-stop:
					return
				default:
				}
				i := (w*31 + r) % 40
				var err error
				if r%2 == 0 {
					err = storeBlock(ctx, tier, i)
				} else {
					err = loadBlock(ctx, tier, i)
				}
				switch {
				case errors.Is(err, errWrong):
					wrong.Add(1)
				case errors.Is(err, redistier.ErrUnavailable):
					unavailable.Add(1)
				}
				if p := phase.Load(); p == 1 && err != nil {
					failedWhileDown.Add(1)
				} else if p == 2 && (err == nil || errors.Is(err, kv.ErrTierMiss)) {
					okAfter.Add(1)
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	time.Sleep(100 * time.Millisecond)
	before := tier.Stats()
	s.kill()
	phase.Store(1)
	testutil.WaitFor(t, "calls failing while the server is down", func() bool { return failedWhileDown.Load() >= 20 && unavailable.Load() > 0 })
	down := tier.Stats()
	s.start()
	phase.Store(2)
	testutil.WaitFor(t, "calls served after the restart", func() bool { return okAfter.Load() >= 20 })
	close(stop)
	wg.Wait()
	after := tier.Stats()

	assert.Zero(t, wrong.Load(), "a Load returned another block's bytes")
	assert.Greater(t, down.DroppedStores, before.DroppedStores, "stores dropped while down")
	assert.Greater(t, down.Errors, before.Errors, "failures counted while down")
	assert.Positive(t, down.Backoffs, "a back-off started")
	assert.Greater(t, after.Stores, down.Stores, "stores kept after the restart")
	assert.Greater(t, after.Hits+after.Misses, down.Hits+down.Misses, "loads answered after the restart")

	// The restarted server kept nothing (no persistence): a block stored before the
	// kill is a miss unless a worker stored it again since.
	for i := range 40 {
		if err := loadBlock(ctx, tier, i); err != nil {
			require.ErrorIs(t, err, kv.ErrTierMiss, "block %d after the restart", i)
		}
		require.NoError(t, tier.Delete(ctx, block0Key(i)))
	}
}

func block0Key(i int) tierval.Key { k, _, _ := block(i); return k }

// TestBackoff checks the back-off on its own: after a refused connection every call
// fails at once with ErrUnavailable and is counted, and once the back-off ends the
// tier tries the network again.
func TestBackoff(t *testing.T) {
	s := startServer(t, false)
	tier := newTier(t, newClient(t, s.addr()), redistier.Options{Timeout: 300 * time.Millisecond, Backoff: time.Hour})
	ctx := context.Background()
	key := tierval.Key{Hash: 7}
	s.kill()
	err := tier.Load(ctx, key, func([]byte) error { return nil })
	require.Error(t, err)
	require.NotErrorIs(t, err, redistier.ErrUnavailable, "the first failure reached the network")
	require.NotErrorIs(t, err, kv.ErrTierMiss, "a server down is not a miss")
	used := false
	assert.ErrorIs(t, tier.Load(ctx, key, func([]byte) error { used = true; return nil }), redistier.ErrUnavailable)
	assert.False(t, used)
	assert.ErrorIs(t, tier.Store(ctx, key, 1, func([]byte) error { return nil }), redistier.ErrUnavailable)
	_, err = tier.Contains(ctx, []tierval.Key{key})
	assert.ErrorIs(t, err, redistier.ErrUnavailable)
	assert.ErrorIs(t, tier.Delete(ctx, key), redistier.ErrUnavailable)
	st := tier.Stats()
	assert.Equal(t, int64(5), st.Errors)
	assert.Equal(t, int64(1), st.Backoffs)
	assert.Equal(t, int64(1), st.DroppedStores)
	assert.Zero(t, st.Hits+st.Misses+st.Stores)

	// A tier that never backs off reaches the network on every call.
	never := newTier(t, newClient(t, s.addr()), redistier.Options{Timeout: 300 * time.Millisecond, Backoff: -1})
	for range 3 {
		err := never.Load(ctx, key, func([]byte) error { return nil })
		require.Error(t, err)
		require.NotErrorIs(t, err, redistier.ErrUnavailable)
	}
	assert.Zero(t, never.Stats().Backoffs)
}
