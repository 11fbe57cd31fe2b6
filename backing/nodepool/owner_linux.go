package nodepool

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Owner owns the node's host budget and every granule of physical memory the attached
// processes hold. Each granule is a memfd of its own, sealed against growing and
// shrinking, that the owner keeps open and passes to the one client it was allocated
// to; a client can map nothing else, whatever it sends. An Owner is safe for
// concurrent use.
type Owner struct {
	_ nocopy.NoCopy

	gov  *accounting.Governor
	g    int
	name string
	path string
	ln   *net.UnixListener
	ino  uint64        // the socket file's inode, so Close removes only its own
	uid  atomic.Uint32 // the user served (the owner's own)

	mu       sync.Mutex
	closed   bool
	clients  map[*ownerConn]struct{}    // attached (past hello)
	conns    map[*sock]struct{}         // every connection past its peer check
	refusing map[*net.UnixConn]struct{} // connections of peers refused, being answered
	number   uint64                     // last client number given
	granule  uint64                     // last granule id given
	detached uint64
	wg       sync.WaitGroup           // the accept loop and every connection
	table    map[uint64]*ownerGranule // every live granule, by id

	fresh chan int      // granules created ahead, mapped nowhere: they hold no memory
	stop  chan struct{} // closed by Close: the refill ends

	node   *accounting.Authority // owns nothing: its reclaimer is the node's (owner_reclaim_linux.go)
	rstats ReclaimStats          // guarded by mu
}

// freshGranules is how many empty granules the owner creates ahead of need, so that
// an allocation only passes descriptors. They hold no memory (a memfd's pages exist
// once written) and cost a descriptor each. NB: a granule that comes back is never
// handed out again: its former holder might still map it.
const freshGranules = 64

// ownerGranule is one live granule. It lives while its holder holds it or any
// borrower does, and stays charged to its lender (the client that allocated it)
// all that time: owned once, mapped by many.
type ownerGranule struct {
	fd        int        // the owner's read-write descriptor
	ro        int        // a read-only descriptor for its borrowers, made at its first lend; -1: none
	lender    *ownerConn // charged for it
	held      bool       // the lender still holds it
	lentTo    []uint64   // client numbers that may borrow it (at most maxLend)
	borrowers int        // clients that borrowed it and have not given it back
}

// maxLend bounds the clients one granule may be lent to.
const maxLend = 64

// maxStale bounds the gone loans the owner remembers per client (staleLoans):
// 32 KiB of ids and a map of as many entries.
const maxStale = 4096

// staleLoans are the granules lent to one client that went (their lender gave them
// back and nobody borrowed them) before it borrowed them: a borrow of one is a race
// of the application's (a stale loan), answered codeGone, not a hostile message.
// The newest maxStale are remembered by id; an older one leaves the set and raises
// below, and every gone granule at or below it reads as a gone loan too. NB: so past
// maxStale gone loans, a borrow of a gone granule never lent to the client is
// answered codeGone rather than ending the connection: it maps nothing and tells
// nothing but that the granule is gone, while remembering every gone loan would
// grow without bound for a client that never borrows what it is lent.
type staleLoans struct {
	ids   map[uint64]struct{}
	ring  []uint64 // ids in the order they went, at most maxStale
	next  int      // the oldest in ring once it is full
	below uint64   // the highest id forgotten
}

// add remembers that granule id, lent to the client, is gone.
func (s *staleLoans) add(id uint64) {
	if s.ids == nil {
		s.ids = make(map[uint64]struct{})
	}
	if _, ok := s.ids[id]; ok {
		return
	}
	if len(s.ring) < maxStale {
		s.ring = append(s.ring, id)
	} else {
		old := s.ring[s.next]
		delete(s.ids, old)
		s.below = max(s.below, old)
		s.ring[s.next] = id
		s.next = (s.next + 1) % maxStale
	}
	s.ids[id] = struct{}{}
}

// has reports whether gone granule id may have been lent to the client.
func (s *staleLoans) has(id uint64) bool {
	_, ok := s.ids[id]
	return ok || id != 0 && id <= s.below // NB: ids start at 1
}

