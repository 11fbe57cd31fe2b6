package accounting

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// What the governor counts and logs for whoever watches it: cumulative counters in
// every DeviceStats, and events on an optional slog.Logger.

// DefaultSlowWait is GovernorOptions.SlowWait's default.
const DefaultSlowWait = time.Second

// GovernorOptions configures NewGovernorWith. The zero value gives NewGovernor's
// governor.
type GovernorOptions struct {
	// Logger receives the governor's events: a quarantine (Authority.Quarantine), at
	// Warn, and an Acquire that waited SlowWait or longer, at Info. nil logs nothing.
	Logger *slog.Logger
	// SlowWait is the shortest wait that is logged. 0 means DefaultSlowWait; it must
	// not be negative.
	SlowWait time.Duration
}

// NewGovernorWith returns a governor with no budgets set, as NewGovernor does, that
// logs to opts.Logger. It returns an *InvalidRequestError for a negative SlowWait.
func NewGovernorWith(opts GovernorOptions) (*Governor, error) {
	if opts.SlowWait < 0 {
		return nil, &InvalidRequestError{Reason: fmt.Sprintf("negative SlowWait %v", opts.SlowWait)}
	}
	if opts.SlowWait == 0 {
		opts.SlowWait = DefaultSlowWait
	}
	g := NewGovernor()
	g.log, g.slowWait = opts.Logger, opts.SlowWait
	return g, nil
}

// waitBuckets are the upper bounds of DeviceCounters.WaitsWithin.
var waitBuckets = [...]time.Duration{
	time.Millisecond, 5 * time.Millisecond, 25 * time.Millisecond, 100 * time.Millisecond,
	500 * time.Millisecond, 2500 * time.Millisecond, 10 * time.Second, time.Minute,
}

// NumWaitBuckets is the length of DeviceCounters.WaitsWithin.
const NumWaitBuckets = len(waitBuckets)

// WaitBuckets returns the upper bounds of DeviceCounters.WaitsWithin, shortest first.
func WaitBuckets() []time.Duration { return waitBuckets[:] }

// DeviceCounters are one device's cumulative counters since the governor was made.
// They only grow; rates and ratios are for whoever reads them twice.
type DeviceCounters struct {
	// Waits is the Acquire calls that queued and have stopped waiting: granted,
	// refused (the limit shrank under them) or ended by their context.
	Waits int64
	// WaitTime is the time those calls spent queued, in all.
	WaitTime time.Duration
	// WaitsWithin[i] is the Waits that ended within WaitBuckets()[i]; each count
	// includes the shorter ones.
	WaitsWithin [NumWaitBuckets]int64
	// Refusals is the requests refused with a *BudgetError: by the governor
	// (TryAcquire, Acquire) and by takers that check the budget themselves and report
	// their refusals with Governor.Refuse (a KV cache's refused growths).
	Refusals int64
	// Quarantines is the quarantines reported with Authority.Quarantine, and
	// QuarantinedBytes the bytes they left behind.
	Quarantines      int64
	QuarantinedBytes int64
}

// waited counts a wait of dur that has ended. g.mu must be held.
func (c *DeviceCounters) waited(dur time.Duration) {
	c.Waits++
	c.WaitTime += dur
	for i, b := range waitBuckets {
		if dur <= b {
			c.WaitsWithin[i]++
		}
	}
}

// endWait counts the end of an Acquire that queued at start for n bytes and logs it
// when it took SlowWait or longer. g.mu must not be held.
func (g *Governor) endWait(d *device, n int64, start time.Time, err error) {
	dur := time.Since(start)
	g.mu.Lock()
	d.counters.waited(dur)
	g.mu.Unlock()
	if g.log == nil || dur < g.slowWait {
		return
	}
	outcome := "granted"
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		outcome = "abandoned"
	case err != nil:
		outcome = "refused"
	}
	g.log.Info("accounting: slow budget wait", "device", d.key.String(), "bytes", n,
		"waited", dur, "outcome", outcome)
}

// Quarantine records that a release of memory this ledger holds failed midway (a
// Quarantined ReleaseOutcome) and left n bytes behind that can not be given back: it
// counts them in the device's DeviceCounters and logs them at Warn with cause. It
// changes no owned or mapped bytes: the residual stays where it was. The owner of the
// residual bytes reports it: a pooling backing (ByBacking) for its reservations, the
// buffer (arena) under ByBuffer. A negative n panics.
func (a *Authority) Quarantine(n int64, cause error) {
	if n < 0 {
		panic(fmt.Sprintf("accounting: Quarantine of negative size %d", n))
	}
	a.g.mu.Lock()
	a.d.counters.Quarantines++
	a.d.counters.QuarantinedBytes += n
	a.g.mu.Unlock()
	if a.g.log != nil {
		a.g.log.Warn("accounting: quarantine", "authority", a.name, "device", a.d.key.String(),
			"bytes", n, "cause", cause)
	}
}
