package nodepool

import (
	"context"
	"time"

	"golang.org/x/sys/unix"
)

// How a client reads its socket. The socket is outside Go's network poller (sock):
// one goroutine at a time, the one that holds c.rtok, reads it, blocking its thread
// in recvmsg (or in poll, when a context's end must wake it too) until a message
// comes, and hands each message to whoever waits for it.
// A request's caller takes that role while it waits for its reply, so that the
// kernel wakes the very thread that waits: no poller thread, no reading goroutine
// and no hand-off between them on the way. The watcher (watch) takes the role
// when no request has waited for syncLinger, so that the owner's own requests
// (reclaim) and its end are read while the process sends nothing; while requests
// come and go it stays away, since a reader that is not waiting for the message
// would be woken by it too. An owner's reclaim that comes meanwhile is read by the
// next request's caller, or by the watcher at the latest syncLinger after the last.

// syncLinger is how long the watcher stays away after the last request's reply.
const syncLinger = 2 * time.Millisecond

// synced counts the end of a request's wait.
func (c *Client) synced() {
	c.lastSync.Store(int64(time.Since(c.t0)))
	c.inSync.Add(-1)
}

// wait waits for the reply on ch to request id (sent by send). When ctx ends first
// it asks the owner to cancel the request and goes on waiting: the owner always
// answers an alloc, and granules it granted after all must be given back by the
// caller.
func (c *Client) wait(ctx context.Context, id uint64, ch chan reply) (reply, error) {
	defer c.synced()
	ctxDone := ctx.Done()
	canceled := false
	for {
		select {
		case r := <-ch:
			return r, nil
		case <-c.rtok:
			r, err := c.lead(ctx, id, ch, &canceled)
			c.rtok <- struct{}{}
			return r, err
		case <-ctxDone:
			ctxDone, canceled = nil, true
			_ = c.write(msg{op: opCancel, a: id})
		case <-c.goneCh:
			return c.delivered(ch)
		}
	}
}

// delivered returns a reply delivered on ch just before the connection ended, or
// why it ended.
func (c *Client) delivered(ch chan reply) (reply, error) {
	select {
	case r := <-ch:
		return r, nil
	default:
	}
	return reply{}, c.Err()
}

// lead reads the socket, holding c.rtok, until the reply to request id is on ch or
// the connection ends; it sends the cancel when ctx ends first.
func (c *Client) lead(ctx context.Context, id uint64, ch chan reply, canceled *bool) (reply, error) {
	if !*canceled && ctx.Done() != nil {
		stop := context.AfterFunc(ctx, c.c.kick)
		defer stop()
	}
	for {
		select {
		case r := <-ch:
			return r, nil
		case <-c.goneCh:
			return c.delivered(ch)
		default:
		}
		if !*canceled && ctx.Err() != nil {
			*canceled = true
			_ = c.write(msg{op: opCancel, a: id})
		}
		if *canceled || ctx.Done() == nil {
			// Nothing to watch but the socket: one blocking recvmsg, which the
			// reply, the owner's end or Close (shutdown) ends.
			n, oobn, flags, err := c.c.recv(c.rbuf, c.roob, 0)
			c.deliver(c.rbuf, c.roob, n, oobn, flags, err)
			continue
		}
		c.readSome(ch)
	}
}

// readSome waits for the socket (or a kick), then delivers the messages it holds,
// up to the one that puts a reply on mine when that is not nil. c.rtok must be
// held.
func (c *Client) readSome(mine chan reply) {
	if err := c.c.waitIn(); err != nil {
		c.deliver(nil, nil, 0, 0, 0, err)
		return
	}
	for {
		n, oobn, flags, err := c.c.recv(c.rbuf, c.roob, unix.MSG_DONTWAIT)
		if err == unix.EAGAIN {
			return
		}
		if !c.deliver(c.rbuf, c.roob, n, oobn, flags, err) || len(mine) > 0 {
			return
		}
	}
}

// watch reads the socket while no request waits (see above), until the connection
// ends or Close.
func (c *Client) watch() {
	defer close(c.done)
	t := time.NewTimer(syncLinger)
	defer t.Stop()
	for {
		// Stay away while requests come and go.
		for {
			quiet := time.Duration(int64(time.Since(c.t0)) - c.lastSync.Load())
			if c.inSync.Load() == 0 && quiet >= syncLinger {
				break
			}
			t.Reset(syncLinger - min(quiet, syncLinger-time.Microsecond))
			select {
			case <-t.C:
			case <-c.stop:
				return
			case <-c.goneCh:
				return
			}
		}
		select {
		case <-c.rtok:
		case <-c.stop:
			return
		case <-c.goneCh:
			return
		}
		for c.inSync.Load() == 0 {
			select {
			case <-c.stop:
				c.rtok <- struct{}{}
				return
			case <-c.goneCh:
				c.rtok <- struct{}{}
				return
			default:
			}
			c.readSome(nil)
		}
		c.rtok <- struct{}{}
	}
}
