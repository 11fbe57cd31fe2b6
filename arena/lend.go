package arena

import (
	"fmt"

	"github.com/vmarena/vmarena/backing"
)

// Lend lets the process numbered to borrow the physical granules behind the
// buffer's bytes [off, off+size) and returns their ids, in order (see
// backing.Lender.Lend). off and size must be multiples of the granule and the range
// must lie within the committed bytes [Start, Start+Committed); the buffer is left as
// it was. The granules stay charged to this process until the borrower's last
// mapping of them goes, also after this buffer decommits them. On a backing that is
// not a backing.Lender it returns an error matching ErrNoLending.
func (buf *Buffer[R, B]) Lend(off, size int, to uint64) ([]uint64, error) {
	buf.live()
	l, ok := any(buf.b).(backing.Lender[R])
	if !ok {
		return nil, fmt.Errorf("%w: %T", ErrNoLending, buf.b)
	}
	switch {
	case off < 0 || size < 0 || off%buf.gran != 0 || size%buf.gran != 0:
		return nil, fmt.Errorf("%w: lend [%d, +%d) is not granule-aligned (%d-byte granule)", ErrInvalidSize, off, size, buf.gran)
	case off < buf.start || off > buf.end-size:
		return nil, fmt.Errorf("%w: lend [%d, +%d) outside the committed bytes [%d, %d)", ErrInvalidSize, off, size, buf.start, buf.end)
	case size == 0:
		return nil, nil
	}
	return l.Lend(buf.r, off, size, to)
}

// BorrowRange moves [dstOff, dstOff+len(ids)×granule) of this buffer from Reserved
// to Committed by mapping, read-only, the granules another process lent to this one
// (backing.Lender.Borrow), and sets Len to the range's end. dstOff must be a
// multiple of the granule and the committed bytes stay one run, as for ShareRange:
// the buffer must have none (Start becomes dstOff) or end them exactly at dstOff.
// The bytes count as Shared: the lender owns them. On a backing that is not a
// backing.Lender it returns an error matching ErrNoLending. On error nothing
// changed.
func (buf *Buffer[R, B]) BorrowRange(dstOff int, ids []uint64) error {
	buf.live()
	l, ok := any(buf.b).(backing.Lender[R])
	if !ok {
		return fmt.Errorf("%w: %T", ErrNoLending, buf.b)
	}
	size := len(ids) * buf.gran
	switch {
	case buf.end > buf.start && dstOff != buf.end:
		return fmt.Errorf("%w: borrow at %d, but [%d, %d) is committed: a borrow must start where the committed bytes end", ErrNotEmpty, dstOff, buf.start, buf.end)
	case dstOff < 0 || dstOff%buf.gran != 0:
		return fmt.Errorf("%w: borrow at %d is not granule-aligned (%d-byte granule)", ErrInvalidSize, dstOff, buf.gran)
	case len(ids) > buf.capacity/buf.gran || dstOff > buf.capacity-size:
		return fmt.Errorf("%w: borrow of %d granules at %d, capacity %d", ErrCapacity, len(ids), dstOff, buf.capacity)
	case size == 0:
		return nil
	}
	if err := buf.behindClear(dstOff, dstOff+size); err != nil {
		return err
	}
	if err := l.Borrow(buf.r, dstOff, ids); err != nil {
		return err
	}
	buf.mapped(dstOff, size)
	return nil
}
