// Package poll is the backoff of a goroutine that polls a queue instead of being
// woken for each item: waking a parked goroutine costs the producer microseconds (a
// futex and a context switch), queueing costs it nanoseconds.
package poll

import "time"

// Backoff is the interval to a poller's next poll: Interval while items come,
// doubling after each empty poll up to MaxPolls intervals. The zero value polls
// every 0 s; set both fields.
type Backoff struct {
	Interval time.Duration
	MaxPolls int
	polls    int
}

// Next returns how long to wait before the next poll, after a poll that found
// something (busy) or nothing.
func (b *Backoff) Next(busy bool) time.Duration {
	switch {
	case busy || b.polls < 1:
		b.polls = 1
	default:
		b.polls = min(2*b.polls, b.MaxPolls)
	}
	return time.Duration(b.polls) * b.Interval
}
