package nodepool

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Client is a process attached to an [Owner]: a backing.Backing whose reservations
// are this process's own address ranges and whose granules are the node's memory.
// It commits by asking the owner for granules (a memfd each, passed over the socket)
// and mapping them, and shares a granule between its reservations by mapping it
// again. It implements backing.Backing, Sharer, Protector, Waiter, Copier,
// HostAccessible and Zeroer, under ByBacking accounting on the process's authority
// (ClientOptions.Authority). A Client is safe for concurrent use.
type Client struct {
	_ nocopy.NoCopy

	c      *sock
	g      int
	number uint64
	auth   *accounting.Authority
	done   chan struct{} // closed when the watcher ends

	// Reading (client_read_linux.go): whoever holds rtok reads the socket for the
	// process, with rbuf and roob.
	rtok       chan struct{}
	rbuf, roob []byte
	inSync     atomic.Int32 // requests waiting for their replies
	lastSync   atomic.Int64 // when the last one got it, in ns since t0
	t0         time.Time

	mu      sync.Mutex
	pending map[uint64]chan reply
	nextID  uint64
	gone    error         // why the connection ended, or nil
	goneCh  chan struct{} // closed when gone is set
	closed  bool
	live    int // reservations not yet unreserved

	// The pool of idle granules (client_pool_linux.go); guarded by mu.
	pool          []*granule // idle granules, the longest idle first
	high, low     int
	decay         time.Duration // 0: off
	decaying      bool          // the scavenger runs
	reclaiming    int           // reclaims for the node under way: a granule whose last mapping goes goes back
	reclaimGot    int64         // bytes given back while reclaiming
	owned, mapped int64         // this Client's part of auth: its granules' bytes (idle too), its mappings
	created       int64         // granules charged to auth (committed new or prefilled)
	givenBack     int64         // granules given back to the owner
	reported      int           // idle granules last reported to the owner
	waiting       int           // allocations waiting on the node's budget

	rmu      sync.Mutex    // one idle report at a time
	reclaims chan msg      // the owner's reclaim requests, for the worker
	stop     chan struct{} // closed by Close: the worker and the scavenger end
	bg       sync.WaitGroup
}

// reply is a reply and the descriptors it carried.
type reply struct {
	m   msg
	fds []int
}

// granule is one granule this process holds: the owner's id and this process's
// descriptor of its memfd.
type granule struct {
	id       uint64
	fd       int
	refs     int32     // mappings in this process; guarded by Client.mu
	borrowed bool      // lent by another process: read-only, owned (charged) there
	lent     bool      // this process lent it (Lend): never pooled, never reused
	resident bool      // every page allocated (Prefill): it stays so, nothing here punches holes
	since    time.Time // when it went idle, while it is in the pool
}

// Reservation is a reserved address range of a Client. It is a handle: the Client
// owns what it points to. Its zero value is not a reservation.
type Reservation struct {
	c    *Client
	base unsafe.Pointer
	size int

	gone atomic.Bool // unreserved; set under c.mu, read without it for the misuse panic

	// guarded by c.mu
	maps  [][]mapping // per granule, in chunks of chunkLen allocated when first used
	count int         // committed granules
}

// chunkLen is the granules per chunk of Reservation.maps: a 64 GiB reservation of
// 4 KiB granules commits a little and does not pay 16 bytes for each of 16 M.
const chunkLen = 1024

// m returns granule i's mapping, allocating its chunk. c.mu must be held.
func (r *Reservation) m(i int) *mapping {
	ch := &r.maps[i/chunkLen]
	if *ch == nil {
		*ch = make([]mapping, chunkLen)
	}
	return &(*ch)[i%chunkLen]
}

// mapping is what one granule of a reservation holds.
type mapping struct {
	gr       *granule // nil: Reserved
	busy     bool     // a Commit is in flight for it
	ro       bool     // mapped read-only now
	sharedRO bool     // mapped by Share with ReadOnly: never writable here
}