// ownerConn is one attached process.
type ownerConn struct {
	o      *Owner
	c      *sock
	number uint64
	pid    int32
	uid    uint32
	auth   *accounting.Authority

	// guarded by o.mu
	granules map[uint64]struct{} // granules it allocated and still holds
	borrowed map[uint64]struct{} // granules lent to it that it borrowed
	pending  map[uint64]context.CancelFunc
	stale    staleLoans // granules lent to it that are gone since (lost)
	gone     bool
	ready    bool // its hello answered: the owner may send it requests
	allocs   sync.WaitGroup

	// reclaims (owner_reclaim_linux.go); guarded by o.mu
	idle      int         // granules it reports idle, at most len(granules)
	ask       *reclaimAsk // the reclaim it has not answered yet
	askNext   uint64      // the last reclaim id sent
	want      int64       // bytes asked while ask was unanswered, to ask next
	wantStage uint64
	reclaims  uint64 // reclaims sent to it
}

// Listen starts an owner on the Unix socket path: it removes a stale socket a killed
// owner left there, and fails with ErrOwnerRunning if a live owner answers on it. The
// socket is made with mode 0600 and only processes of the owner's user may attach
// (SO_PEERCRED). The Owner MUST be closed with Close, which removes the socket.
func Listen(path string, opts OwnerOptions) (*Owner, error) {
	opts, err := listenOptions(path, opts)
	if err != nil {
		return nil, err
	}
	g, name, gov := opts.Granularity, opts.Name, opts.Governor
	if err := clearStale(path); err != nil {
		return nil, err
	}
	// Bind under a temporary name, set the mode, then rename into place: nobody can
	// connect before the mode is 0600 (the uid check would refuse them anyway).
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp"+strconv.Itoa(os.Getpid()))
	_ = os.Remove(tmp)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("nodepool: listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	fail := func(err error) (*Owner, error) {
		_ = ln.Close()
		_ = os.Remove(tmp)
		return nil, err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(fmt.Errorf("nodepool: chmod %s: %w", tmp, err))
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(fmt.Errorf("nodepool: rename %s to %s: %w", tmp, path, err))
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fail(fmt.Errorf("nodepool: stat %s: %w", path, err))
	}
	o := &Owner{gov: gov, g: g, name: name, path: path, ln: ln, ino: st.Ino,
		clients: make(map[*ownerConn]struct{}), conns: make(map[*sock]struct{}),
		refusing: make(map[*net.UnixConn]struct{}),
		table:    make(map[uint64]*ownerGranule)}
	o.uid.Store(uint32(os.Getuid()))
	o.fresh, o.stop = make(chan int, freshGranules), make(chan struct{})
	o.node = gov.Authority("node reclaim", accounting.HostKey)
	o.node.SetReclaimer(o.reclaim)
	o.wg.Add(2)
	go o.accept()
	go o.refill()
	return o, nil
}

// clearStale removes a socket at path that no owner answers on.
func clearStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("nodepool: %w", err)
	}
	if fi.Mode().Type() != os.ModeSocket {
		return errorf(ErrInvalidOption, "%s exists and is not a socket", path)
	}
	c, err := net.DialTimeout("unixpacket", path, time.Second)
	if err == nil {
		_ = c.Close()
		return fmt.Errorf("%w: %s", ErrOwnerRunning, path)
	}
	if !errors.Is(err, unix.ECONNREFUSED) {
		return fmt.Errorf("nodepool: probe %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("nodepool: remove stale socket: %w", err)
	}
	return nil
}

// Governor returns the node's governor: set the node's budget on it
// (SetLimit(accounting.HostKey, n)).
func (o *Owner) Governor() *accounting.Governor { return o.gov }

// Path returns the socket path.
func (o *Owner) Path() string { return o.path }

// Granularity returns the granule size.
func (o *Owner) Granularity() int { return o.g }

