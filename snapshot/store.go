package snapshot

// A Store is in one of these states:
//
//  1. Empty: Len is 0 and nothing is prepared. Cap is what stays committed from an
//     earlier snapshot (0 after Reset, after a refused Prepare, and when new).
//  2. Prepared: Prepare(size) handed out a slice of size bytes over committed
//     granules; Len is 0.
//  3. Committed: Commit(n) published the first n bytes; Len is n. Bytes returns them.
//  4. Closed: everything is given back; every call but Len and Cap returns ErrClosed.
//
// Transitions: Prepare moves any open state to Prepared on success and to Empty on
// a refusal (holding nothing) or a failure; Commit moves Prepared to Committed, and
// any state to Empty on a length outside the prepared slice; Reset moves any open
// state to Empty and gives back every granule; Close moves any open state to Closed.
// Bad arguments and a done context change nothing.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Store holds one session's snapshot in granules committed outside the Go heap, on
// a base address that stays put from its first Prepare to its Close. It implements
// the session-store contract of Kronk's sdk/kronk/kvstorage.Store (v1.32.6) with
// standard types only. Its zero value is not usable; call Factory.New.
type Store struct {
	_ nocopy.NoCopy

	f        *Factory
	buf      buffer // nil until the first Prepare that needs memory
	prepared int    // bytes of the slice the last Prepare returned; 0 when none
	closed   bool

	length    atomic.Int64 // Len
	committed atomic.Int64 // Cap
}

