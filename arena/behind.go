package arena

import (
	"fmt"
)

// Leaving behind: a buffer whose owner gives back the granules below a point (a
// sliding window's, which DecommitBelow gives back) may instead leave them behind,
// for another goroutine to give back, so that the owner's call makes no backing
// call. The run so left is in a state of its own, between Committed and Reserved:
//
//  1. Committed: the buffer's granules of [Start, end).
//  2. Behind: LeaveBehind moves granules from the start of the committed run out of
//     the buffer, as DecommitBelow does (Start, Committed and every view are as after
//     it, and touching them is the caller's bug), but with no backing call: they stay
//     committed in the backing, owned and charged.
//  3. Reserved: DecommitBehind gives the run back, on any goroutine.
//
// A buffer holds at most one run behind, in one atomic word as its run ahead (see
// ahead.go); LeaveBehind grows it while it ends at Start. DecommitBehind touches no
// other mutable field of the buffer, so it may run concurrently with the owner's
// calls, and the word makes a broken protocol fail (ErrBehindBusy, ErrBehind) rather
// than give a granule back twice or commit over one.

// behindBusy marks the run behind while DecommitBehind gives it back; the word keeps
// the run's place meanwhile (bit 31 of its size field, which is below 2^31), so that
// a growth elsewhere goes on.
const behindBusy = 1 << 31

// unpackBehind unpacks the behind word, busy or not.
func (buf *Buffer[R, B]) unpackBehind(v int64) (off, size int, busy bool) {
	off, size = buf.unpackAhead(v &^ behindBusy)
	return off, size, v&behindBusy != 0
}

// Behind returns the run left behind and not given back: its offset and size, or
// size 0 when there is none (or while DecommitBehind gives it back).
func (buf *Buffer[R, B]) Behind() (off, size int) {
	if off, size, busy := buf.unpackBehind(buf.behind.Load()); !busy {
		return off, size
	}
	return 0, 0
}

// LeaveBehind moves the whole granules of [Start, off) out of the buffer as
// DecommitBelow does, with no backing call: Start becomes off rounded down to the
// granule, and the granules join the buffer's run behind, committed in the backing
// and charged (under ByBuffer, to the authority) until DecommitBehind gives them
// back; granules that map another buffer's (ShareRange) leave Shared and stay mapped
// until then, and only their mapping goes then, as with DecommitBelow. off must be
// in [0, Len]. It reports whether the granules are left behind (or there are none:
// an off at or below Start changes nothing). It leaves nothing and reports false
// where the run behind does not end at Start or is being given back right now: the
// caller then gives them back with DecommitBelow. Only the owner calls it. On error
// or false nothing changed.
func (buf *Buffer[R, B]) LeaveBehind(off int) (bool, error) {
	buf.live()
	if off < 0 || off > buf.length {
		return false, fmt.Errorf("%w: leave behind the bytes below %d of a buffer of length %d", ErrInvalidSize, off, buf.length)
	}
	to := off - off%buf.gran
	if to <= buf.start {
		return true, nil
	}
	from := buf.start
	v := buf.behind.Load()
	if v != 0 {
		boff, size, busy := buf.unpackBehind(v)
		if busy || boff+size != buf.start {
			return false, nil
		}
		from = boff
	}
	if (to/buf.gran)>>31 != 0 {
		return false, nil // NB: the word holds runs below 2^31 granules
	}
	if !buf.behind.CompareAndSwap(v, buf.packAhead(from, to-from)) {
		return false, nil // NB: DecommitBehind took the run meanwhile
	}
	buf.start = to
	buf.clipShared() // NB: shared granules left behind are unmapped here only, when given back
	return true, nil
}

// DecommitBehind moves the buffer's run behind (LeaveBehind) back to Reserved: under
// ByBuffer its charge goes back to the authority. It returns the bytes given back: 0
// when there is none. It may run on any goroutine, concurrently with the owner's
// calls; it fails with ErrBehindBusy while another DecommitBehind gives the run
// back. On error nothing changed.
func (buf *Buffer[R, B]) DecommitBehind() (int, error) {
	v := buf.behind.Load()
	switch {
	case v == 0:
		return 0, nil
	case v&behindBusy != 0 || !buf.behind.CompareAndSwap(v, v|behindBusy):
		return 0, fmt.Errorf("%w: decommit behind", ErrBehindBusy)
	}
	off, size, _ := buf.unpackBehind(v)
	if err := buf.decommit(off, off+size); err != nil {
		buf.behind.Store(v)
		return 0, err
	}
	buf.behind.Store(0)
	return size, nil
}

// behindClear returns ErrBehind when committing [from, to) would cover the run left
// behind (ErrBehindBusy while DecommitBehind gives it back).
func (buf *Buffer[R, B]) behindClear(from, to int) error {
	v := buf.behind.Load()
	if v == 0 || from >= to {
		return nil
	}
	off, size, busy := buf.unpackBehind(v)
	switch {
	case to <= off || off+size <= from:
		return nil
	case busy:
		return fmt.Errorf("%w: commit [%d, %d) over the run at [%d, %d) being given back", ErrBehindBusy, from, to, off, off+size)
	}
	return fmt.Errorf("%w: commit [%d, %d) over the run left behind at [%d, %d): decommit it first", ErrBehind, from, to, off, off+size)
}
