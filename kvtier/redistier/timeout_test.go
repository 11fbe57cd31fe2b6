package redistier_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// silentServer accepts connections on 127.0.0.1 and reads them without ever
// answering: a server that hangs, which only a timeout gets a call out of.
func silentServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(io.Discard, c) })
		}
	})
	t.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().String()
}

// TestTimeout checks the per-call timeout against a server that never answers: the
// call fails (not a miss) and starts a back-off; a call the caller's own context
// ends first fails with the caller's error and starts none.
func TestTimeout(t *testing.T) {
	addr := silentServer(t)
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	key := tierval.Key{Hash: 1}

	caller := newTier(t, c, redistier.Options{Timeout: time.Minute, Backoff: time.Hour})
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	err := caller.Load(short, key, func([]byte) error { return nil })
	require.ErrorIs(t, err, context.DeadlineExceeded, "the caller's deadline ended the call")
	assert.Zero(t, caller.Stats().Backoffs, "the caller's own deadline is no failure of the server")
	assert.Equal(t, int64(1), caller.Stats().Errors)

	tier := newTier(t, c, redistier.Options{Timeout: 50 * time.Millisecond, Backoff: time.Hour})
	used := false
	err = tier.Load(ctx, key, func([]byte) error { used = true; return nil })
	require.Error(t, err, "the tier's timeout ended the call")
	assert.False(t, used)
	assert.NotErrorIs(t, err, kv.ErrTierMiss)
	assert.NotErrorIs(t, err, redistier.ErrUnavailable, "the first call reached the network")
	assert.Equal(t, int64(1), tier.Stats().Backoffs, "the timeout started a back-off")
	err = tier.Store(ctx, key, 4, func([]byte) error { return nil })
	assert.True(t, errors.Is(err, redistier.ErrUnavailable), "a store while backing off: %v", err)
	assert.Equal(t, int64(1), tier.Stats().DroppedStores)
}
