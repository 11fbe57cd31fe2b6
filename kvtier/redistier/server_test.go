package redistier_test

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/redisup"
	"github.com/vmarena/vmarena/internal/testutil"
)

// freePort returns a 127.0.0.1 port nothing listens on now, and whose cluster bus
// port (port + 10000) is free too.
func freePort(t testing.TB) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		if port+10000 > 65535 {
			continue
		}
		bus, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+10000))
		if err != nil {
			continue
		}
		_ = bus.Close()
		return port
	}
	t.Fatal("no free port pair found")
	return 0
}

// server is one redis-server process on 127.0.0.1, with no persistence.
type server struct {
	t       testing.TB
	bin     string
	port    int
	dir     string
	cluster bool
	cmd     *exec.Cmd
	done    chan struct{}
}

func (s *server) addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// startServer starts a redis-server on a free port and stops it at cleanup. A port
// taken by another process between freePort and the server's start (a test of
// another package starting its own server, say) is given up for another, up to
// three tries.
func startServer(t testing.TB, cluster bool) *server {
	t.Helper()
	bin, _ := testutil.NeedRedis(t)
	s := &server{t: t, bin: bin, cluster: cluster}
	t.Cleanup(s.kill)
	for try := 1; ; try++ {
		s.port, s.dir = freePort(t), t.TempDir()
		err := s.tryStart()
		if err == nil {
			return s
		}
		s.kill()
		if !redisup.Retry(err) || try == 3 {
			t.Fatal(err)
		}
	}
}

// start runs the server process on its port and waits until it answers PING.
func (s *server) start() {
	s.t.Helper()
	if err := s.tryStart(); err != nil {
		s.t.Fatal(err)
	}
}

// tryStart is start, which returns what went wrong with the server's output.
func (s *server) tryStart() error {
	args := []string{
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
	}
	if s.cluster {
		args = append(args, "--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(s.dir, "nodes.conf"),
			"--cluster-node-timeout", "2000")
	}
	s.cmd = exec.Command(s.bin, args...)
	out := new(syncBuffer)
	s.cmd.Stdout, s.cmd.Stderr = out, out
	if err := s.cmd.Start(); err != nil {
		s.cmd = nil
		return err
	}
	s.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(s.cmd, s.done)
	if err := redisup.Wait(s.addr(), s.cmd.Process.Pid, s.done, 10*time.Second); err != nil {
		return fmt.Errorf("%w\n%s", err, out.String())
	}
	return nil
}

// syncBuffer is a strings.Builder that the process's output goroutine and the test
// may use at once.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// kill stops the server at once (SIGKILL) and waits for it to exit; a stopped
// server is left alone.
func (s *server) kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}

// startCluster starts a three-node Redis Cluster (three masters, no replicas) on
// 127.0.0.1 and waits until every node says the cluster is ok.
func startCluster(t testing.TB) []*server {
	t.Helper()
	_, cli := testutil.NeedRedis(t)
	nodes := make([]*server, 3)
	args := []string{"--cluster", "create"}
	for i := range nodes {
		nodes[i] = startServer(t, true)
		args = append(args, nodes[i].addr())
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	out, err := exec.Command(cli, args...).CombinedOutput()
	require.NoError(t, err, "redis-cli --cluster create: %s", out)
	deadline := time.Now().Add(20 * time.Second)
	for _, n := range nodes {
		c := redis.NewClient(&redis.Options{Addr: n.addr(), MaxRetries: -1})
		for {
			info, err := c.ClusterInfo(context.Background()).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				_ = c.Close()
				t.Fatalf("cluster node %s not ok: %v %s", n.addr(), err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
		_ = c.Close()
	}
	return nodes
}

// newClient returns a go-redis client of addrs (a cluster client for more than one),
// closed at cleanup. ContextTimeoutEnabled lets the tier's timeouts bound socket
// reads, as the package doc asks.
func newClient(t testing.TB, addrs ...string) redis.UniversalClient {
	t.Helper()
	o := &redis.UniversalOptions{Addrs: addrs, ContextTimeoutEnabled: true, MaxRetries: 1, DialTimeout: time.Second}
	if len(addrs) > 1 {
		o.IsClusterMode = true
	}
	c := redis.NewUniversalClient(o)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// dbsize returns the keys of every node.
func dbsize(t testing.TB, nodes ...*server) []int64 {
	t.Helper()
	var sizes []int64
	for _, n := range nodes {
		c := redis.NewClient(&redis.Options{Addr: n.addr()})
		v, err := c.DBSize(context.Background()).Result()
		_ = c.Close()
		require.NoError(t, err, fmt.Sprintf("DBSIZE of %s", n.addr()))
		sizes = append(sizes, v)
	}
	return sizes
}
