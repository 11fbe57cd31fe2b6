// Command router replays a Mooncake conversation trace across replicas of a server,
// each with its own vmarena cache and prefix cache publishing its KV events, behind a
// router that subscribes to them all and sends each request to the replica with the
// longest cached prefix, weighted by load, as llm-d's scheduler does. It compares that
// routing with round-robin across the same replicas and with one cache holding all
// their budgets: the cluster's hit rate, the time to first token and the makespan (in
// model time: a decode step per iteration plus the prefill of what was not cached),
// and the bandwidth of the events.
//
//	go run ./examples/router -requests 2000
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"
)

// options are the command's flags.
type options struct {
	trace          string
	requests       int
	replicas       int
	budget         int64
	concurrency    int
	prefillRate    float64
	step           time.Duration
	maxTokens      int
	blockSize      int
	prefixWeight   float64
	loadWeight     float64
	activeWeight   float64
	queueThreshold int
	transport      string
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.trace, "trace", "examples/kvcache/testdata/mooncake-fast25-conversation.jsonl", "Mooncake trace (JSON lines)")
	fs.IntVar(&o.requests, "requests", 2000, "requests replayed from the trace's start (0: all)")
	fs.IntVar(&o.replicas, "replicas", 4, "replicas routed across (1 to 64)")
	budget := fs.Int("budget-mib", 256, "K/V memory of the whole cluster, MiB; each replica has its share")
	fs.IntVar(&o.concurrency, "concurrency", 16, "most requests a replica runs at once")
	fs.Float64Var(&o.prefillRate, "prefill-rate", 50000, "prompt tokens a replica prefills per second of model time")
	fs.DurationVar(&o.step, "step", 25*time.Millisecond, "model time of one decode step")
	fs.IntVar(&o.maxTokens, "max-tokens", 32768, "most tokens of a sequence (longer prompts are clipped)")
	fs.IntVar(&o.blockSize, "block", 16, "tokens of a block of the KV events")
	fs.Float64Var(&o.prefixWeight, "prefix-weight", 1, "weight of the prefix score")
	fs.Float64Var(&o.loadWeight, "load-weight", 2, "weight of the load score")
	fs.Float64Var(&o.activeWeight, "active-weight", 1, "weight of the active-request score (0: the waiting queue alone weighs load)")
	fs.IntVar(&o.queueThreshold, "queue-threshold", 8, "waiting requests at which the load score reaches 0 (llm-d's default is 128)")
	fs.StringVar(&o.transport, "transport", transportZMQ, "how events reach the router: zmq (each replica's publisher on a loopback port, the router subscribed to each) or direct (in process)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	o.budget = int64(*budget) << 20
	switch {
	case o.replicas < 1 || o.replicas > 64:
		return o, fmt.Errorf("router: -replicas %d, want 1 to 64", o.replicas)
	case o.budget <= 0 || o.concurrency < 1 || o.queueThreshold < 1 || o.prefillRate <= 0 || o.step <= 0 || o.maxTokens < 2 || o.blockSize < 1:
		return o, errors.New("router: -budget-mib, -concurrency, -queue-threshold, -prefill-rate, -step, -block must be positive and -max-tokens at least 2")
	case o.prefixWeight < 0 || o.loadWeight < 0 || o.activeWeight < 0:
		return o, errors.New("router: -prefix-weight, -load-weight and -active-weight must not be negative")
	case o.transport != transportZMQ && o.transport != transportDirect:
		return o, fmt.Errorf("router: -transport %q, want zmq or direct", o.transport)
	}
	return o, nil
}

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, err)
		}
		os.Exit(2)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	f, err := os.Open(o.trace)
	if err != nil {
		return err
	}
	reqs, err := readTrace(f, o.requests)
	f.Close()
	if err != nil {
		return err
	}
	cfg := simConfig{Replicas: o.replicas, Budget: o.budget / int64(o.replicas), Concurrency: o.concurrency,
		PrefillRate: o.prefillRate, Step: o.step, MaxTokens: o.maxTokens, BlockSize: o.blockSize}
	fmt.Fprintf(stdout, "Trace:   %d requests of %s over %v\n", len(reqs), o.trace, reqs[len(reqs)-1].arrival)
	fmt.Fprintf(stdout, "Cluster: %d replicas of %d MiB each (%s, %d B a token), batch of %d, %v a decode step, prefill %.0f tokens/s\n\n",
		o.replicas, cfg.Budget>>20, replicaModel.Name, replicaModel.BytesPerToken(), o.concurrency, o.step, o.prefillRate)
	var results []runResult
	for _, mode := range []string{modePrefix, modeRoundRobin, modeSingle} {
		r, err := runMode(reqs, cfg, mode, o)
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		results = append(results, r)
	}
	report(stdout, results)
	return nil
}

const (
	transportZMQ    = "zmq"
	transportDirect = "direct"
)

