//go:build !linux

package nodepool

import (
	"context"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// Owner owns the node's memory; on this system there is none to own (no memfd).
type Owner struct{}

// Client is a process attached to an Owner; on this system none can attach.
type Client struct{}

// Reservation is a reserved address range of a Client.
type Reservation struct{}

var errUnsupported = fmt.Errorf("nodepool: a node pool needs memfd (Linux): %w", backing.ErrUnsupported)

// Listen validates its arguments, then returns an error wrapping
// errors.ErrUnsupported: a node pool needs Linux.
func Listen(path string, opts OwnerOptions) (*Owner, error) {
	if _, err := listenOptions(path, opts); err != nil {
		return nil, err
	}
	return nil, errUnsupported
}

// Attach validates its arguments, then returns an error wrapping
// errors.ErrUnsupported: a node pool needs Linux.
func Attach(path string, opts ClientOptions) (*Client, error) {
	if _, err := attachOptions(path, opts); err != nil {
		return nil, err
	}
	return nil, errUnsupported
}

func (o *Owner) Governor() *accounting.Governor { return nil }
func (o *Owner) Path() string                   { return "" }
func (o *Owner) Granularity() int               { return 0 }
func (o *Owner) Stats() NodeStats               { return NodeStats{} }
func (o *Owner) Close() error                   { return nil }

func (c *Client) Err() error                                 { return errUnsupported }
func (c *Client) Usage() (Usage, error)                      { return Usage{}, errUnsupported }
func (c *Client) Number() uint64                             { return 0 }
func (c *Client) Close() error                               { return nil }
func (c *Client) Granularity() int                           { return 0 }
func (c *Client) Device() accounting.DeviceKey               { return accounting.HostKey }
func (c *Client) Accounting() backing.PhysicalAccounting     { return backing.ByBuffer() }
func (c *Client) HostAccessible() bool                       { return true }
func (c *Client) CommitZeroes() bool                         { return true }
func (c *Client) Reserve(size int) (*Reservation, error)     { return nil, errUnsupported }
func (c *Client) Base(r *Reservation) uintptr                { return 0 }
func (c *Client) Size(r *Reservation) int                    { return 0 }
func (c *Client) Commit(r *Reservation, off, size int) error { return errUnsupported }
func (c *Client) CommitCtx(ctx context.Context, r *Reservation, off, size int) error {
	return errUnsupported
}
func (c *Client) Decommit(r *Reservation, off, size int) error { return errUnsupported }
func (c *Client) Unreserve(r *Reservation) accounting.ReleaseOutcome {
	return accounting.FailedRelease(0, errUnsupported)
}
func (c *Client) Share(dst *Reservation, dstOff int, src *Reservation, srcOff, size int, prot backing.Protection) error {
	return errUnsupported
}
func (c *Client) Protect(r *Reservation, off, size int, prot backing.Protection) error {
	return errUnsupported
}
func (c *Client) CopyIn(r *Reservation, off int, src []byte) error  { return errUnsupported }
func (c *Client) CopyOut(dst []byte, r *Reservation, off int) error { return errUnsupported }

func (c *Client) Lend(r *Reservation, off, size int, to uint64) ([]uint64, error) {
	return nil, errUnsupported
}
func (c *Client) Borrow(dst *Reservation, off int, ids []uint64) error { return errUnsupported }

func (c *Client) Prefill(n int) error                         { return errUnsupported }
func (c *Client) PrefillCtx(ctx context.Context, n int) error { return errUnsupported }
func (c *Client) Trim(keep int) (int64, error)                { return 0, errUnsupported }
func (c *Client) PoolStats() backing.PoolStats                { return backing.PoolStats{} }
