package arena

import (
	"fmt"
)

// Committing ahead: a buffer's owner may have another goroutine commit the granules
// the buffer will grow into next, so that the growth itself makes no backing call.
// The run of granules so committed is in a state of its own, between Reserved and
// Committed:
//
//  1. Reserved: the buffer's address space past its committed run.
//  2. Ahead: committed in the backing (owned and charged, mapped at its place in
//     the reservation) but not part of the buffer: Len, Committed and every view
//     stay as they were, and Resize may not grow over it.
//  3. Committed: AdoptAhead makes the run, or its first granules, part of the
//     buffer, with no backing call; the rest of a run adopted in part stays Ahead.
//
// DecommitAhead takes an Ahead run back to Reserved. A buffer holds at most one run;
// its state lives in one atomic word, so CommitAhead and DecommitAhead, which touch no
// other mutable field of the buffer, may run on another goroutine than the owner's,
// concurrently with the owner's calls (the backing, which is safe for concurrent use,
// orders the system calls). The caller's protocol decides who commits, adopts and
// gives back a run; the word only makes a broken protocol fail (ErrAheadBusy,
// ErrAhead) rather than commit one granule twice.

// aheadBusy marks a run being committed or decommitted.
const aheadBusy = -1

// packAhead packs a run of size bytes at off (both in granules, below 2^31) into
// the ahead word; a run is never empty, so the word is never 0.
func (buf *Buffer[R, B]) packAhead(off, size int) int64 {
	return int64(off/buf.gran)<<32 | int64(size/buf.gran)
}

func (buf *Buffer[R, B]) unpackAhead(v int64) (off, size int) {
	return int(v>>32) * buf.gran, int(v&(1<<32-1)) * buf.gran
}

// Ahead returns the run committed ahead and not adopted: its offset and size, or
// size 0 when there is none (or while a call commits or decommits one).
func (buf *Buffer[R, B]) Ahead() (off, size int) {
	if v := buf.ahead.Load(); v > 0 {
		return buf.unpackAhead(v)
	}
	return 0, 0
}

// CommitAhead moves [off, off+size) of the buffer's reservation from Reserved to
// Ahead: it commits its granules in the backing (under ByBuffer, charged to the
// authority first) without making them part of the buffer (see AdoptAhead). off and
// size must be multiples of the granule, size positive, and the range within the
// capacity; it must lie past the committed run and stay so until the run is adopted
// or decommitted (the owner then does not shrink the buffer below off, and does not
// close it): a range the buffer has committed is refused by the backing. It may run
// on any goroutine, concurrently with the owner's calls. It fails with ErrAheadBusy
// while the buffer holds a run, or another call commits or decommits one. A refused
// or failed commit returns the error and changes nothing: a budget refusal matches
// accounting.ErrBudgetExceeded.
func (buf *Buffer[R, B]) CommitAhead(off, size int) error {
	switch {
	case off < 0 || size <= 0 || off%buf.gran != 0 || size%buf.gran != 0:
		return fmt.Errorf("%w: commit ahead [%d, +%d) is not a granule-aligned run (%d-byte granule)", ErrInvalidSize, off, size, buf.gran)
	case off > buf.capacity-size:
		return fmt.Errorf("%w: commit ahead of %d bytes at %d, capacity %d", ErrCapacity, size, off, buf.capacity)
	case (off/buf.gran)>>31 != 0 || (size/buf.gran)>>31 != 0:
		return fmt.Errorf("%w: commit ahead [%d, +%d): more than 2^31 granules", ErrInvalidSize, off, size)
	}
	if !buf.ahead.CompareAndSwap(0, aheadBusy) {
		return fmt.Errorf("%w: commit ahead [%d, +%d)", ErrAheadBusy, off, size)
	}
	if buf.auth != nil {
		if err := buf.auth.TryAcquire(int64(size)); err != nil {
			buf.ahead.Store(0)
			return err
		}
	}
	if err := buf.b.Commit(buf.r, off, size); err != nil {
		if buf.auth != nil {
			buf.auth.Release(int64(size))
		}
		buf.ahead.Store(0)
		return err
	}
	if buf.auth != nil {
		buf.auth.Map(int64(size))
	}
	buf.ahead.Store(buf.packAhead(off, size))
	return nil
}

