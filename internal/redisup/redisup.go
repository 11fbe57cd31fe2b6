// Package redisup waits for a redis-server that its caller started (the example's
// -tiers redis and redistier's tests) to answer, so that both start servers alike.
package redisup

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
	// ErrNotOurs: the server that answers on the address is another process's (the
	// port was free when the caller chose it and was taken before the server it
	// started could listen on it): start again on another port.
	ErrNotOurs = errors.New("redisup: another process's redis-server answers on the address")
)

// Retry reports whether err, from Wait, says that the caller's server could not
// have the address: another server answers there, or the caller's exited (which a
// port taken meanwhile makes it do). A start on another port may then work.
func Retry(err error) bool {
	return errors.Is(err, ErrNotOurs) || errors.Is(err, ErrExited)
}

// Poll is the interval between two PINGs, and PingTimeout bounds one.
const (
	Poll        = 20 * time.Millisecond
	PingTimeout = time.Second
)

// Wait returns nil once the server on addr answers PING and says (INFO's
// process_id) that it is process pid, the one the caller started; ErrNotOurs when
// another process's server answers; ErrExited once exited is closed first (the caller
// closes it when the process it started exits); or ErrNoAnswer joined with the last
// PING's error once within has passed. A within that is not positive is ErrWait, at
// once. NB: a port that was free when the caller chose it may be taken by another
// process before the server listens; without the process check, the caller would
// take that process's server for its own (see Retry).
func Wait(addr string, pid int, exited <-chan struct{}, within time.Duration) error {
	if within <= 0 {
		return fmt.Errorf("%w: %v", ErrWait, within)
	}
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), min(PingTimeout, within))
		err := c.Ping(ctx).Err()
		var info string
		if err == nil {
			info, err = c.Info(ctx, "server").Result()
		}
		cancel()
		if err == nil {
			if got, ok := processID(info); !ok || got != pid {
				return fmt.Errorf("%w: %s answers as process %q, not %d", ErrNotOurs, addr, processField(info), pid)
			}
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

// processID returns the process_id field of INFO's server section.
func processID(info string) (int, bool) {
	id, err := strconv.Atoi(processField(info))
	return id, err == nil
}

// processField returns the text of INFO's process_id field, or "" without one.
func processField(info string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(line, "process_id:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}
