package nodepool

import (
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// sock is a connected SOCK_SEQPACKET socket used outside Go's network poller. A
// goroutine that waits for a message blocks its thread in recvmsg or poll, and the
// kernel wakes that thread when the message comes: one wake-up, where the poller
// wakes a thread blocked in epoll, readies the reading goroutine and hands the
// message to the goroutine that waits for it. Nothing wakes a blocked call but a
// message, the peer's end, or shutdown: whoever must stop one calls shutdown.
type sock struct {
	life sync.RWMutex // read-held while fd is in use; write-held to close it
	fd   int          // blocking; -1 once closed
	wake int          // an eventfd that interrupts a waitIn, or -1
	wmu  sync.Mutex   // one message at a time
}

// errSockClosed is what a sock closed on this side answers.
var errSockClosed = net.ErrClosed

// sockOf takes nc's socket out of the network poller: a duplicate of its descriptor,
// made blocking, and nc closed. With wake set it also makes an eventfd for waitIn.
func sockOf(nc *net.UnixConn, wake bool) (*sock, error) {
	rc, err := nc.SyscallConn()
	if err != nil {
		_ = nc.Close()
		return nil, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(f uintptr) { fd, derr = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		derr = err
	}
	_ = nc.Close()
	if derr != nil {
		return nil, derr
	}
	s := &sock{fd: fd, wake: -1}
	if err := unix.SetNonblock(fd, false); err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	if wake {
		if s.wake, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
			_ = unix.Close(fd)
			return nil, err
		}
	}
	return s, nil
}

// recv reads one message, waiting for it unless flags has MSG_DONTWAIT.
func (s *sock) recv(buf, oob []byte, flags int) (n, oobn, rflags int, err error) {
	s.life.RLock()
	defer s.life.RUnlock()
	if s.fd < 0 {
		return 0, 0, 0, errSockClosed
	}
	for {
		n, oobn, rflags, _, err = unix.Recvmsg(s.fd, buf, oob, flags|unix.MSG_CMSG_CLOEXEC)
		if err != unix.EINTR {
			return n, oobn, rflags, err
		}
	}
}

// waitIn waits until a message can be read, the socket ends, or kick is called
// (then it drains the kick and returns too).
func (s *sock) waitIn() error {
	s.life.RLock()
	defer s.life.RUnlock()
	if s.fd < 0 {
		return errSockClosed
	}
	pfd := [2]unix.PollFd{{Fd: int32(s.fd), Events: unix.POLLIN}, {Fd: int32(s.wake), Events: unix.POLLIN}}
	k := 1
	if s.wake >= 0 {
		k = 2
	}
	for {
		_, err := unix.Poll(pfd[:k], -1)
		if err == unix.EINTR {
			continue
		}
		if k == 2 && pfd[1].Revents != 0 {
			var b [8]byte
			_, _ = unix.Read(s.wake, b[:])
		}
		return err
	}
}

// kick interrupts a waitIn, now or the next one.
func (s *sock) kick() {
	s.life.RLock()
	defer s.life.RUnlock()
	if s.fd >= 0 && s.wake >= 0 {
		var b [8]byte
		b[0] = 1
		_, _ = unix.Write(s.wake, b[:])
	}
}

// send writes one message with the descriptors oob carries, waiting for room. It
// gives up at deadline unless that is zero.
func (s *sock) send(p, oob []byte, deadline time.Time) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	s.life.RLock()
	defer s.life.RUnlock()
	if s.fd < 0 {
		return errSockClosed
	}
	flags := unix.MSG_NOSIGNAL
	if !deadline.IsZero() {
		flags |= unix.MSG_DONTWAIT
	}
	for {
		_, err := unix.SendmsgN(s.fd, p, oob, nil, flags)
		switch {
		case err == unix.EINTR:
			continue
		case err != unix.EAGAIN || deadline.IsZero():
			return err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return unix.ETIMEDOUT
		}
		pfd := []unix.PollFd{{Fd: int32(s.fd), Events: unix.POLLOUT}}
		if _, err := unix.Poll(pfd, int(left/time.Millisecond)+1); err != nil && err != unix.EINTR {
			return err
		}
	}
}

// shutdown ends the connection both ways: every call blocked on it returns, and
// later ones fail. The descriptor stays open until close.
func (s *sock) shutdown() {
	s.life.RLock()
	defer s.life.RUnlock()
	if s.fd >= 0 {
		_ = unix.Shutdown(s.fd, unix.SHUT_RDWR)
	}
}

// close shuts the socket down and closes its descriptors once no call uses them.
func (s *sock) close() {
	s.shutdown()
	s.kick()
	s.life.Lock()
	defer s.life.Unlock()
	if s.fd >= 0 {
		_ = unix.Close(s.fd)
		s.fd = -1
	}
	if s.wake >= 0 {
		_ = unix.Close(s.wake)
		s.wake = -1
	}
}