// Stats returns a snapshot of the node's budget and of each attached process.
func (o *Owner) Stats() NodeStats {
	o.mu.Lock()
	defer o.mu.Unlock()
	s := NodeStats{Device: o.gov.Stats(accounting.HostKey), Granule: o.g, Detached: o.detached}
	for c := range o.clients {
		cs := ClientStats{Number: c.number, PID: c.pid, UID: c.uid, Granules: len(c.granules),
			Borrowed: len(c.borrowed), Owned: c.auth.Stats().Owned, Waiting: len(c.pending),
			Idle: c.idle, Reclaims: c.reclaims}
		s.Clients = append(s.Clients, cs)
	}
	s.Granules = len(o.table)
	s.Reclaim = o.rstats
	slices.SortFunc(s.Clients, func(a, b ClientStats) int { return int(a.Number - b.Number) })
	return s
}

// Close stops accepting, disconnects every client (their granules go back to the
// budget; what they have mapped stays valid in them until they unmap it), and
// removes the socket. A second Close changes nothing and returns ErrClosed
// (docs/server.md, "A second Close").
func (o *Owner) Close() error {
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		return ErrClosed
	}
	o.closed = true
	o.node.SetReclaimer(nil)
	conns := make([]*sock, 0, len(o.conns))
	for c := range o.conns {
		conns = append(conns, c)
	}
	o.mu.Unlock()
	err := o.ln.Close()
	close(o.stop)
	for _, c := range conns {
		c.shutdown() // its serve closes it
	}
	o.mu.Lock()
	for nc := range o.refusing {
		_ = nc.Close()
	}
	o.mu.Unlock()
	o.wg.Wait()
	for len(o.fresh) > 0 {
		_ = unix.Close(<-o.fresh)
	}
	// NB: a reclaimer call under way when SetReclaimer(nil) ran finds o.closed.
	_ = o.node.Close()
	var st unix.Stat_t
	if unix.Stat(o.path, &st) == nil && st.Ino == o.ino {
		_ = os.Remove(o.path)
	}
	return err
}

// refill keeps o.fresh full until Close.
func (o *Owner) refill() {
	defer o.wg.Done()
	for {
		fd, err := newGranule(o.name, o.g)
		if err != nil {
			select { // EMFILE and the like: allocations create their own
			case <-o.stop:
				return
			case <-time.After(100 * time.Millisecond):
				continue
			}
		}
		select {
		case o.fresh <- fd:
		case <-o.stop:
			_ = unix.Close(fd)
			return
		}
	}
}

// newGranule returns a fresh granule, created ahead if one is ready.
func (o *Owner) newGranule() (int, error) {
	select {
	case fd := <-o.fresh:
		return fd, nil
	default:
		return newGranule(o.name, o.g)
	}
}

func (o *Owner) accept() {
	defer o.wg.Done()
	for {
		c, err := o.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // EMFILE and the like: do not spin
			continue
		}
		o.mu.Lock()
		if o.closed {
			o.mu.Unlock()
			_ = c.Close()
			continue
		}
		o.wg.Add(1)
		o.mu.Unlock()
		go o.serve(c)
	}
}

