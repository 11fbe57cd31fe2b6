// Command vmarena-node owns a node's host memory for every process that attaches to
// it (package backing/nodepool): one budget, one FIFO queue, and granules that go
// back the moment their holder's socket closes.
//
//	vmarena-node [-socket path] [-limit size] [-granule size] [-stats interval]
//
// Sizes take a B, KiB, MiB, GiB or TiB suffix. The socket is made with mode 0600 and
// only processes of the same user may attach; the daemon makes itself undumpable so
// that other processes of that user can not read its descriptors through /proc. It
// runs until SIGINT or SIGTERM, then removes its socket.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		fmt.Fprintln(os.Stderr, "vmarena-node:", err)
		os.Exit(1)
	}
}

// defaultSocket returns $XDG_RUNTIME_DIR/vmarena-node.sock, or a per-user name in
// the temporary directory.
func defaultSocket() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "vmarena-node.sock")
	}
	return filepath.Join(os.TempDir(), "vmarena-node-"+strconv.Itoa(os.Getuid())+".sock")
}

// run serves until ctx ends. ready, if not nil, receives the owner once it listens.
func run(ctx context.Context, args []string, log io.Writer, ready chan<- *nodepool.Owner) error {
	fs := flag.NewFlagSet("vmarena-node", flag.ContinueOnError)
	fs.SetOutput(log)
	socket := fs.String("socket", defaultSocket(), "Unix socket path")
	limit := fs.String("limit", "", "the node's host budget (empty: unlimited)")
	granule := fs.String("granule", "2MiB", "granule size")
	every := fs.Duration("stats", 0, "print the node's figures at this interval (0: never)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	g, err := parseSize(*granule)
	if err != nil {
		return fmt.Errorf("-granule: %w", err)
	}
	gov := accounting.NewGovernor()
	if *limit != "" {
		n, err := parseSize(*limit)
		if err != nil {
			return fmt.Errorf("-limit: %w", err)
		}
		if err := gov.SetLimit(accounting.HostKey, n); err != nil {
			return err
		}
	}
	if err := undumpable(); err != nil {
		return err
	}
	o, err := nodepool.Listen(*socket, nodepool.OwnerOptions{Governor: gov, Granularity: int(g)})
	if err != nil {
		return err
	}
	defer o.Close()
	fmt.Fprintf(log, "vmarena-node: listening on %s (granule %d bytes, limit %s)\n", o.Path(), o.Granularity(), limitString(gov))
	if ready != nil {
		ready <- o
	}
	var tick <-chan time.Time
	if *every > 0 {
		t := time.NewTicker(*every)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return o.Close()
		case <-tick:
			s := o.Stats()
			idle := 0
			for _, cs := range s.Clients {
				idle += cs.Idle
			}
			fmt.Fprintf(log, "vmarena-node: used %d of %s bytes, %d granules (%d idle in clients' pools), %d clients, %d waiting, %d reclaims (%d bytes back, %d short, %d unanswered)\n",
				s.Device.Used, limitString(gov), s.Granules, idle, len(s.Clients), s.Device.Waiters,
				s.Reclaim.Asked, s.Reclaim.Given, s.Reclaim.Short, s.Reclaim.Unanswered)
		}
	}
}

func limitString(g *accounting.Governor) string {
	if l := g.Limit(accounting.HostKey); l != accounting.Unlimited {
		return strconv.FormatInt(l, 10)
	}
	return "unlimited"
}

// parseSize parses a positive byte count with an optional B, KiB, MiB, GiB or TiB
// suffix.
func parseSize(s string) (int64, error) {
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n <= 0 || n > (1<<62)/mult {
		return 0, errors.New("size must be a positive number of bytes, with an optional B, KiB, MiB, GiB or TiB suffix")
	}
	return n * mult, nil
}