const (
	modePrefix     = "by prefix"
	modeRoundRobin = "round-robin"
	modeSingle     = "one cache"
)

// runResult is one mode's replay and its events.
type runResult struct {
	mode string
	// away is the requests routed off their longest cached prefix, awayBlocks the
	// blocks they left behind.
	away, awayBlocks int
	simResult
	events eventStats
}

// eventStats is what the router received.
type eventStats struct {
	Stored, Removed, Cleared int64 // blocks, blocks, events
	Bytes                    int64 // payload bytes the router received, live and replayed (0 in process)
	Published                int64 // payload bytes the replicas published (0 in process)
}

// runMode replays reqs in one mode: routed by prefix or round-robin across
// cfg.Replicas replicas, or on one replica holding all their budgets, batches and
// prefill rates.
func runMode(reqs []request, cfg simConfig, mode string, o options) (runResult, error) {
	res := runResult{mode: mode}
	c, err := newCluster(cfg, mode, o.transport)
	if err != nil {
		return res, err
	}
	pol := c.policy(Scorer{PrefixWeight: o.prefixWeight, LoadWeight: o.loadWeight, ActiveWeight: o.activeWeight, QueueThreshold: o.queueThreshold})
	sr, err := simulate(reqs, c.reps, pol, c.cfg)
	if bp, ok := pol.(*byPrefix); ok {
		res.away, res.awayBlocks = bp.away, bp.awayBlocks
	}
	if err == nil {
		err = c.settle()
	}
	res.simResult = sr
	res.events = c.counts.stats()
	if c.wire != nil {
		res.events.Bytes = c.wire.bytes()
	}
	for _, p := range c.pubs {
		// Each replay buffer keeps every message (publisherOptions): its bytes are
		// all those published.
		res.events.Published += p.Stats().ReplayBytes
	}
	return res, errors.Join(err, c.close())
}

func report(w io.Writer, rs []runResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "routing\treplicas\thit rate\tTTFT p50\tTTFT p99\tmakespan\trejected\tpreempted\tblocks stored\tremoved\tevents MiB\treceived MiB\tKiB/request\tKiB/s\t")
	for _, r := range rs {
		per, rate := 0.0, 0.0
		if r.Requests > 0 {
			per = float64(r.events.Published) / 1024 / float64(r.Requests)
		}
		if r.Makespan > 0 {
			rate = float64(r.events.Published) / 1024 / r.Makespan.Seconds()
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%v\t%v\t%v\t%d\t%d\t%d\t%d\t%.1f\t%.1f\t%.1f\t%.1f\t\n", r.mode, r.Replicas, 100*r.HitRate(),
			r.TTFTP50.Round(time.Millisecond), r.TTFTP99.Round(time.Millisecond), r.Makespan.Round(time.Millisecond),
			r.Rejected, r.Preempted, r.events.Stored, r.events.Removed,
			float64(r.events.Published)/(1<<20), float64(r.events.Bytes)/(1<<20), per, rate)
	}
	tw.Flush()
	fmt.Fprintln(w, `
hit rate     prompt tokens found cached over those looked up, all replicas
TTFT         model time from arrival to the first token: waiting, then prefill of the
             uncached tokens, then one decode step
makespan     model time until the last request finished
events MiB   payload the replicas' publishers sent (vLLM's msgpack batches); KiB per
             request and per second of makespan
received MiB payload the router read, live and from the replay sockets`)
	fmt.Fprintln(w)
	for _, r := range rs {
		fmt.Fprintf(w, "%-12s requests per replica %v", r.mode, r.PerReplica)
		if r.mode == modePrefix {
			fmt.Fprintf(w, "; %d routed off their longest cached prefix, for load (%d blocks of it)", r.away, r.awayBlocks)
		}
		fmt.Fprintln(w)
	}
	if line := readingLine(rs); line != "" {
		fmt.Fprintln(w, "\nReading: "+line)
	}
}

// readingLine says in one line what to compare: routing by prefix against
// round-robin across the same replicas, and against one cache holding every budget,
// which no routing can beat on hits. It is empty without those runs.
func readingLine(rs []runResult) string {
	rate := map[string]float64{}
	for _, r := range rs {
		rate[r.mode] = 100 * r.HitRate()
	}
	p, okP := rate[modePrefix]
	rr, okR := rate[modeRoundRobin]
	one, okO := rate[modeSingle]
	if !okP || !okR || !okO {
		return ""
	}
	line := fmt.Sprintf("routing by the replicas' KV events found %.1f%% of prompt tokens cached, round-robin %.1f%%, one cache holding all the budgets %.1f%% (what the replicas would find were they one)",
		p, rr, one)
	if one-rr < 1 {
		return line + ": these requests share too little for routing to matter (more -requests reach later turns of the same conversations)"
	}
	return line + ": by prefix should come near the one cache and above round-robin"
}