// Attach connects this process to the owner listening on path. The Client MUST be
// closed with Close once every reservation is unreserved.
func Attach(path string, opts ClientOptions) (*Client, error) {
	opts, err := attachOptions(path, opts)
	if err != nil {
		return nil, err
	}
	auth := opts.Authority
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("%w: dial %s: %w", ErrOwnerGone, path, err)
	}
	hello := msg{op: opHello, id: 0, a: protocolVersion}
	// NB: an owner that refuses this peer answers before it reads anything and
	// closes, so the write may fail with the answer waiting to be read.
	_, _, werr := conn.WriteMsgUnix(hello.encode(nil), nil, nil)
	buf := make([]byte, maxMsg+1)
	oob := make([]byte, unix.CmsgSpace(4*maxBatch))
	n, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
	if oobn > 0 {
		closeRights(oob[:oobn])
	}
	if err != nil || n == 0 {
		_ = conn.Close()
		return nil, fmt.Errorf("%w: no answer to hello: %v", ErrOwnerGone, errors.Join(werr, orEOF(err)))
	}
	m, err := decode(buf[:n])
	fail := func(err error) (*Client, error) { _ = conn.Close(); return nil, err }
	switch {
	case err != nil:
		return fail(err)
	case m.op != opHello|replyBit || oobn > 0:
		return fail(fmt.Errorf("%w: answer %#x to hello", ErrProtocol, m.op))
	case m.code == codeRefused:
		return fail(fmt.Errorf("%w: the owner serves another user than uid %d", ErrPeerRefused, os.Getuid()))
	case m.code == codeClosed:
		return fail(fmt.Errorf("%w: the owner is closing", ErrOwnerGone))
	case m.code != codeOK:
		return fail(fmt.Errorf("%w: hello refused with code %d (owner speaks version %d)", ErrProtocol, m.code, m.a))
	}
	if m.a > 1<<40 || checkGranularity(int(m.a)) != nil {
		return fail(fmt.Errorf("%w: granule size %d", ErrProtocol, m.a))
	}
	sk, err := sockOf(conn, true)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOwnerGone, err)
	}
	c := &Client{c: sk, g: int(m.a), number: m.b, auth: auth, done: make(chan struct{}),
		rtok: make(chan struct{}, 1), rbuf: buf, roob: oob, t0: time.Now(),
		pending: make(map[uint64]chan reply), goneCh: make(chan struct{}),
		high: opts.High, low: opts.Low, decay: opts.Decay,
		reclaims: make(chan msg, maxQueuedReclaims), stop: make(chan struct{})}
	c.rtok <- struct{}{}
	auth.SetReclaimer(c.reclaimLocal)
	c.bg.Add(1)
	go c.reclaimWorker()
	go c.watch()
	return c, nil
}

// deliver hands one message read from the socket (n bytes and oobn of control
// data, or err) to whoever waits for it. It reports false when the connection
// ended or the owner broke the protocol: then it has failed the client.
func (c *Client) deliver(buf, oob []byte, n, oobn, flags int, err error) bool {
	if err != nil || (n == 0 && oobn == 0) {
		c.fail(fmt.Errorf("%w: %v", ErrOwnerGone, orEOF(err)))
		return false
	}
	var fds []int
	if oobn > 0 {
		fds = rights(oob[:oobn])
	}
	m, err := decode(buf[:n])
	if err == nil && m.op == opReclaim && flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) == 0 {
		// The owner's one request (client_pool_linux.go).
		if len(fds) > 0 || !c.queueReclaim(m) {
			closeAll(fds)
			c.fail(fmt.Errorf("%w: from the owner (reclaim a=%d b=%d c=%d, %d ids, %d descriptors)", ErrProtocol, m.a, m.b, m.c, len(m.ids), len(fds)))
			return false
		}
		return true
	}
	ok := err == nil && flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) == 0 && m.op&replyBit != 0
	if (m.op == opAlloc|replyBit || m.op == opBorrow|replyBit) && m.code == codeOK {
		ok = ok && len(m.ids) > 0 && len(fds) == len(m.ids)
	} else {
		ok = ok && len(fds) == 0
	}
	if m.code == codeGone || m.code == codeBorrowed {
		ok = ok && m.op == opBorrow|replyBit && len(m.ids) == 0
	}
	c.mu.Lock()
	ch := c.pending[m.id]
	delete(c.pending, m.id)
	c.mu.Unlock()
	if !ok || ch == nil {
		closeAll(fds)
		c.fail(fmt.Errorf("%w: from the owner (op %#x, code %d, %d descriptors)", ErrProtocol, m.op, m.code, len(fds)))
		return false
	}
	ch <- reply{m: m, fds: fds}
	return true
}

