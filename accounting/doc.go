// Package accounting counts physical memory honestly and decides who may have more.
//
// A [Governor] holds one byte budget per device ([DeviceKey]). Named ledgers,
// [Authority] values, take bytes against that budget: [Authority.TryAcquire] answers at
// once, [Authority.Acquire] waits in FIFO order until the bytes are free or its context
// ends. A request larger than the device's whole limit can never succeed and fails at
// once with a [*BudgetError] that matches [ErrExceedsLimit]; [CanWait] is the one
// test of whether waiting can help an error. The queue is the only place a caller
// waits for memory: [Authority.AcquireFor] waits there and hands the bytes to the
// commit it then makes, so that a waiter served is not refused by the queue behind it.
//
// An owner that keeps memory for reuse (a pool's idle granules: owned and charged,
// used by nothing) tells its ledger so with [Authority.PutIdle] and takes it back with
// [Authority.TakeIdle]. The queue serves a request of that ledger
// ([Authority.AcquireIdle], [Authority.AcquireFor]) from those idle bytes as from free
// budget, in the same FIFO order, so that memory coming back to a pool wakes its
// waiters as memory coming back to the governor does.
//
// Every ledger has two axes:
//
//   - owned bytes: physical memory the ledger holds. Owned bytes consume budget.
//   - mapped bytes: attribution only. One physical granule mapped into 64 address
//     ranges is owned once and mapped 64 times; mapped bytes never consume budget.
//
// Releasing a whole allocation reports a [ReleaseOutcome] that never lies: Complete,
// Failed (only when nothing changed) or Quarantined (something changed; it carries the
// bytes actually unmapped and the residual still owned). Whoever owns the residual
// reports it with [Authority.Quarantine].
//
// # Observing
//
// [DeviceStats] carries cumulative [DeviceCounters] (waits and their times, refusals,
// quarantines) for a scraper to rate; the metrics package exports them. A governor
// made by [NewGovernorWith] logs quarantines and waits longer than SlowWait to a
// slog.Logger; nothing is logged on a request that does not wait.
//
// # Memory management
//
// The package owns no memory. Whoever acquires bytes on an Authority MUST release
// exactly those bytes with [Authority.Release]; releasing more than is owned panics
// with a named message, since the ledger would otherwise lie. A ledger that holds
// nothing any more may be retired with [Authority.Close], which takes it off its
// device's list; it refuses while the ledger owns, maps or waits for bytes.
//
// # Concurrency
//
// A Governor and its Authorities are safe for concurrent use by many goroutines.
// Waiters are served strictly in arrival order per device: a small request does not
// overtake a large one queued before it. The governor has one lock, taken last: an
// owner may call it holding its own locks (a pool reports idle bytes under its lock),
// and it calls no owner back while it holds it (reclaimers run on goroutines of their
// own).
package accounting
