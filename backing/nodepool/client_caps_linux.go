package nodepool

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
)

// Share moves [dstOff, dstOff+size) of dst from Reserved to Committed by mapping the
// granules committed at [srcOff, srcOff+size) of src, with access prot (see
// backing.Sharer). Both reservations must be this Client's: a granule is shared
// within one process here; the owner is not asked.
func (c *Client) Share(dst *Reservation, dstOff int, src *Reservation, srcOff, size int, prot backing.Protection) error {
	alive(dst, src)
	c.mu.Lock()
	defer c.mu.Unlock()
	if prot != backing.ReadOnly && prot != backing.ReadWrite {
		return &backing.OpError{Op: "share", Offset: dstOff, Size: size, Kind: backing.ErrInvalidRange,
			Err: fmt.Errorf("nodepool: unknown protection %d", prot)}
	}
	if err := c.check("share", src, srcOff, size); err != nil {
		return err
	}
	if err := c.check("share", dst, dstOff, size); err != nil {
		return err
	}
	sf, df, n := srcOff/c.g, dstOff/c.g, size/c.g
	for i := range n {
		if s := src.m(sf + i); s.gr == nil || s.busy {
			return &backing.OpError{Op: "share", Offset: srcOff, Size: size, Kind: backing.ErrNotCommitted,
				Err: fmt.Errorf("source granule at %#x", (sf+i)*c.g)}
		}
		if d := dst.m(df + i); d.gr != nil || d.busy {
			return &backing.OpError{Op: "share", Offset: dstOff, Size: size, Kind: backing.ErrCommitted,
				Err: fmt.Errorf("destination granule at %#x", (df+i)*c.g)}
		}
	}
	ro := prot == backing.ReadOnly
	if !ro {
		for i := range n {
			if src.m(sf + i).ro {
				return &backing.OpError{Op: "share", Offset: srcOff, Size: size, Kind: backing.ErrReadOnly,
					Err: fmt.Errorf("source granule at %#x", (sf+i)*c.g)}
			}
		}
	}
	for i := range n {
		if err := mapGranule(addr(dst.base, dstOff+i*c.g), c.g, src.m(sf+i).gr.fd, ro); err != nil {
			if i > 0 {
				_ = unmapTo(addr(dst.base, dstOff), i*c.g)
			}
			kind := backing.ErrOutOfMemory
			if errors.Is(err, unix.ENOMEM) {
				kind = backing.ErrMapLimit
			}
			return &backing.OpError{Op: "share", Offset: dstOff, Size: size, Kind: kind, Err: err}
		}
	}
	for i := range n {
		gr := src.m(sf + i).gr
		gr.refs++
		*dst.m(df + i) = mapping{gr: gr, ro: ro, sharedRO: ro}
	}
	dst.count += n
	c.auth.Map(int64(size))
	c.mapped += int64(size)
	return nil
}

// Protect sets the access of the committed range [off, off+size) of r to prot, in
// place (see backing.Protector).
func (c *Client) Protect(r *Reservation, off, size int, prot backing.Protection) error {
	alive(r)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("protect", r, off, size); err != nil {
		return err
	}
	if prot != backing.ReadOnly && prot != backing.ReadWrite {
		return &backing.OpError{Op: "protect", Offset: off, Size: size, Kind: backing.ErrInvalidRange,
			Err: fmt.Errorf("nodepool: unknown protection %d", prot)}
	}
	first, n := off/c.g, size/c.g
	for i := first; i < first+n; i++ {
		if m := r.m(i); m.gr == nil || m.busy {
			return &backing.OpError{Op: "protect", Offset: off, Size: size, Kind: backing.ErrNotCommitted,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
	}
	ro := prot == backing.ReadOnly
	if !ro {
		for i := first; i < first+n; i++ {
			if r.m(i).sharedRO {
				return &backing.OpError{Op: "protect", Offset: off, Size: size, Kind: backing.ErrReadOnly,
					Err: fmt.Errorf("granule at %#x was shared read-only", i*c.g)}
			}
		}
	}
	if n > 0 {
		if err := protect(addr(r.base, off), size, ro); err != nil {
			return &backing.OpError{Op: "protect", Offset: off, Size: size, Err: err}
		}
	}
	for i := first; i < first+n; i++ {
		r.m(i).ro = ro
	}
	return nil
}

// checkCopy validates a copy of n bytes at off of r; c.mu must be held.
func (c *Client) checkCopy(op string, r *Reservation, off, n int, write bool) error {
	if r.c != c {
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrForeignReservation}
	}
	if r.gone.Load() {
		return &backing.OpError{Op: op, Offset: off, Size: n, Err: errors.New(backing.PanicUseAfterUnreserve)}
	}
	if off < 0 {
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrInvalidRange, Err: errors.New("negative offset")}
	}
	if off > r.size-n {
		return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrOutOfRange,
			Err: fmt.Errorf("reservation is %d bytes", r.size)}
	}
	if n == 0 {
		return nil
	}
	for i := off / c.g; i <= (off+n-1)/c.g; i++ {
		m := r.m(i)
		if m.gr == nil || m.busy {
			return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrNotCommitted,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
		if write && m.ro {
			return &backing.OpError{Op: op, Offset: off, Size: n, Kind: backing.ErrReadOnly,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
	}
	return nil
}

// CopyIn copies src to [off, off+len(src)) of r, which must be committed and
// writable.
func (c *Client) CopyIn(r *Reservation, off int, src []byte) error {
	alive(r)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.checkCopy("copy in", r, off, len(src), true); err != nil {
		return err
	}
	copy(bytesAt(r.base, off, len(src)), src)
	return nil
}

// CopyOut copies [off, off+len(dst)) of r, which must be committed, to dst.
func (c *Client) CopyOut(dst []byte, r *Reservation, off int) error {
	alive(r)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.checkCopy("copy out", r, off, len(dst), false); err != nil {
		return err
	}
	copy(dst, bytesAt(r.base, off, len(dst)))
	return nil
}