func orEOF(err error) error {
	if err == nil {
		return errors.New("connection closed")
	}
	return err
}

// rights returns the descriptors SCM_RIGHTS messages in oob carried.
func rights(oob []byte) []int {
	cms, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var out []int
	for _, cm := range cms {
		if fds, err := unix.ParseUnixRights(&cm); err == nil {
			out = append(out, fds...)
		}
	}
	return out
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// fail records why the connection ended and closes it. The pool's idle granules go
// (the owner that charged them is gone) and none is pooled any more.
func (c *Client) fail(err error) {
	c.mu.Lock()
	var idle []*granule
	if c.gone == nil {
		c.gone = err
		close(c.goneCh)
		idle = c.takeIdle(len(c.pool), true)
	}
	c.mu.Unlock()
	c.release(idle)
	closeAll(fdsOf(idle))
	c.c.shutdown()
	c.c.kick()
}

// send registers a request and writes it; it returns the channel its reply comes on.
func (c *Client) send(m msg) (uint64, chan reply, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, nil, ErrClosed
	}
	if c.gone != nil {
		err := c.gone
		c.mu.Unlock()
		return 0, nil, err
	}
	c.nextID++
	m.id = c.nextID
	ch := make(chan reply, 1)
	c.pending[m.id] = ch
	c.mu.Unlock()
	c.inSync.Add(1)
	if err := c.write(m); err != nil {
		c.mu.Lock()
		delete(c.pending, m.id)
		c.mu.Unlock()
		c.synced()
		return 0, nil, err
	}
	return m.id, ch, nil
}

// post sends a request that has no reply.
func (c *Client) post(m msg) error {
	c.mu.Lock()
	if c.gone != nil || c.closed {
		c.mu.Unlock()
		return ErrOwnerGone
	}
	c.nextID++
	m.id = c.nextID
	c.mu.Unlock()
	return c.write(m)
}

func (c *Client) write(m msg) error {
	var b [maxMsg]byte
	if err := c.c.send(m.encode(b[:0]), nil, time.Time{}); err != nil {
		c.fail(fmt.Errorf("%w: %v", ErrOwnerGone, err))
		return c.Err()
	}
	return nil
}

// Err returns why the connection to the owner ended (wrapping ErrOwnerGone or
// ErrProtocol), ErrClosed after Close, or nil while it is up.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	return c.gone
}

// allocate asks the owner for n granules, waiting for the node's budget until ctx
// ends when wait is true. On error it holds none.
func (c *Client) allocate(ctx context.Context, n int, wait bool) ([]*granule, error) {
	out := make([]*granule, 0, n)
	for len(out) < n {
		k := min(n-len(out), maxBatch)
		m := msg{op: opAlloc, a: uint64(k)}
		if wait {
			m.b = noDeadline
			if d, ok := ctx.Deadline(); ok {
				m.b = uint64(max(d.UnixNano(), 1))
			}
		}
		grs, err := c.alloc1(ctx, m, wait)
		if err != nil {
			c.giveBack(out)
			return nil, err
		}
		out = append(out, grs...)
	}
	return out, nil
}

