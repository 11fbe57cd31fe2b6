package nodepool

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
)

// Lend lets the attached process numbered to (its Client.Number) borrow the
// granules committed at [off, off+size) of r, and returns their ids for it to
// pass to Borrow. The granules must be ones this process committed, not borrowed
// ones. They stay charged to this process (owned once, mapped by many) until every
// borrower has given them back, also after this process decommits them or ends.
// The ids mean nothing to anyone else: the owner checks every borrow.
func (c *Client) Lend(r *Reservation, off, size int, to uint64) ([]uint64, error) {
	alive(r)
	c.mu.Lock()
	if err := c.check("lend", r, off, size); err != nil {
		c.mu.Unlock()
		return nil, err
	}
	ids := make([]uint64, 0, size/c.g)
	for i := off / c.g; i < (off+size)/c.g; i++ {
		m := r.m(i)
		if m.gr == nil || m.busy {
			c.mu.Unlock()
			return nil, &backing.OpError{Op: "lend", Offset: off, Size: size, Kind: backing.ErrNotCommitted,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
		if m.gr.borrowed {
			c.mu.Unlock()
			return nil, &backing.OpError{Op: "lend", Offset: off, Size: size, Kind: backing.ErrReadOnly,
				Err: fmt.Errorf("granule at %#x is borrowed: only its lender lends it", i*c.g)}
		}
		ids = append(ids, m.gr.id)
	}
	for i := off / c.g; i < (off+size)/c.g; i++ {
		// NB: for good, also if the owner refuses: a granule another process may
		// map must never carry this process's next commit.
		r.m(i).gr.lent = true
	}
	c.mu.Unlock()
	for k := 0; k < len(ids); k += maxBatch {
		batch := ids[k:min(k+maxBatch, len(ids))]
		id, ch, err := c.send(msg{op: opLend, a: to, ids: batch})
		if err != nil {
			return nil, &backing.OpError{Op: "lend", Offset: off, Size: size, Err: err}
		}
		rep, err := c.wait(context.Background(), id, ch)
		if err == nil && rep.m.code != codeOK {
			err = replyError(rep.m, context.Background())
		}
		if err != nil {
			return nil, &backing.OpError{Op: "lend", Offset: off, Size: size, Err: err}
		}
	}
	return ids, nil
}

// Borrow moves [off, off+len(ids)×granule) of dst from Reserved to Committed by
// mapping, read-only, granules another process lent to this one (Lend): the same
// physical memory, no copy. The owner passes each as a descriptor opened read-only,
// so no call can make the mapping writable; Protect and Share ask nothing more of
// them than of a granule shared ReadOnly. Borrowed granules add to this process's
// Mapped, not to its Owned: the lender is charged. A granule can be borrowed once
// per process; map it again with Share. A granule whose lender gave it back before
// the borrow fails it with ErrLoanGone, one this process borrows already with
// ErrBorrowed (both with backing.ErrNotLent), and the connection stays: the owner
// ends it only for a granule never lent to this process. On error nothing changed,
// also for the granules of ids that came before the one refused.
func (c *Client) Borrow(dst *Reservation, off int, ids []uint64) error {
	alive(dst)
	size := len(ids) * c.g
	c.mu.Lock()
	if err := c.check("borrow", dst, off, size); err != nil {
		c.mu.Unlock()
		return err
	}
	first, n := off/c.g, len(ids)
	for i := first; i < first+n; i++ {
		if m := dst.m(i); m.gr != nil || m.busy {
			c.mu.Unlock()
			return &backing.OpError{Op: "borrow", Offset: off, Size: size, Kind: backing.ErrCommitted,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
	}
	for i := first; i < first+n; i++ {
		dst.m(i).busy = true
	}
	c.mu.Unlock()
	opErr := func(kind, err error) error {
		return &backing.OpError{Op: "borrow", Offset: off, Size: size, Kind: kind, Err: err}
	}
	grs := make([]*granule, 0, n)
	var err error
	for k := 0; k < n && err == nil; k += maxBatch {
		batch := ids[k:min(k+maxBatch, n)]
		var id uint64
		var ch chan reply
		if id, ch, err = c.send(msg{op: opBorrow, ids: batch}); err != nil {
			break
		}
		var rep reply
		if rep, err = c.wait(context.Background(), id, ch); err != nil {
			break
		}
		if rep.m.code != codeOK {
			err = replyError(rep.m, context.Background())
			break
		}
		if len(rep.fds) != len(batch) {
			closeAll(rep.fds)
			err = fmt.Errorf("%w: %d descriptors for %d granules", ErrProtocol, len(rep.fds), len(batch))
			break
		}
		for i, fd := range rep.fds {
			grs = append(grs, &granule{id: rep.m.ids[i], fd: fd, borrowed: true})
		}
	}
	c.mu.Lock()
	mapped := 0
	if err == nil {
		for ; mapped < n; mapped++ {
			if dst.gone.Load() {
				err = errors.New("nodepool: reservation unreserved during the borrow")
				break
			}
			if err = mapGranule(addr(dst.base, off+mapped*c.g), c.g, grs[mapped].fd, true); err != nil {
				break
			}
		}
	}
	if err != nil {
		if mapped > 0 {
			_ = unmapTo(addr(dst.base, off), mapped*c.g)
		}
		for i := first; i < first+n; i++ {
			dst.m(i).busy = false
		}
		c.mu.Unlock()
		c.giveBack(grs)
		kind := error(nil)
		switch {
		case errors.Is(err, unix.ENOMEM):
			kind = backing.ErrMapLimit
		case errors.Is(err, ErrLoanGone), errors.Is(err, ErrBorrowed):
			kind = backing.ErrNotLent
		}
		return opErr(kind, err)
	}
	for i, gr := range grs {
		gr.refs = 1
		*dst.m(first + i) = mapping{gr: gr, ro: true, sharedRO: true}
	}
	dst.count += n
	c.auth.Map(int64(size))
	c.mapped += int64(size)
	c.mu.Unlock()
	return nil
}
