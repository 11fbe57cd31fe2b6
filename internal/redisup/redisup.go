// Package redisup waits for a redis-server that its caller started (the example's
// -tiers redis and redistier's tests) to answer, so that both start servers alike.
package redisup

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Errors of Wait.
var (
	// ErrExited: the server exited before it answered PING.
	ErrExited = errors.New("redisup: redis-server exited before it answered PING")
	// ErrNoAnswer: the server did not answer PING within the wait.
	ErrNoAnswer = errors.New("redisup: redis-server did not answer PING")
	// ErrWait: the wait is not positive.
	ErrWait = errors.New("redisup: the wait must be positive")
)

// Poll is the interval between two PINGs, and PingTimeout bounds one.
const (
	Poll        = 20 * time.Millisecond
	PingTimeout = time.Second
)

// Wait returns nil once the server on addr answers PING, ErrExited once exited is
// closed first (the caller closes it when the process it started exits), or
// ErrNoAnswer joined with the last PING's error once within has passed. A within that
// is not positive is ErrWait, at once.
func Wait(addr string, exited <-chan struct{}, within time.Duration) error {
	if within <= 0 {
		return fmt.Errorf("%w: %v", ErrWait, within)
	}
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), min(PingTimeout, within))
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("%w: %s", ErrExited, addr)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w on %s within %v: %w", ErrNoAnswer, addr, within, err)
		}
		time.Sleep(Poll)
	}
}