func (c *Client) alloc1(ctx context.Context, m msg, wait bool) ([]*granule, error) {
	if wait {
		// While it waits a granule that goes idle here goes back to the owner, which
		// serves this allocation with it (keep).
		c.mu.Lock()
		c.waiting++
		c.mu.Unlock()
		defer func() {
			c.mu.Lock()
			c.waiting--
			c.mu.Unlock()
		}()
	}
	id, ch, err := c.send(m)
	if err != nil {
		return nil, err
	}
	if !wait {
		ctx = context.Background()
	}
	r, err := c.wait(ctx, id, ch)
	if err != nil {
		return nil, err
	}
	if r.m.code != codeOK {
		return nil, replyError(r.m, ctx)
	}
	if len(r.m.ids) != int(m.a) {
		closeAll(r.fds)
		c.fail(fmt.Errorf("%w: %d granules for %d asked", ErrProtocol, len(r.m.ids), m.a))
		return nil, c.Err()
	}
	grs := make([]*granule, len(r.fds))
	for i, fd := range r.fds {
		grs[i] = &granule{id: r.m.ids[i], fd: fd}
	}
	if ctx.Err() != nil { // granted after the cancel: not wanted now
		c.giveBack(grs)
		return nil, ctx.Err()
	}
	return grs, nil
}

// replyError turns an error reply into an error.
func replyError(m msg, ctx context.Context) error {
	switch m.code {
	case codeBudget:
		return fmt.Errorf("nodepool: the node's budget: %w", &accounting.BudgetError{Device: accounting.HostKey,
			Requested: int64(m.a), Available: int64(m.b), Limit: int64(m.c)})
	case codeCanceled:
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return context.Canceled
	case codeDeadline:
		return context.DeadlineExceeded
	case codeNoMemory:
		why := unix.Errno(m.a).Error()
		if unix.Errno(m.a) == unix.EMFILE || unix.Errno(m.a) == unix.ENFILE {
			why += " (the owner keeps a descriptor per granule: RLIMIT_NOFILE)"
		}
		return fmt.Errorf("%w: the owner could not create a granule: %s", backing.ErrOutOfMemory, why)
	case codeClosed:
		return fmt.Errorf("%w: the owner is closing", ErrOwnerGone)
	case codeGone:
		return fmt.Errorf("%w: granule %d, lent to this process, was given back by its lender before the borrow", ErrLoanGone, m.a)
	case codeBorrowed:
		return fmt.Errorf("%w: granule %d", ErrBorrowed, m.a)
	}
	return fmt.Errorf("%w: the owner answered code %d", ErrProtocol, m.code)
}

// giveBack closes the descriptors of granules mapped nowhere and returns them to
// the owner. NB: an owner that is gone has nothing left to return them to; their
// memory went with the last descriptor.
func (c *Client) giveBack(grs []*granule) {
	ids := make([]uint64, 0, min(len(grs), maxBatch))
	flush := func() {
		if len(ids) == 0 {
			return
		}
		// NB: no reply comes unless the owner refuses (and then closes): the
		// socket keeps order, so every later request is served after the free.
		_ = c.post(msg{op: opFree, ids: ids})
		ids = ids[:0]
	}
	for _, gr := range grs {
		_ = unix.Close(gr.fd)
		ids = append(ids, gr.id)
		if len(ids) == maxBatch {
			flush()
		}
	}
	flush()
}

// Usage asks the owner for the node's and this process's figures.
func (c *Client) Usage() (Usage, error) {
	id, ch, err := c.send(msg{op: opStats})
	if err != nil {
		return Usage{}, err
	}
	r, err := c.wait(context.Background(), id, ch)
	if err != nil {
		return Usage{}, err
	}
	if r.m.code != codeOK {
		return Usage{}, replyError(r.m, context.Background())
	}
	return Usage{NodeUsed: int64(r.m.a), NodeLimit: int64(r.m.b), Owned: int64(r.m.c)}, nil
}

// Number returns the client's number on its owner.
func (c *Client) Number() uint64 { return c.number }

// Close detaches from the owner. Every reservation must have been unreserved:
// otherwise Close fails with ErrBusy and changes nothing. A second Close changes
// nothing and returns ErrClosed (docs/server.md, "A second Close").
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	if c.live > 0 {
		n := c.live
		c.mu.Unlock()
		return fmt.Errorf("%w: %d reservations", ErrBusy, n)
	}
	c.closed = true
	c.auth.SetReclaimer(nil)
	idle := c.takeIdle(len(c.pool), true)
	c.mu.Unlock()
	close(c.stop)
	c.bg.Wait()
	c.release(idle)
	// NB: not posted (Client.post refuses once closed): the owner takes back
	// everything the connection held when it ends.
	closeAll(fdsOf(idle))
	c.fail(ErrClosed)
	<-c.done
	<-c.rtok // no call reads any more
	c.c.close()
	return nil
}