// AdoptAhead moves the first n bytes of the buffer's Ahead run to Committed and sets
// Len to their end, with no backing call; the rest of the run, if any, stays Ahead
// from there on (Ahead then reports it), for a later AdoptAhead or DecommitAhead. n
// must be a positive multiple of the granule, at most the run's size
// (ErrInvalidSize otherwise); the run must start where the committed bytes end
// (ErrAhead otherwise, and when there is none). It fails with ErrAheadBusy while
// another goroutine commits or decommits the run. Only the owner calls it. On error
// nothing changed.
func (buf *Buffer[R, B]) AdoptAhead(n int) error {
	buf.live()
	if n <= 0 || n%buf.gran != 0 {
		return fmt.Errorf("%w: adopt %d bytes ahead (%d-byte granule)", ErrInvalidSize, n, buf.gran)
	}
	v := buf.ahead.Load()
	switch {
	case v == aheadBusy:
		return fmt.Errorf("%w: adopt", ErrAheadBusy)
	case v == 0:
		return fmt.Errorf("%w: nothing committed ahead to adopt", ErrAhead)
	}
	off, size := buf.unpackAhead(v)
	switch {
	case n > size:
		return fmt.Errorf("%w: adopt %d bytes of the %d-byte run ahead", ErrInvalidSize, n, size)
	case off != buf.end:
		return fmt.Errorf("%w: the run ahead starts at %d, the committed bytes end at %d", ErrAhead, off, buf.end)
	}
	var rest int64 // NB: 0, no run, once it is all adopted
	if n < size {
		rest = buf.packAhead(off+n, size-n)
	}
	if !buf.ahead.CompareAndSwap(v, rest) {
		return fmt.Errorf("%w: adopt", ErrAheadBusy)
	}
	if buf.end == buf.start {
		buf.start = off
	}
	buf.end = off + n
	buf.length = buf.end
	return nil
}

// DecommitAhead moves the buffer's Ahead run back to Reserved: its contents are
// forfeit and, under ByBuffer, its charge goes back to the authority. It returns the
// bytes given back: 0 when there is none. Like CommitAhead it may run on any
// goroutine; it fails with ErrAheadBusy while another call commits or decommits the
// run. On error nothing changed.
func (buf *Buffer[R, B]) DecommitAhead() (int, error) {
	v := buf.ahead.Load()
	switch {
	case v == 0:
		return 0, nil
	case v == aheadBusy || !buf.ahead.CompareAndSwap(v, aheadBusy):
		return 0, fmt.Errorf("%w: decommit ahead", ErrAheadBusy)
	}
	off, size := buf.unpackAhead(v)
	if err := buf.b.Decommit(buf.r, off, size); err != nil {
		buf.ahead.Store(v)
		return 0, err
	}
	if buf.auth != nil {
		buf.auth.Unmap(int64(size))
		buf.auth.Release(int64(size))
	}
	buf.ahead.Store(0)
	return size, nil
}

// aheadClear returns ErrAhead when growing the committed run to need bytes would
// cover a run committed ahead (ErrAheadBusy while a call commits or decommits one).
func (buf *Buffer[R, B]) aheadClear(need int) error {
	switch v := buf.ahead.Load(); {
	case v == 0:
		return nil
	case v == aheadBusy:
		return fmt.Errorf("%w: grow to %d bytes", ErrAheadBusy, need)
	default:
		if off, _ := buf.unpackAhead(v); need > off {
			return fmt.Errorf("%w: grow to %d bytes over the run committed ahead at %d: adopt or decommit it first", ErrAhead, need, off)
		}
	}
	return nil
}