// peer returns the credentials of c's peer.
func peer(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// serve runs one connection until it closes or breaks the protocol, then gives back
// everything it held. It reads on a thread of its own, outside the network poller
// (sock): each request wakes it directly.
func (o *Owner) serve(nc *net.UnixConn) {
	defer o.wg.Done()
	cred, err := peer(nc)
	if err != nil || cred.Uid != o.uid.Load() {
		o.mu.Lock()
		if o.closed {
			o.mu.Unlock()
			_ = nc.Close()
			return
		}
		o.refusing[nc] = struct{}{}
		o.mu.Unlock()
		defer func() {
			o.mu.Lock()
			delete(o.refusing, nc)
			o.mu.Unlock()
			_ = nc.Close()
		}()
		// ErrPeerRefused. NB: the peer's first message is read (a bounded wait, its
		// contents ignored, descriptors closed) before the answer, since closing a
		// socket with unread data resets it and the answer would be lost.
		_ = nc.SetReadDeadline(time.Now().Add(time.Second))
		b, oob := make([]byte, maxMsg+1), make([]byte, unix.CmsgSpace(4*maxBatch))
		if _, oobn, _, _, err := nc.ReadMsgUnix(b, oob); err == nil && oobn > 0 {
			closeRights(oob[:oobn])
		}
		_, _, _ = nc.WriteMsgUnix((&msg{op: opHello | replyBit, code: codeRefused}).encode(nil), nil, nil)
		return
	}
	sk, err := sockOf(nc, false)
	if err != nil {
		return
	}
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		sk.close()
		return
	}
	o.conns[sk] = struct{}{}
	o.mu.Unlock()
	defer func() {
		o.mu.Lock()
		delete(o.conns, sk)
		o.mu.Unlock()
		sk.close()
	}()
	c := &ownerConn{o: o, c: sk, pid: cred.Pid, uid: cred.Uid,
		granules: make(map[uint64]struct{}), borrowed: make(map[uint64]struct{}),
		pending: make(map[uint64]context.CancelFunc)}
	buf := make([]byte, maxMsg+1)
	oob := make([]byte, unix.CmsgSpace(4*maxBatch))
	// The first message must be hello.
	m, ok := c.read(buf, oob)
	if !ok {
		return
	}
	if m.op != opHello {
		c.reply(msg{op: m.op | replyBit, code: codeProtocol, id: m.id})
		return
	}
	if m.a != protocolVersion {
		c.reply(msg{op: opHello | replyBit, code: codeVersion, id: m.id, a: protocolVersion})
		return
	}
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		c.reply(msg{op: opHello | replyBit, code: codeClosed, id: m.id})
		return
	}
	o.number++
	c.number = o.number
	c.auth = o.gov.Authority(fmt.Sprintf("node client %d (pid %d)", c.number, c.pid), accounting.HostKey)
	o.clients[c] = struct{}{}
	o.mu.Unlock()
	defer c.detach()
	if !c.reply(msg{op: opHello | replyBit, id: m.id, a: uint64(o.g), b: c.number}) {
		return
	}
	o.mu.Lock()
	c.ready = true
	o.mu.Unlock()
	for {
		m, ok := c.read(buf, oob)
		if !ok || !c.handle(m) {
			return
		}
	}
}

