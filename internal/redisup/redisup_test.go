package redisup_test

import (
	"net"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/redisup"
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
		assert.ErrorIs(t, redisup.Wait(freeAddr(t), nil, within), redisup.ErrWait)
	}
}

func TestWaitNoAnswer(t *testing.T) {
	start := time.Now()
	err := redisup.Wait(freeAddr(t), nil, 100*time.Millisecond)
	assert.ErrorIs(t, err, redisup.ErrNoAnswer)
	assert.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "it waited the whole wait")
}

func TestWaitExited(t *testing.T) {
	exited := make(chan struct{})
	close(exited)
	assert.ErrorIs(t, redisup.Wait(freeAddr(t), exited, time.Minute), redisup.ErrExited)
}

func TestWaitServer(t *testing.T) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("no redis-server (Debian: apt-get install redis-server)")
	}
	addr := freeAddr(t)
	_, port, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	cmd := exec.Command(bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", t.TempDir(), "--protected-mode", "no", "--daemonize", "no")
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	require.NoError(t, redisup.Wait(addr, exited, 10*time.Second))
}