// live returns ErrClosed after Close, or ctx's error when ctx is done.
func (s *Store) live(ctx context.Context) error {
	if ctx == nil {
		panic(PanicNilContext)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.closed {
		return ErrClosed
	}
	return nil
}

// setLen sets Len to n and keeps the factory's sum of snapshots.
func (s *Store) setLen(n int) {
	if old := s.length.Swap(int64(n)); old != int64(n) {
		s.f.snapshots.Add(int64(n) - old)
	}
}

// syncCap sets Cap to what the buffer holds and keeps the factory's sum.
func (s *Store) syncCap() {
	var n int64
	if s.buf != nil {
		n = int64(s.buf.Committed())
	}
	if old := s.committed.Swap(n); old != n {
		s.f.committed.Add(n - old)
	}
}

// Len returns the bytes of the committed snapshot. It does no I/O and may be called
// from any goroutine.
func (s *Store) Len() int { return int(s.length.Load()) }

// Cap returns the bytes the store holds committed: the granules that cover the
// last Prepare, or 0 after Reset. A Prepare of up to Cap bytes commits nothing
// more. It does no I/O and may be called from any goroutine.
//
// NB: Cap counts whole granules, not the bytes Prepare asked, because that is how
// Kronk reads it (v1.32.6, sdk/kronk/model): as the memory a session holds.
// imcSnapshotBytes (caching_imc.go) adds it into the session's snapshot bytes that
// Kronk's server reports, and the IMC snapshot in batchgen_slot_start.go logs it
// before and after a Prepare to show whether the staging buffer grew. The
// granules are also what the budget charges: Stats.Committed is the sum of Cap.
func (s *Store) Cap() int { return int(s.committed.Load()) }

// Base returns the first address of the store's memory, 0 before its first
// Prepare. It stays the same across every Prepare, Commit and Reset until Close.
func (s *Store) Base() uintptr {
	if s.buf == nil {
		return 0
	}
	return s.buf.Base()
}

// Bytes returns the committed snapshot, Len bytes (nil when Len is 0). The slice is
// borrowed and read-only: it is valid until the next Prepare, Reset or Close, and a
// write through it changes the snapshot.
func (s *Store) Bytes(ctx context.Context) ([]byte, error) {
	if err := s.live(ctx); err != nil {
		return nil, err
	}
	n := s.Len()
	if n == 0 {
		return nil, nil
	}
	return s.buf.Bytes()[:n:n], nil
}

// Prepare starts replacing the snapshot: it returns a writable slice of exactly
// size bytes, and Len is 0 until Commit. The slice is borrowed until the next
// Prepare, Commit, Reset or Close. It commits the granules that cover size and
// gives back those past it: growth adds granules at the end of the same range,
// copying nothing, and the bytes of granules kept from the last snapshot are not
// cleared. New granules read as zero on Private; on Shared a pooled granule holds
// what an earlier snapshot of the factory's stores left there, which the caller
// overwrites before it commits.
//
// A size the budget can not cover (after waiting up to Options.WaitFor) returns
// the governor's *accounting.BudgetError, matching accounting.ErrBudgetExceeded,
// and leaves the store Empty with nothing committed, so that the bytes it held go
// to other stores: the caller loses this store's snapshot and nothing else.
// Kronk (v1.32.6, sdk/kronk/model: prepareSessionSnapshot in caching_imc.go and
// its callers in batchgen_slot_start.go) then resets the store, drops the
// session's cached prefix and serves the request by decoding it again; only where
// it stages a media snapshot in a fresh store does it end the request with the
// error. A cancelled wait returns ctx's error, and the store is Empty too.
//
// A negative size returns an error matching ErrInvalidSize, a size above the
// factory's MaxSize one matching ErrTooLarge; a done ctx returns ctx.Err(); after
// Close, ErrClosed. These change nothing.
func (s *Store) Prepare(ctx context.Context, size int) ([]byte, error) {
	if err := s.live(ctx); err != nil {
		return nil, err
	}
	switch {
	case size < 0:
		return nil, fmt.Errorf("%w: prepare of %d bytes", ErrInvalidSize, size)
	case size > s.f.maxSize:
		return nil, fmt.Errorf("%w: prepare of %d bytes, maximum %d", ErrTooLarge, size, s.f.maxSize)
	}
	s.setLen(0)
	s.prepared = 0
	if s.buf == nil {
		if size == 0 {
			return []byte{}, nil
		}
		b, err := s.f.reserve(s.f.maxSize)
		if err != nil {
			return nil, err
		}
		s.buf = b
	}
	if err := s.resize(ctx, size); err != nil {
		if errors.Is(err, accounting.ErrBudgetExceeded) {
			s.f.refusals.Add(1)
		}
		// NB: a refused or failed Resize changed nothing; the old snapshot is
		// forfeit all the same (Len is 0), so its granules go back to the budget.
		if rerr := s.buf.Resize(0); rerr != nil {
			err = errors.Join(err, fmt.Errorf("%w: %w", ErrRelease, rerr))
		}
		s.syncCap()
		return nil, err
	}
	s.syncCap()
	s.prepared = size
	if size == 0 {
		return []byte{}, nil
	}
	return s.buf.Bytes()[:size:size], nil
}

// resize sets the buffer's length to size; growth the budget refuses waits up to
// the factory's WaitFor within ctx.
func (s *Store) resize(ctx context.Context, size int) error {
	err := s.buf.Resize(size)
	if s.f.waitFor <= 0 || !accounting.CanWait(err) {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, s.f.waitFor)
	defer cancel()
	werr := s.buf.ResizeCtx(wctx, size)
	if werr != nil && ctx.Err() == nil && errors.Is(werr, context.DeadlineExceeded) {
		// The wait ran out, not the caller's context: the budget refused.
		return fmt.Errorf("%w (after waiting %v)", err, s.f.waitFor)
	}
	return werr
}

// Commit publishes the first n bytes of the prepared slice: Len becomes n and the
// prepared slice is spent. An n outside [0, prepared] returns an error matching
// ErrCommitRange and leaves Len at 0 (the prepared slice stays, as in Kronk's RAM
// store). Commit keeps the granules past n until the next Prepare or Reset. A done
// ctx returns ctx.Err() and, as after Close (ErrClosed), changes nothing.
func (s *Store) Commit(ctx context.Context, n int) error {
	if err := s.live(ctx); err != nil {
		return err
	}
	s.setLen(0)
	if n < 0 || n > s.prepared {
		return fmt.Errorf("%w: commit of %d bytes, %d prepared", ErrCommitRange, n, s.prepared)
	}
	s.setLen(n)
	s.prepared = 0
	return nil
}

// Reset clears the snapshot and gives every granule back (decommitting, not
// writing zeros): Len and Cap become 0. The address range stays reserved, so the
// next Prepare grows on the same base. A done ctx returns ctx.Err() and, as after
// Close (ErrClosed), changes nothing. When the backing can not decommit, Reset
// returns an error matching ErrRelease; Len is 0 all the same.
func (s *Store) Reset(ctx context.Context) error {
	if err := s.live(ctx); err != nil {
		return err
	}
	s.setLen(0)
	s.prepared = 0
	if s.buf == nil {
		return nil
	}
	err := s.buf.Resize(0)
	s.syncCap()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRelease, err)
	}
	return nil
}

// Close gives back everything the store holds, memory and address range. Any later
// call returns ErrClosed, a second Close included (docs/server.md, "A second
// Close"). When the backing fails and nothing changed, Close returns an error
// matching ErrRelease and the store stays open (Close may be tried again); when it
// fails midway the store is closed, the bytes the backing could not give back stay
// charged, and the error says so.
func (s *Store) Close() error {
	if s.closed {
		return ErrClosed
	}
	if s.buf != nil {
		out := s.buf.Close()
		switch out.Status {
		case accounting.Failed:
			return fmt.Errorf("%w: %v: %w", ErrRelease, out, out.Err)
		case accounting.Quarantined:
			s.finish()
			return fmt.Errorf("%w: %v: %w", ErrRelease, out, out.Err)
		}
	}
	s.finish()
	return nil
}

// finish moves the store to Closed.
func (s *Store) finish() {
	s.closed = true
	s.setLen(0)
	s.prepared = 0
	if old := s.committed.Swap(0); old != 0 {
		s.f.committed.Add(-old)
	}
	s.f.storeClosed()
}
