package nodepool_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// runHelper is the body of a helper process: "owner" listens on path and waits to
// be killed; "client" attaches to path and commits, shares, writes, decommits and
// unreserves at random until it is killed. Each says "ready" on stdout first.
func runHelper(mode, path string) int {
	switch mode {
	case "owner":
		g := pg
		if s := os.Getenv(helperGranuleEnv); s != "" {
			g, _ = strconv.Atoi(s)
		}
		o, err := nodepool.Listen(path, nodepool.OwnerOptions{Granularity: g})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("ready")
		_ = o
		select {}
	case "prefix":
		return runPrefixHelper(path)
	case "idler":
		return runIdleHelper(path)
	case "client":
		c, err := nodepool.Attach(path, nodepool.ClientOptions{})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("ready %d\n", c.Number())
		if os.Getenv(helperBorrowEnv) != "" {
			// The test lends it granules: borrow them into a reservation it keeps.
			line, err := bufio.NewReader(os.Stdin).ReadString('\n')
			if err != nil {
				return 1
			}
			var ids []uint64
			for _, f := range strings.Fields(line) {
				id, err := strconv.ParseUint(f, 10, 64)
				if err != nil {
					return 1
				}
				ids = append(ids, id)
			}
			r, err := c.Reserve(len(ids) * pg)
			if err != nil || c.Borrow(r, 0, ids) != nil {
				fmt.Fprintln(os.Stderr, "borrow:", err)
				return 1
			}
		}
		churn(c, rand.New(rand.NewPCG(uint64(os.Getpid()), 1)))
	}
	return 2
}

// churn drives c at random for ever; it ignores budget refusals and waits that
// time out.
func churn(c *nodepool.Client, rng *rand.Rand) {
	const n = 8
	var rs []*nodepool.Reservation
	for {
		switch op := rng.IntN(10); {
		case op < 2 && len(rs) < 4:
			if r, err := c.Reserve(n * pg); err == nil {
				rs = append(rs, r)
			}
		case op < 5 && len(rs) > 0:
			r := rs[rng.IntN(len(rs))]
			i, k := rng.IntN(n), 1+rng.IntN(3)
			if i+k > n {
				break
			}
			var err error
			if rng.IntN(2) == 0 { // waits in the owner's queue when the node is full
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(5000))*time.Microsecond)
				err = c.CommitCtx(ctx, r, i*pg, k*pg)
				cancel()
			} else {
				err = c.Commit(r, i*pg, k*pg)
			}
			if err == nil {
				_ = c.CopyIn(r, i*pg, []byte{byte(i)})
			}
		case op < 6 && len(rs) > 1:
			a, b := rs[0], rs[1]
			i := rng.IntN(n)
			_ = c.Share(b, i*pg, a, i*pg, pg, backing.Protection(rng.IntN(2)))
		case op < 8 && len(rs) > 0:
			r := rs[rng.IntN(len(rs))]
			_ = c.Decommit(r, rng.IntN(n)*pg, pg)
		case op < 9 && len(rs) > 0:
			i := rng.IntN(len(rs))
			c.Unreserve(rs[i])
			rs = append(rs[:i], rs[i+1:]...)
		}
	}
}

// helperGranuleEnv sets an owner helper's granule size (default 4 KiB).
const helperGranuleEnv = "NODEPOOL_TEST_GRANULE"

// helperBorrowEnv makes a client helper read granule ids from stdin and borrow
// them before it churns.
const helperBorrowEnv = "NODEPOOL_TEST_BORROW"

// startHelper starts this test binary as a helper process in mode on path and
// waits until it says it is ready (unless wait is false).
func startHelper(t testing.TB, mode, path string, wait bool, env ...string) *exec.Cmd {
	cmd, _, _ := startHelperIO(t, mode, path, wait, env...)
	return cmd
}

// startHelperIO is startHelper that also returns the client number a client helper
// reported and its stdin.
func startHelperIO(t testing.TB, mode, path string, wait bool, env ...string) (*exec.Cmd, uint64, io.WriteCloser) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), helperEnv+"="+mode, helperPathEnv+"="+path), env...)
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	var number uint64
	if wait {
		line, err := bufio.NewReader(out).ReadString('\n')
		require.NoError(t, err, "the %s helper says ready", mode)
		require.True(t, strings.HasPrefix(line, "ready"), "the %s helper says %q", mode, line)
		if f := strings.Fields(line); len(f) == 2 {
			number, err = strconv.ParseUint(f[1], 10, 64)
			require.NoError(t, err)
		}
	}
	return cmd, number, in
}

// kill kills the helper with SIGKILL and reaps it.
func kill(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	err := cmd.Wait()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, syscall.SIGKILL, ee.Sys().(syscall.WaitStatus).Signal())
}

// soakKills returns how many kills the soak makes: NODEPOOL_SOAK_KILLS, or 20.
func soakKills(t *testing.T) int {
	if s := os.Getenv("NODEPOOL_SOAK_KILLS"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err)
		return n
	}
	if testing.Short() {
		return 5
	}
	return 20
}