// Granularity returns the node's granule size.
func (c *Client) Granularity() int { return c.g }

// Device returns accounting.HostKey.
func (c *Client) Device() accounting.DeviceKey { return accounting.HostKey }

// Accounting returns ByBacking on the process's authority: it owns the granules this
// process holds and maps.
func (c *Client) Accounting() backing.PhysicalAccounting { return backing.ByBacking(c.auth) }

// HostAccessible reports true: the CPU may read and write committed memory.
func (c *Client) HostAccessible() bool { return true }

// CommitZeroes reports whether a committed granule reads as zero: true only for a
// client that keeps no pool (ClientOptions.High is ClientNoPool), whose every granule
// is a new memfd; a pooled granule keeps its last contents.
func (c *Client) CommitZeroes() bool { return c.high == 0 }

// Reserve moves size bytes of this process's address space from Unreserved to
// Reserved. It asks nothing of the owner.
func (c *Client) Reserve(size int) (*Reservation, error) {
	if err := backing.CheckReserve(size, c.g); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, &backing.OpError{Op: "reserve", Size: size, Err: ErrClosed}
	}
	r := &Reservation{c: c, size: size, maps: make([][]mapping, backing.Granules(size/c.g, chunkLen))}
	if size > 0 {
		p, err := unix.MmapPtr(-1, 0, nil, uintptr(size), unix.PROT_NONE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
		if err != nil {
			return nil, &backing.OpError{Op: "reserve", Size: size, Kind: backing.ErrOutOfMemory, Err: err}
		}
		r.base = p
	}
	c.live++
	return r, nil
}

// Base returns the first address of r.
func (c *Client) Base(r *Reservation) uintptr { alive(r); return uintptr(r.base) }

// Size returns r's size in bytes.
func (c *Client) Size(r *Reservation) int { alive(r); return r.size }

// check validates r and a range of it; c.mu must be held.
func (c *Client) check(op string, r *Reservation, off, size int) error {
	if r.c != c {
		return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrForeignReservation}
	}
	if r.gone.Load() { // unreserved by a call that raced this one's entry check
		return &backing.OpError{Op: op, Offset: off, Size: size, Err: errors.New(backing.PanicUseAfterUnreserve)}
	}
	return backing.CheckRange(op, off, size, r.size, c.g)
}

// alive panics if r was unreserved. It runs before c.mu is taken, so that the panic
// leaves the Client usable.
func alive(rs ...*Reservation) {
	for _, r := range rs {
		if r == nil {
			panic("nodepool: nil reservation")
		}
		if r.gone.Load() {
			panic(backing.PanicUseAfterUnreserve)
		}
	}
}

// Commit moves [off, off+size) of r from Reserved to Committed with granules the
// owner allocates now, if both this process's and the node's budgets cover them.
func (c *Client) Commit(r *Reservation, off, size int) error {
	return c.commit(context.Background(), r, off, size, false)
}

// CommitCtx is Commit that waits for the budget: first in the FIFO queue of this
// process's governor, then in the owner's, with ctx's deadline carried across the
// socket, until ctx ends.
func (c *Client) CommitCtx(ctx context.Context, r *Reservation, off, size int) error {
	return c.commit(ctx, r, off, size, true)
}