// read reads one request. It reports false when the connection ended or the message
// was bad (answered with codeProtocol where it decoded); any descriptors that came
// with it are closed.
func (c *ownerConn) read(buf, oob []byte) (msg, bool) {
	n, oobn, flags, err := c.c.recv(buf, oob, 0)
	if err != nil || (n == 0 && oobn == 0) {
		return msg{}, false
	}
	if oobn > 0 {
		closeRights(oob[:oobn])
		return msg{}, false
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || n > maxMsg {
		return msg{}, false
	}
	m, err := decode(buf[:n])
	if err != nil {
		return msg{}, false // nothing to answer to
	}
	if m.op&replyBit != 0 && m.op != opReclaim|replyBit || m.op == opReclaim {
		// NB: the reclaim's answer is the one reply a client sends.
		c.reply(msg{op: m.op, code: codeProtocol, id: m.id})
		return msg{}, false
	}
	return m, true
}

// closeRights closes every descriptor an SCM_RIGHTS message in oob carried.
func closeRights(oob []byte) {
	cms, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	for _, cm := range cms {
		if fds, err := unix.ParseUnixRights(&cm); err == nil {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
		}
	}
}

// reply sends m (and fds); it reports false when the connection is broken.
func (c *ownerConn) reply(m msg, fds ...int) bool {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	var b [maxMsg]byte
	return c.c.send(m.encode(b[:0]), oob, time.Time{}) == nil
}

// handle serves one request; it reports false when the connection must close.
func (c *ownerConn) handle(m msg) bool {
	bad := func() bool {
		c.reply(msg{op: m.op | replyBit, code: codeProtocol, id: m.id})
		return false
	}
	switch m.op {
	case opAlloc:
		if m.a < 1 || m.a > maxBatch || len(m.ids) != 0 {
			return bad()
		}
		return c.alloc(m)
	case opFree:
		if len(m.ids) == 0 || m.a != 0 || m.b != 0 || m.c != 0 {
			return bad()
		}
		if !c.free(m.ids) {
			return bad()
		}
		return true // no reply: see proto.go
	case opLend:
		if len(m.ids) == 0 || m.b != 0 || m.c != 0 {
			return bad()
		}
		ok, errno := c.lend(m.a, m.ids)
		switch {
		case !ok:
			return bad()
		case errno != 0:
			return c.reply(msg{op: opLend | replyBit, code: codeNoMemory, id: m.id, a: uint64(errno)})
		}
		return c.reply(msg{op: opLend | replyBit, id: m.id})
	case opBorrow:
		if len(m.ids) == 0 || m.a != 0 || m.b != 0 || m.c != 0 || !c.borrow(m) {
			return bad()
		}
		return true
	case opCancel:
		if len(m.ids) != 0 {
			return bad()
		}
		c.o.mu.Lock()
		cancel := c.pending[m.a]
		c.o.mu.Unlock()
		if cancel != nil {
			cancel()
		}
		return true // an alloc that has just been served has nothing left to cancel
	case opIdle:
		if len(m.ids) != 0 || m.b != 0 || m.c != 0 {
			return bad()
		}
		c.o.mu.Lock()
		if !c.gone {
			c.setIdle(m.a)
		}
		c.o.mu.Unlock()
		return true // no reply
	case opReclaim | replyBit:
		if len(m.ids) != 0 || m.code != codeOK || m.b != 0 || m.c != 0 || !c.answered(m.id, m.a, false) {
			return bad()
		}
		return true
	case opStats:
		if len(m.ids) != 0 {
			return bad()
		}
		c.o.mu.Lock()
		d := c.o.gov.Stats(accounting.HostKey)
		c.o.mu.Unlock()
		return c.reply(msg{op: opStats | replyBit, id: m.id, a: uint64(d.Used), b: uint64(d.Limit), c: uint64(c.auth.Stats().Owned)})
	}
	return bad() // hello again
}

// alloc serves an allocation that may wait in a goroutine of its own, so that the
// connection stays readable for a cancel while it waits for the budget.
func (c *ownerConn) alloc(m msg) bool {
	if m.b == 0 { // no wait: served on the connection's goroutine, one hop fewer
		c.serveAlloc(context.Background(), m)
		return true
	}
	var ctx context.Context
	var cancel context.CancelFunc
	switch {
	case m.b == noDeadline:
		ctx, cancel = context.WithCancel(context.Background())
	default:
		if m.b > math.MaxInt64 {
			return false
		}
		ctx, cancel = context.WithDeadline(context.Background(), time.Unix(0, int64(m.b)))
	}
	c.o.mu.Lock()
	if _, dup := c.pending[m.id]; dup || c.gone || len(c.pending) >= maxPending {
		c.o.mu.Unlock()
		cancel()
		return false
	}
	c.pending[m.id] = cancel
	c.allocs.Add(1)
	c.o.mu.Unlock()
	go func() {
		defer c.allocs.Done()
		defer cancel()
		c.serveAlloc(ctx, m)
	}()
	return true
}

func (c *ownerConn) serveAlloc(ctx context.Context, m msg) {
	o, n := c.o, int(m.a)
	size := int64(n) * int64(o.g)
	done := func(r msg, fds ...int) {
		r.op, r.id = opAlloc|replyBit, m.id
		c.reply(r, fds...)
	}
	var err error
	if m.b == 0 {
		err = c.auth.TryAcquire(size)
	} else {
		err = c.auth.Acquire(ctx, size)
	}
	if m.b != 0 {
		c.o.mu.Lock()
		delete(c.pending, m.id)
		c.o.mu.Unlock()
	}
	if err != nil {
		var be *accounting.BudgetError
		switch {
		case errors.As(err, &be):
			done(msg{code: codeBudget, a: uint64(be.Requested), b: uint64(be.Available), c: uint64(be.Limit)})
		case errors.Is(err, context.DeadlineExceeded):
			done(msg{code: codeDeadline})
		default:
			done(msg{code: codeCanceled})
		}
		return
	}
	fds := make([]int, 0, n)
	for range n {
		fd, err := o.newGranule()
		if err != nil {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
			c.auth.Release(size)
			var errno unix.Errno
			_ = errors.As(err, &errno)
			done(msg{code: codeNoMemory, a: uint64(errno)})
			return
		}
		fds = append(fds, fd)
	}
	ids := make([]uint64, n)
	o.mu.Lock()
	if c.gone || o.closed {
		// NB: a closing owner grants nothing more, also to a waiter that the
		// budget another client's detach freed has just admitted.
		closing := !c.gone
		o.mu.Unlock()
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
		c.auth.Release(size)
		if closing {
			done(msg{code: codeClosed})
		}
		return
	}
	for i, fd := range fds {
		o.granule++
		ids[i] = o.granule
		c.granules[ids[i]] = struct{}{}
		o.table[ids[i]] = &ownerGranule{fd: fd, ro: -1, lender: c, held: true}
	}
	o.mu.Unlock()
	// NB: the granules are the client's from here: if the reply is lost the
	// connection is broken and detach gives them back.
	done(msg{ids: ids}, fds...)
}

// free gives back granules ids the client holds or borrowed; it reports false,
// and changes nothing, if one is neither or comes twice.
func (c *ownerConn) free(ids []uint64) bool {
	o := c.o
	o.mu.Lock()
	defer o.mu.Unlock()
	for i, id := range ids {
		_, held := c.granules[id]
		_, borrowed := c.borrowed[id]
		if !held && !borrowed || slices.Contains(ids[:i], id) {
			return false
		}
	}
	for _, id := range ids {
		c.drop(id)
	}
	return true
}

// drop gives back one granule c holds or borrowed; the granule goes when nobody
// holds it any more. o.mu must be held.
func (c *ownerConn) drop(id uint64) {
	o, gr := c.o, c.o.table[id]
	if _, held := c.granules[id]; held {
		delete(c.granules, id)
		gr.held = false
		if c.idle > len(c.granules) { // its report counted this one idle
			c.auth.TakeIdle(int64(o.g))
			c.idle--
		}
	} else {
		delete(c.borrowed, id)
		if gr.borrowers--; gr.borrowers < 0 {
			panic("nodepool: granule borrowers below zero")
		}
	}
	if gr.held || gr.borrowers > 0 {
		return
	}
	_ = unix.Close(gr.fd)
	if gr.ro >= 0 {
		_ = unix.Close(gr.ro)
	}
	delete(o.table, id)
	if len(gr.lentTo) > 0 { // NB: o.clients are few, the processes of one node
		for cl := range o.clients {
			if slices.Contains(gr.lentTo, cl.number) {
				cl.stale.add(id)
			}
		}
	}
	l := gr.lender
	l.auth.Release(int64(o.g))
	if l.gone && l.auth.Stats().Owned == 0 {
		_ = l.auth.Close() // the lender detached while its granules were borrowed
	}
}

// lend lets client number to borrow granules ids, which c must hold; it reports
// false, and changes nothing, if c does not hold one or one comes twice, or a
// granule would be lent to more than maxLend clients. A granule lent the first
// time gets its read-only descriptor, opened anew through /proc/self/fd, which
// every borrow passes: a borrow opens nothing. If that open fails the lend is
// answered codeNoMemory (errno) and changes nothing else.
func (c *ownerConn) lend(to uint64, ids []uint64) (ok bool, errno unix.Errno) {
	o := c.o
	o.mu.Lock()
	defer o.mu.Unlock()
	for i, id := range ids {
		if _, held := c.granules[id]; !held || slices.Contains(ids[:i], id) {
			return false, 0
		}
		if gr := o.table[id]; !slices.Contains(gr.lentTo, to) && len(gr.lentTo) >= maxLend {
			return false, 0
		}
	}
	for _, id := range ids {
		gr := o.table[id]
		if gr.ro >= 0 {
			continue
		}
		fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(gr.fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			_ = errors.As(err, &errno)
			return true, errno
		}
		gr.ro = fd
	}
	for _, id := range ids {
		if gr := o.table[id]; !slices.Contains(gr.lentTo, to) {
			gr.lentTo = append(gr.lentTo, to)
		}
	}
	return true, 0
}

// borrow serves a borrow of granules ids, which must have been lent to c and not
// be c's own: each is passed as its read-only descriptor (made at its first lend),
// so that c can map it only for reading. One lent to c that is gone since (a stale
// loan) is answered codeGone, one c borrows already codeBorrowed, with the first
// such id; either borrows nothing of the request. It reports false when the
// request broke the protocol, also where another of its ids is one of those.
func (c *ownerConn) borrow(m msg) bool {
	o := c.o
	o.mu.Lock()
	code, which := codeOK, uint64(0)
	for i, id := range m.ids {
		gr := o.table[id]
		if slices.Contains(m.ids[:i], id) || gr == nil && !c.stale.has(id) {
			o.mu.Unlock()
			return false
		}
		if gr == nil {
			if code == codeOK {
				code, which = codeGone, id
			}
			continue
		}
		_, own := c.granules[id]
		if own || !slices.Contains(gr.lentTo, c.number) {
			o.mu.Unlock()
			return false
		}
		if _, again := c.borrowed[id]; again && code == codeOK {
			code, which = codeBorrowed, id
		}
	}
	if code != codeOK {
		o.mu.Unlock()
		return c.reply(msg{op: opBorrow | replyBit, code: code, id: m.id, a: which})
	}
	fds := make([]int, len(m.ids))
	for i, id := range m.ids {
		gr := o.table[id]
		fds[i] = gr.ro
		c.borrowed[id] = struct{}{}
		gr.borrowers++
	}
	o.mu.Unlock()
	// NB: the descriptors stay open while c borrows them, that is until this
	// connection's later free or its detach, both served after this reply. If the
	// reply is lost the connection is broken and detach gives them back.
	return c.reply(msg{op: opBorrow | replyBit, id: m.id, ids: m.ids}, fds...)
}

// detach gives back everything the connection held: its waiting allocations end,
// its granules' descriptors close (the memory lives on only where the client still
// maps it, which for a dead client is nowhere), unless another client borrowed
// them, and its ledger closes once nothing is charged to it.
func (c *ownerConn) detach() {
	o := c.o
	o.mu.Lock()
	c.gone = true
	if c.ask != nil {
		c.ask.timer.Stop()
		c.ask = nil
	}
	for _, cancel := range c.pending {
		cancel()
	}
	o.mu.Unlock()
	c.allocs.Wait()
	o.mu.Lock()
	defer o.mu.Unlock()
	for id := range c.granules {
		c.drop(id)
	}
	for id := range c.borrowed {
		c.drop(id)
	}
	// Its number is never given again, but the lists of who may borrow stay short:
	// NB: one pass over the node's granules per detach.
	for _, gr := range o.table {
		if i := slices.Index(gr.lentTo, c.number); i >= 0 {
			gr.lentTo = slices.Delete(gr.lentTo, i, i+1)
		}
	}
	// NB: granules it lent and others still borrow stay charged to its ledger,
	// which closes when the last of them goes (drop).
	if c.auth.Stats().Owned == 0 {
		_ = c.auth.Close()
	}
	delete(o.clients, c)
	o.detached++
}

// newGranule creates one granule: a memfd of size g, sealed so that neither side can
// grow or shrink it (a shrink would SIGBUS the other's mapping) nor unseal it.
func newGranule(name string, g int) (int, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_NOEXEC_SEAL)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	}
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(fd, int64(g)); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	return fd, nil
}
