// Command node replays an LLM serving trace in two processes that share one node's
// memory through backing/nodepool: an owner (this process) holds the node's budget,
// and two client processes (this program started again) each serve their own
// requests with a kv.Cache on a nodepool client. Process A gets a burst of the
// trace's requests while B idles after a short load; then B bursts while A idles.
// The same replay runs again under a static split of the same budget (each process
// capped at half by its own governor), and the command prints what each did
// (waits, refusals, time to first token), how fast a burst got the memory the other
// process was not using, how soon the memory went back after it, and writes a plot
// of each process's memory over time as the owner's ledger counts it:
//
//	go run ./examples/node
//
// The node pool needs Linux (memfd): elsewhere the command says so and stops.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"time"

	"github.com/vmarena/vmarena/kv"
)

func main() {
	if os.Getenv(clientEnv) == "1" {
		if err := runClient(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "node client:", err)
			os.Exit(1)
		}
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "node:", err)
		}
		os.Exit(1)
	}
}

// options are the command's flags.
type options struct {
	trace       string
	model       string
	budget      int64
	granule     int
	concurrency int
	step        time.Duration
	speed       float64
	short       int
	burst       int
	burstAt     time.Duration
	swapAt      time.Duration
	maxTokens   int
	write       bool
	staticFirst bool
	maxWait     time.Duration
	sample      time.Duration
	idle        time.Duration
	out         string
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.trace, "trace", "examples/kvcache/testdata/azure-llm-2023-conv.csv", "Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens)")
	fs.StringVar(&o.model, "model", "llama3-8b", "the model both processes serve (a kv preset of one full-attention group)")
	budget := fs.Int("budget-mib", 4096, "the node's K/V budget, MiB, shared by the two processes")
	granule := fs.Int("granule-kib", 2048, "the node's granule, KiB")
	fs.IntVar(&o.concurrency, "concurrency", 64, "most requests a process runs at once")
	fs.DurationVar(&o.step, "step", 10*time.Millisecond, "one decode step of a process's batch, on the wall clock")
	fs.Float64Var(&o.speed, "speed", 10, "the trace's arrival times are divided by this")
	fs.IntVar(&o.short, "short", 24, "requests of B's short load at the start")
	fs.IntVar(&o.burst, "burst", 60, "requests of each burst")
	fs.DurationVar(&o.burstAt, "burst-at", 500*time.Millisecond, "when A's burst starts")
	fs.DurationVar(&o.swapAt, "swap-at", 15*time.Second, "when B's burst starts, A then idle (0: B does not burst)")
	fs.IntVar(&o.maxTokens, "max-tokens", 8192, "most tokens of a sequence (longer prompts are clipped from the front)")
	fs.BoolVar(&o.write, "write", false, "write every prompt token's K and V at admission (first touches of the memory: on a small machine their page faults then weigh on TTFT)")
	fs.DurationVar(&o.maxWait, "max-wait", 2*time.Minute, "a request not admitted this long after it arrived is refused for good")
	fs.DurationVar(&o.sample, "sample", 10*time.Millisecond, "how often the owner's ledger is read")
	fs.DurationVar(&o.idle, "idle", 2*time.Second, "how long the ledger is read after both processes are done")
	fs.BoolVar(&o.staticFirst, "static-first", false, "replay the static split first (the report's order stays: one budget, then the static split)")
	fs.StringVar(&o.out, "out", "", "directory for the plot (default: a new one in the temporary directory)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o.budget, o.granule = int64(*budget)<<20, *granule<<10
	switch {
	case *budget <= 0 || *granule <= 0:
		return o, errors.New("-budget-mib and -granule-kib must be positive")
	case o.concurrency < 1 || o.step <= 0 || o.speed <= 0 || o.sample <= 0 || o.maxWait <= 0 || o.idle < 0:
		return o, errors.New("-concurrency, -step, -speed, -sample and -max-wait must be positive, -idle not negative")
	case o.short < 0 || o.burst < 1 || o.burstAt < 0 || o.swapAt < 0:
		return o, errors.New("-burst must be positive, -short, -burst-at and -swap-at not negative")
	case o.maxTokens < 2:
		return o, errors.New("-max-tokens must be at least 2")
	}
	m, err := kv.Preset(o.model)
	if err != nil {
		return o, fmt.Errorf("-model: %w", err)
	}
	if len(m.Groups) != 1 || m.Groups[0].Kind != kv.FullAttention {
		return o, fmt.Errorf("-model %s: the replay writes one full-attention group; choose a model of one", o.model)
	}
	return o, nil
}

