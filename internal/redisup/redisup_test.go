package redisup_test

import (
	"net"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/redisup"
	"github.com/vmarena/vmarena/internal/testutil"
)

// freeAddr returns a 127.0.0.1 address no one listens on (just now).
func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

func TestWaitBadInput(t *testing.T) {
	for _, within := range []time.Duration{0, -time.Second} {
		assert.ErrorIs(t, redisup.Wait(freeAddr(t), 1, nil, within), redisup.ErrWait)
	}
}

func TestWaitNoAnswer(t *testing.T) {
	start := time.Now()
	err := redisup.Wait(freeAddr(t), 1, nil, 100*time.Millisecond)
	assert.ErrorIs(t, err, redisup.ErrNoAnswer)
	assert.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "it waited the whole wait")
}

func TestWaitExited(t *testing.T) {
	exited := make(chan struct{})
	close(exited)
	assert.ErrorIs(t, redisup.Wait(freeAddr(t), 1, exited, time.Minute), redisup.ErrExited)
}

// startServer starts a redis-server on addr and returns it with the channel closed
// when it exits; it is killed at cleanup.
func startServer(t *testing.T, addr string) (*exec.Cmd, <-chan struct{}) {
	bin, _ := testutil.NeedRedis(t)
	_, port, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	cmd := exec.Command(bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", t.TempDir(), "--protected-mode", "no", "--daemonize", "no")
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	return cmd, exited
}

// ourServer starts a redis-server on a free port and waits for it, on another port
// when one taken meanwhile answers for it or keeps it from starting (Retry), up to 3
// tries: other packages' tests start servers at the same time.
func ourServer(t *testing.T) (string, *exec.Cmd, <-chan struct{}) {
	var err error
	for range 3 {
		addr := freeAddr(t)
		cmd, exited := startServer(t, addr)
		if err = redisup.Wait(addr, cmd.Process.Pid, exited, 10*time.Second); err == nil {
			return addr, cmd, exited
		}
		if !redisup.Retry(err) {
			break
		}
	}
	require.NoError(t, err)
	return "", nil, nil
}

func TestWaitServer(t *testing.T) {
	ourServer(t)
}

// TestWaitNotOurs: a server started on a port another server took meanwhile is not
// taken for the caller's. The second server either exits (the port is in use) or,
// while it starts, the first answers in its place: each is a Retry, never nil.
func TestWaitNotOurs(t *testing.T) {
	addr, first, _ := ourServer(t)
	err := redisup.Wait(addr, first.Process.Pid+1, nil, 10*time.Second)
	require.ErrorIs(t, err, redisup.ErrNotOurs, "a pid that is not the server's")
	assert.True(t, redisup.Retry(err))
	second, secondExited := startServer(t, addr)
	err = redisup.Wait(addr, second.Process.Pid, secondExited, 10*time.Second)
	require.Error(t, err, "the first server's answer is not the second's")
	assert.True(t, redisup.Retry(err), "%v", err)
}