func (c *Client) commit(ctx context.Context, r *Reservation, off, size int, wait bool) error {
	alive(r)
	c.mu.Lock()
	if err := c.check("commit", r, off, size); err != nil {
		c.mu.Unlock()
		return err
	}
	first, n := off/c.g, size/c.g
	for i := first; i < first+n; i++ {
		if r.m(i).gr != nil || r.m(i).busy {
			c.mu.Unlock()
			return &backing.OpError{Op: "commit", Offset: off, Size: size, Kind: backing.ErrCommitted,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
	}
	for i := first; i < first+n; i++ {
		r.m(i).busy = true
	}
	c.mu.Unlock()
	unbusy := func() {
		c.mu.Lock()
		for i := first; i < first+n; i++ {
			r.m(i).busy = false
		}
		c.mu.Unlock()
	}
	if n == 0 {
		unbusy()
		return nil
	}
	opErr := func(kind, err error) error {
		return &backing.OpError{Op: "commit", Offset: off, Size: size, Kind: kind, Err: err}
	}
	// Idle granules of the pool first, then new ones from the owner. NB: a commit
	// that must wait holds nothing while it waits (see host.Shared's charge): it
	// puts its idle granules back and waits for all n, served from the pool's idle
	// granules first, in the process's FIFO queue.
	c.mu.Lock()
	picks := c.takeIdle(n, false)
	c.mu.Unlock()
	fresh := n - len(picks)
	var err error
	if fresh > 0 { // NB: idle granules are reused ahead of the queue (Authority.TakeIdle)
		err = c.auth.TryAcquire(int64(fresh * c.g))
	}
	if err != nil {
		c.putIdle(picks)
		picks = nil
		if !wait {
			unbusy()
			c.report()
			return opErr(nil, err)
		}
		var idle int64
		if idle, err = c.auth.AcquireIdle(ctx, int64(size)); err != nil {
			unbusy()
			c.report()
			return opErr(nil, err)
		}
		c.mu.Lock()
		picks = c.takeGranted(int(idle / int64(c.g)))
		c.mu.Unlock()
		fresh = n - len(picks)
	}
	var grs []*granule
	if fresh > 0 {
		grs, err = c.allocate(ctx, fresh, wait)
	}
	if err != nil {
		c.auth.Release(int64(fresh * c.g))
		c.putIdle(picks)
		unbusy()
		c.report()
		var kind error
		if errors.Is(err, backing.ErrOutOfMemory) {
			kind = backing.ErrOutOfMemory
		}
		return opErr(kind, err)
	}
	c.mu.Lock()
	c.owned += int64(fresh * c.g)
	c.created += int64(fresh)
	grs = append(picks, grs...)
	mapped := 0
	for ; mapped < n; mapped++ {
		if r.gone.Load() {
			err = errors.New("nodepool: reservation unreserved during the commit")
			break
		}
		if err = mapGranule(addr(r.base, off+mapped*c.g), c.g, grs[mapped].fd, false); err != nil {
			break
		}
	}
	if err != nil {
		if mapped > 0 {
			_ = unmapTo(addr(r.base, off), mapped*c.g)
		}
		for i := first; i < first+n; i++ {
			r.m(i).busy = false
		}
		c.owned -= int64(size)
		c.givenBack += int64(n)
		c.mu.Unlock()
		c.giveBack(grs)
		c.auth.Release(int64(size))
		c.report()
		kind := backing.ErrOutOfMemory
		if errors.Is(err, unix.ENOMEM) {
			kind = backing.ErrMapLimit // the map count: the memory exists already
			err = fmt.Errorf("mmap: %w (vm.max_map_count: one mapping per granule)", err)
		}
		return opErr(kind, err)
	}
	for i, gr := range grs {
		gr.refs = 1
		*r.m(first + i) = mapping{gr: gr}
	}
	r.count += n
	c.auth.Map(int64(size))
	c.mapped += int64(size)
	c.mu.Unlock()
	if len(picks) > 0 {
		c.report()
	}
	return nil
}

// Decommit moves [off, off+size) of r from Committed to Reserved: the contents are
// forfeit; a granule mapped nowhere else in this process goes to the pool, or back
// to the owner past ClientOptions.High, while a request of another ledger waits on
// this process's governor, or while the owner reclaims for a request that waits on
// the node. NB: the owner takes a granule back after Decommit returns (the free is sent, not
// answered): this process's later requests see it done, another process's commit
// may not yet, and should wait for the budget (CommitCtx) rather than race it.
func (c *Client) Decommit(r *Reservation, off, size int) error {
	alive(r)
	c.mu.Lock()
	if err := c.check("decommit", r, off, size); err != nil {
		c.mu.Unlock()
		return err
	}
	first, n := off/c.g, size/c.g
	for i := first; i < first+n; i++ {
		if r.m(i).gr == nil || r.m(i).busy {
			c.mu.Unlock()
			return &backing.OpError{Op: "decommit", Offset: off, Size: size, Kind: backing.ErrNotCommitted,
				Err: fmt.Errorf("granule at %#x", i*c.g)}
		}
	}
	if n > 0 {
		if err := unmapTo(addr(r.base, off), size); err != nil {
			c.mu.Unlock()
			return &backing.OpError{Op: "decommit", Offset: off, Size: size, Err: err}
		}
	}
	free := c.drop(r, first, n)
	c.mu.Unlock()
	c.giveBack(free)
	c.report()
	return nil
}

// drop forgets the n mappings of r from granule first, which are unmapped: a
// granule mapped nowhere else goes to the pool (keep) or is returned, for the caller
// to give back once it released c.mu. c.mu must be held.
func (c *Client) drop(r *Reservation, first, n int) []*granule {
	var free []*granule
	owned, pooled := 0, 0 // of the granules mapped nowhere now, those this process was charged for
	pressure := -1        // unknown
	for i := first; i < first+n; i++ {
		gr := r.m(i).gr
		if gr == nil {
			continue
		}
		*r.m(i) = mapping{}
		r.count--
		gr.refs--
		switch {
		case gr.refs == 0:
			if c.keep(gr, &pressure) {
				pooled++
				break
			}
			free = append(free, gr)
			if !gr.borrowed {
				owned++
			}
		case gr.refs < 0:
			panic("nodepool: granule mapping count below zero")
		}
		c.auth.Unmap(int64(c.g))
		c.mapped -= int64(c.g)
	}
	if owned > 0 {
		c.auth.Release(int64(owned * c.g))
		c.owned -= int64(owned * c.g)
		c.givenBack += int64(owned)
		if c.reclaiming > 0 {
			c.reclaimGot += int64(owned * c.g)
		}
	}
	if pooled > 0 {
		c.auth.PutIdle(int64(pooled * c.g))
		c.startDecay()
	}
	return free
}

// Unreserve decommits whatever is committed in r and gives back its address range.
func (c *Client) Unreserve(r *Reservation) accounting.ReleaseOutcome {
	alive(r)
	c.mu.Lock()
	if r.c != c {
		c.mu.Unlock()
		return accounting.FailedRelease(0, &backing.OpError{Op: "unreserve", Kind: backing.ErrForeignReservation})
	}
	if r.gone.Load() {
		c.mu.Unlock()
		return accounting.FailedRelease(0, &backing.OpError{Op: "unreserve", Err: errors.New(backing.PanicUseAfterUnreserve)})
	}
	held := int64(r.count * c.g)
	if r.size > 0 {
		if err := unix.MunmapPtr(r.base, uintptr(r.size)); err != nil {
			c.mu.Unlock()
			return accounting.FailedRelease(held, &backing.OpError{Op: "unreserve", Size: r.size, Err: err})
		}
	}
	var free []*granule
	for k, ch := range r.maps {
		if ch != nil {
			free = append(free, c.drop(r, k*chunkLen, min(chunkLen, r.size/c.g-k*chunkLen))...)
		}
	}
	r.gone.Store(true)
	c.live--
	c.mu.Unlock()
	c.giveBack(free)
	c.report()
	return accounting.Released(held)
}

func mapGranule(at unsafe.Pointer, g, fd int, ro bool) error {
	prot := unix.PROT_READ | unix.PROT_WRITE
	if ro {
		prot = unix.PROT_READ
	}
	_, err := unix.MmapPtr(fd, 0, at, uintptr(g), prot, unix.MAP_SHARED|unix.MAP_FIXED)
	return err
}

// unmapTo replaces [at, at+n) with fresh reserved memory. NB: not munmap, so that
// the range stays this reservation's.
func unmapTo(at unsafe.Pointer, n int) error {
	_, err := unix.MmapPtr(-1, 0, at, uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED)
	return err
}

func protect(at unsafe.Pointer, n int, ro bool) error {
	prot := unix.PROT_READ | unix.PROT_WRITE
	if ro {
		prot = unix.PROT_READ
	}
	return unix.Mprotect(bytesAt(at, 0, n), prot)
}