// run parses args, replays the workload under both modes, and prints the report
// and the plot's path to stdout.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if err := supported(); err != nil {
		return err
	}
	f, err := os.Open(o.trace)
	if err != nil {
		return fmt.Errorf("-trace: %w", err)
	}
	reqs, err := readTrace(f, o.short+2*o.burst)
	f.Close()
	if err != nil {
		return err
	}
	jobs, err := schedule(o, reqs)
	if err != nil {
		return err
	}
	if o.out == "" {
		if o.out, err = os.MkdirTemp("", "vmarena-node-"); err != nil {
			return err
		}
	}
	modes := []string{modeShared, modeStatic}
	if o.staticFirst {
		modes = []string{modeStatic, modeShared}
	}
	var rs []runResult
	for _, mode := range modes {
		fmt.Fprintf(stderr, "node: %s: replaying %d requests in two processes...\n", mode, len(jobs[0])+len(jobs[1]))
		t0 := time.Now()
		r, err := replayNode(ctx, o, mode, jobs, stderr)
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		fmt.Fprintf(stderr, "node: %s: done in %.1f s\n", mode, time.Since(t0).Seconds())
		rs = append(rs, r)
	}
	if o.staticFirst {
		rs[0], rs[1] = rs[1], rs[0]
	}
	rep := makeReport(o, rs)
	rep.print(stdout)
	path, err := writePlot(o.out, o, rs)
	if err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	data, err := writeData(o.out, rs)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\nplot: %s\nevery request and reading of the ledger: %s\n", path, data)
	return nil
}

// dataName is the file, beside the plot, that holds every run's results.
const dataName = "node-runs.json"

// writeData writes rs, every request of every process and every reading of the
// owner's ledger, as JSON into dir/node-runs.json and returns its path.
func writeData(dir string, rs []runResult) (string, error) {
	b, err := json.Marshal(rs)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, dataName)
	return path, os.WriteFile(path, b, 0o644)
}

// schedule makes each process's jobs from the trace: B's short load from the start,
// A's burst from o.burstAt, and with o.swapAt, B's burst from then; each part's
// arrivals are the trace's divided by o.speed, and a request longer than
// o.maxTokens has its prompt clipped from the front.
func schedule(o options, reqs []traceRequest) ([2][]job, error) {
	var jobs [2][]job
	parts := []struct {
		proc, n int
		at      time.Duration
		burst   bool
	}{{1, o.short, 0, false}, {0, o.burst, o.burstAt, true}}
	if o.swapAt > 0 {
		parts = append(parts, struct {
			proc, n int
			at      time.Duration
			burst   bool
		}{1, o.burst, o.swapAt, true})
	}
	next := 0
	for _, p := range parts {
		if next+p.n > len(reqs) {
			return jobs, fmt.Errorf("-trace has %d requests, the replay needs %d", len(reqs), next+p.n)
		}
		part := reqs[next : next+p.n]
		for _, r := range part {
			gen := min(max(r.Generated, 1), o.maxTokens-1)
			ctx := min(max(r.Context, 1), o.maxTokens-gen)
			at := p.at + time.Duration(float64(r.Arrival-part[0].Arrival)/o.speed)
			jobs[p.proc] = append(jobs[p.proc], job{ID: next, Arrival: at, Context: ctx, Generated: gen, Burst: p.burst})
			next++
		}
	}
	return jobs, nil
}
