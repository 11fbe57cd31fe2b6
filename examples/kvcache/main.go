// Command kvcache replays a real LLM serving trace against vmarena's KV cache and the
// strategies a Go server would otherwise use, and shows what each one costs in
// memory and time. Run it with no flags:
//
//	go run ./examples/kvcache
//
// It prints live progress, a comparison table and the path of a plot of physical
// memory over time. Run it with -help for the flags and what the defaults mean. Given
// a trace with token IDs (-trace mooncake.jsonl), it compares automatic prefix caching
// instead (see runPrefix).
package main

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/internal/causes"
	"github.com/vmarena/vmarena/kv"
)

//go:embed testdata/azure-llm-2023-conv.csv
var bundledTrace []byte

const bundledTraceName = "Azure LLM inference trace 2023, conversation (bundled)"

// The Mooncake conversation trace (FAST'25 release), with each prompt's block hashes:
// -trace mooncake replays it without a copy of the file.
//
//go:embed testdata/mooncake-fast25-conversation.jsonl
var bundledMooncake []byte

const (
	mooncakeFlag        = "mooncake"
	bundledMooncakeName = "Mooncake conversation trace, FAST'25 (bundled)"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// startCPUProfile starts a CPU profile written to path and returns what stops it and
// closes the file.
func startCPUProfile(path string) (func() error, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("-cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("-cpuprofile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		return nil
	}, nil
}

// defaultIdle is -idle's default: long enough for the pool's decay (5 s) to give
// every idle granule back after the load stops.
const defaultIdle = 6 * time.Second

// config is everything the flags say.
type config struct {
	trace       string
	requests    int
	skip        int
	speed       float64
	step        time.Duration
	model       string
	kvDType     string // -kv-dtype: the KV's element type, or kvDTypeDefault
	kvShrink    int    // -kv-shrink: divide every group's K/V heads × head dim by it
	verify      bool   // -verify: read every live token back before its sequence closes
	uniform     bool   // -uniform: the model's window groups made full attention
	system      int
	maxTokens   int
	budget      sizeFlag
	concurrency int
	backing     string
	layout      string
	runTokens   int
	granule     sizeFlag
	populate    bool
	huge        bool
	poolLow     int
	poolHigh    int
	mapAhead    bool
	promptScale float64
	idle        time.Duration
	strategies  string
	out         string
	format      string
	progress    string
	metrics     string
	prefillRate float64
	cpuprofile  string
	causes      bool // -causes: count what each decode step paid, by cause (causes.go)
	rounds      int  // -rounds: fair timing, each strategy in a child process
	child       bool // -child (hidden): a fair-timing child; see fair.go
	// The prefix cache's tiers (tiers.go).
	tiers       string
	hostTier    sizeFlag
	redisAddr   string
	redisKillAt int
	replicas    int
	budgetIdeal float64
	adapters    int // -adapters: LoRA adapters the prefix-cache replay interleaves
	tierWait    time.Duration
	tierThrough bool   // -tier-write-through
	tierMinHits int    // -tier-min-hits
	fileTier    string // -file-tier (filetier.go)
	restart     bool   // -restart
	restartHalf int    // -restart-half (hidden): the child of -restart replays this half
	idealNote   string // how -budget-ideal set the budget, for the header
	// prefix is set for a trace with token IDs (Mooncake): the prefix-cache replay.
	prefix bool
	set    map[string]bool // flags given on the command line
}

const usageText = `Usage: go run ./examples/kvcache [flags]

Replays an LLM serving trace (arrival time, prompt tokens, output tokens per request)
against vmarena's KV cache and three strategies a Go server would otherwise use:

  vmarena  this project's cache: per-sequence K/V on a stable base, growing in
           granule steps; the system prompt is one shared Prefix, mapped, owned once
  eager    every sequence preallocates -max-tokens and clears it (ollama's num_ctx
           per slot); slots are kept for reuse
  paged    vLLM's design: 16-token blocks from a pool grown in 64 MiB chunks, a block
           table per sequence, the prefix's whole blocks shared by reference count
  append   one Go slice per layer's K and V, grown with append

Each strategy serves the same requests, one strategy after another so that only one
holds memory at a time. The baselines hold host memory; vmarena holds what -backing
says (host shared memory by default on Linux, private host memory elsewhere, a GPU's
memory with -backing cuda). A request starts on the shared -system-prompt, prefills its
prompt layer by layer (all of a layer's tokens, then the next layer's, as a model's
forward pass writes them), then decodes one token per batch iteration in a continuous
batch of at most -concurrency requests; every token's K and V are really written. Time is simulated:
each batch iteration stands for -step of model time, so waits are in model seconds and
do not depend on this machine; the time spent in the memory layer is real (wall
clock). Each strategy's memory is bounded by the same -budget through a governor:
when it is full, requests wait to be admitted (and a running request whose next token
does not fit waits a step) rather than fail.

The defaults replay the first 100 requests of the bundled trace (43 s of a
production conversation service) for Llama-3-8B, 128 KiB of K/V per token, with a
1,024-token system prompt and an 8,192-token context window, at 1x speed, under a
3 GiB budget. That is enough load that preallocating the context window (1 GiB per
sequence) leaves room for two requests at a time while the others wait, and small
enough that each strategy holds at most the 3 GiB budget by its own count (the
process's RSS goes higher in append's replay: the Go heap is capped at 4.5 GiB for the
baselines, 1.5 times the budget); most of the time is writing 12 GiB of K/V per strategy (and as much again for eager and append, which
copy the system prompt into every sequence). Each replay then goes on sampling memory
for -idle (6 s) of wall-clock time without load, so that the plot shows what each
strategy keeps and what vmarena's pool gives back by decay (5 s unused; it never
decays below -pool-low); -idle 0 skips it. Raise -requests, -speed or -budget for a
longer, larger run. -prompt-scale 4 replays the same requests with prompts four times
as long (clipped at -max-tokens): a replay of long prompts.

A trace with token IDs (Mooncake's JSON lines, whose hash_ids name each prompt's
512-token blocks; -trace tells the formats apart by content; -trace mooncake is the
bundled Mooncake conversation trace) runs the prefix-cache
replay instead: vmarena with kv.PrefixCache on and off, and paged with a vLLM-style
prefix cache, at one budget. For flags not given it uses qwen2.5-0.5b, -max-tokens
32768, -requests 100, -budget 1.5GiB and no system prompt; prefill costs model time in
proportion to the uncached prompt tokens (-prefill-rate). It prints the hit rate next
to an unbounded cache's, time to first token, makespan, memory, and the memory held
once the load stops, and plots memory and the hit rate over time.

Layer groups: -model gpt-oss-20b (or gpt-oss-120b, gemma-3-27b, gemma-3-12b,
llama-4-scout, deepseek-v3, deepseek-r1, qwen3-next-80b-a3b: kv.Presets) builds
vmarena's cache on the model's groups (kv.Config.Model), and the replay writes each
group in its own shape: K and V of its heads, head dim and element type; an MLA
group's one latent per layer (no V); a recurrent group's state per sequence and
layer, written whole at prefill (a step's update of it is the kernel's, in place). A
sliding-window or chunked group gives its granules back behind the window. vmarena runs there
with map-ahead per group (-map-ahead), beside paged where every group is full
attention or a sliding window and every token one size (gpt-oss: a block table per
layer group that gives back a window group's blocks behind the window, as vLLM's
hybrid KV cache manager does; eager and append model full attention only and do not
run), in the blocked layout; vmarena's system prompt is a sequence of its own that
every request forks (kv.Sequence.ForkAt, per group, which copies a recurrent state that Freeze refuses), or
copies where the backing can not share. Flags that ask for what can not run are
refused. The report adds each group's committed bytes (a mapped granule counted in
every sequence that maps it) against a uniform full-attention cache of the same
sequences (kv.Model.Uniform), and a second plot draws them over time. -verify reads
back, before each sequence closes, every token a later step still reads and every
state, and fails on a wrong byte. The prefix-cache replay (-trace mooncake) runs on
models of window groups beside full or MLA ones, under kv's hybrid rule (a hit of n
tokens needs each window group's last window before n), without tiers; its ideal is
an unbounded cache's, which the rule does not lower there (kv's entries keep every
window unit their prompts held). On a model with recurrent groups
(qwen3-next-80b-a3b) the prefill records the states at each 512-token block boundary,
the trace's hash blocks (kv.Sequence.Checkpoint), and inserts the prompt so far
there, and a hit starts on the latest such checkpoint it reaches; the replay then
runs the model's full-attention layers alone at the same budget (a prefix cache with
no checkpoint to keep) and prints the ratio of the hit rates and the checkpoints'
bytes.

Element types: -kv-dtype fp8 (OCP E4M3; fp8-e5m2, q8_0, fp16, bf16) stores every
strategy's KV in that type instead of the preset's (a recurrent state keeps the
model's): the same model at half of fp16's bytes per token.

Adapters: -adapters 2 serves the prefix-cache replay's requests under two LoRA
adapters, interleaved (request i under adapter i mod 2): the same prompt gives other
K/V under another adapter, so vmarena's prefix cache keeps each adapter's entries in a
kv.Namespace of its own, which no hit crosses (and the paged baseline keeps them apart
by token IDs). The ideal is an unbounded cache per adapter; a table then gives each
adapter's hit rate next to its ideal, and a line what one cache shared by all adapters
would find (the hits no namespace may cross). With -verify a prompt's K/V is a function of
its adapter too, so a hit across adapters fails the replay.

Tiers: -tiers host,redis adds vmarena+tiers, the prefix cache with stores below the
device, in that order: evicted blocks are written down into each and loaded back by a
lookup that misses on the device. host is kvtier/hosttier under a budget of its own
(-host-tier-budget, by default -budget); redis is kvtier/redistier on -redis ADDR,
or, without it, on a redis-server the example starts on a free 127.0.0.1 port and
stops at the end. With tiers every prompt token's K and V are a function of the
tokens up to it and every hit is read back and compared, byte for byte. It prints
where the hits came from (device, host, redis) next to vmarena+prefix-cache, tiers
off. -replicas 2 replays the requests again on a second replica with a cache and
host tier of its own, sharing the Redis: what B finds there, A stored.
-redis-kill-at N kills the started server once N requests are done. Blocks go down as
they are evicted; -tier-write-through stores them as soon as the cache holds them, and
-tier-min-hits K only those of entries hit K times. -budget-ideal F
sets -budget to F times the trace's ideal cache (the distinct prompt tokens an
unbounded cache's hits read).

Fair timing: -rounds N replays each strategy in a fresh process of this binary
instead, one at a time, N rounds, in the order of -strategies in odd rounds and in the
reverse order in even ones. Strategies run one after another in one process are not
on equal terms: a later one finds memory an earlier one faulted in (on a VM a fresh
page may cost a fault in the host too). It prints every run's figures, each
strategy's median and range, and the median and range of vmarena's ratio to each
other strategy, taken within each round: the figures to compare. Among them, cpu is
the child process's CPU time (user and system), which a loaded machine lengthens
less than the wall-clock times. It draws no plot and runs no idle tail; it works for
both replays and on layer groups (the per-group figures are left out). Map-ahead on
against off: -strategies vmarena,vmarena-noahead,paged (or vmarena+prefix-cache-noahead
in the prefix-cache replay) adds vmarena with map-ahead off, whatever -map-ahead says,
and vmarena's ratio to it is on over off, round by round.

Output: live progress, then two tables, a row per strategy.
Memory:
  peak      highest physical memory held (bytes allocated and touched; for vmarena
            the governor's owned bytes, idle pooled granules included)
  /need     peak over the highest exact need (live tokens, the prefix counted once)
  waste     share of physical memory not holding live tokens, averaged over time
  saved     most bytes the shared prefix spared at once (mapped, not copied)
Time:
  step p50, p99  wall time per decode step of one request in the memory layer
            (append one token, write its K and V in every layer)
  memory    wall time of every memory-layer call (prefill, decode, close)
  waited    requests that finished later than on an idle server (waiting for a
            place in the batch or for memory, stalled steps, preemption)
  refused   of those, requests that memory refused at least once
  wait p50, p99  how much later, in model time
  makespan  model time to serve every request
a line on how to read them, and the path of a plot of physical memory over time (in
-out, by default kvcache-plots/RUN under the current directory), one line per strategy: model
time while the load runs, then the idle tail's wall-clock time; a run that ends far
later than the others (eager's) is drawn past a break in the time axis.

Flags:
`

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{budget: sizeFlag(3 << 30)}
	fs := flag.NewFlagSet("kvcache", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageText)
		// Every flag but the hidden one, with its own default.
		shown := flag.NewFlagSet("kvcache", flag.ContinueOnError)
		shown.SetOutput(fs.Output())
		fs.VisitAll(func(f *flag.Flag) {
			if f.Name != childFlag && f.Name != restartHalfFlag {
				shown.Var(f.Value, f.Name, f.Usage)
				shown.Lookup(f.Name).DefValue = f.DefValue
			}
		})
		shown.PrintDefaults()
	}
	fs.StringVar(&c.trace, "trace", "", "trace file: CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens, or Mooncake JSON lines with hash_ids, told apart by content; \"mooncake\": the bundled Mooncake conversation trace (default: the bundled Azure LLM 2023 conversation trace)")
	fs.IntVar(&c.requests, "requests", 100, "how many requests of the trace to replay (0: all)")
	fs.IntVar(&c.skip, "skip", 0, "skip this many requests at the start of the trace")
	fs.Float64Var(&c.speed, "speed", 1, "divide the trace's arrival times by this (0: every request arrives at once)")
	fs.DurationVar(&c.step, "step", 25*time.Millisecond, "simulated model time of one batch iteration (one decode step)")
	fs.StringVar(&c.model, "model", kv.Llama3_8B().Name, "model: a uniform model (every layer full attention) or a model of layer groups (sliding-window, chunked-local, MLA latent, recurrent state; vmarena alone, on kv.Config.Model): "+modelNames())
	fs.StringVar(&c.kvDType, "kv-dtype", kvDTypeDefault, "the KV's element type for every strategy: model (the preset's own), fp16, bf16, fp8 (OCP E4M3), fp8-e5m2 or q8_0 (32 int8 values and an f16 scale in 34 bytes); a recurrent state keeps the model's")
	fs.IntVar(&c.kvShrink, "kv-shrink", 1, "divide every group's K/V heads × head dim by this power of two (heads first): the same groups, windows and, with -granule divided by it too, blocks in tokens, at that fraction of the bytes, for a replay whose tiers would not fit this machine (the model's name gets /N)")
	fs.BoolVar(&c.uniform, "uniform", false, "with a model of layer groups: make its sliding-window and chunked-local groups full attention (kv.Model.Uniform), the cache the same model takes when it keeps every token, for comparison")
	fs.BoolVar(&c.verify, "verify", false, "read back, before each sequence closes, every token a later step would still read in every layer, and every recurrent state, and fail on a byte other than was written (slows the replay); in the prefix-cache replay, every hit token of every layer a later step reads, against what was written for its prefix (always with -tiers)")
	fs.IntVar(&c.system, "system-prompt", 1024, "tokens of the system prompt every request shares")
	fs.IntVar(&c.maxTokens, "max-tokens", 8192, "most tokens per sequence (the context window); longer requests are clipped")
	fs.Var(&c.budget, "budget", "memory budget per strategy, like 4GiB or 512MiB (0: unlimited)")
	fs.IntVar(&c.concurrency, "concurrency", 32, "most requests in the batch at once")
	fs.StringVar(&c.backing, "backing", defaultBacking, "vmarena's backing: "+strings.Join(backings, ", ")+" (shared needs Linux)")
	fs.StringVar(&c.layout, "layout", kv.Config{}.Layout.String(), "vmarena's layout: blocked or per-layer (default: kv's)")
	fs.IntVar(&c.runTokens, "run-tokens", kv.Config{}.RunTokens, "vmarena, blocked layout: cut each block into runs of this many tokens of every layer (kv.Config.RunTokens, a power of two: 16 is a paged kernel's page; a group whose blocks it does not divide keeps one run a block); 0, kv's default, leaves each block one run")
	fs.Var(&c.granule, "granule", "vmarena's granule, like 2MiB (default: the backing's)")
	fs.BoolVar(&c.populate, "populate", true, "vmarena: make committed granules resident at commit (fewer page faults)")
	fs.BoolVar(&c.huge, "huge", true, "vmarena, host backings: transparent huge pages where the system allows them and they pay (false: never)")
	fs.IntVar(&c.poolLow, "pool-low", 0, "vmarena, shared and cuda backings: idle granules the pool keeps ready, refilled off the token path (0: none)")
	fs.BoolVar(&c.mapAhead, "map-ahead", !(kv.Config{}).NoMapAhead, "vmarena, shared and cuda backings: commit the block a growing sequence needs next into its range ahead of the step, so that the step makes no system call (kv's default; false sets kv.Config.NoMapAhead); the strategy vmarena-noahead (vmarena+prefix-cache-noahead, ...) is vmarena with it off, to compare in one run")
	fs.IntVar(&c.poolHigh, "pool-high", 0, "vmarena, shared and cuda backings: most idle granules the pool keeps; those above -pool-low go back to the OS by decay once unused (0: as many as -budget holds, so decay decides; without a budget the larger of -pool-low and 64)")
	fs.Float64Var(&c.promptScale, "prompt-scale", 1, "multiply every request's prompt tokens by this (a replay of long prompts; prompts past -max-tokens are clipped); CSV traces only")
	fs.DurationVar(&c.idle, "idle", defaultIdle, "after the load stops, keep sampling memory for this much wall-clock time (a pool's decay runs on the real clock), plotted after the last request (0: not at all)")
	fs.StringVar(&c.strategies, "strategies", strings.Join(allStrategies, ","), "comma-separated strategies to run, in order")
	fs.StringVar(&c.out, "out", "", "directory for the plots, made if missing (default: "+plotsDir+"/RUN under the current directory, RUN naming the trace, the model and the tiers, so that runs of another kind do not overwrite them)")
	fs.StringVar(&c.format, "format", "png", "plot format: png or svg")
	fs.StringVar(&c.progress, "progress", "auto", "progress display: auto (a bar on a terminal, lines otherwise), bar, lines or none")
	fs.StringVar(&c.metrics, "metrics", "", "serve Prometheus metrics of the strategy replaying at http://ADDR/metrics, like 127.0.0.1:9090 (default: none)")
	fs.BoolVar(&c.causes, "causes", false, "count what each decode step pays on the replaying thread, by cause (page faults, sleeps, preemptions, the backing's system calls, locks found held, wake-ups), and print their distribution over all steps and over those above the p50 and the p99 step; Linux only, not with -rounds (the counting slows the replay: read the counts, not the times)")
	fs.StringVar(&c.cpuprofile, "cpuprofile", "", "write a CPU profile of the run to this file (go tool pprof reads it); not with -rounds")
	fs.IntVar(&c.rounds, "rounds", 0, "fair timing: replay each strategy in a fresh process of this binary, one at a time, this many rounds in alternating order, and report the median and range of each figure and of vmarena's ratio to each other strategy (no plot, no idle tail); 0: every strategy in this process, one after another")
	fs.BoolVar(&c.child, childFlag, false, "a fair-timing child: replay the one strategy of -strategies and write its result on stdout as JSON (what -rounds runs)")
	fs.Float64Var(&c.prefillRate, "prefill-rate", DefaultPrefillRate, "prefix-cache replay: prompt tokens prefilled per second of model time (time to first token grows with the uncached tokens)")
	fs.StringVar(&c.tiers, "tiers", "", "prefix-cache replay: the tiers below the device, in order, comma-separated: host (kvtier/hosttier), redis (kvtier/redistier), file (kvtier/filetier in -file-tier); adds the strategy "+namePrefixTiers+" (default: none)")
	fs.Var(&c.hostTier, "host-tier-budget", "-tiers host: the host tier's budget per replica, like 1GiB (default: -budget)")
	fs.StringVar(&c.redisAddr, "redis", "", "-tiers redis: HOST:PORT of a Redis or Valkey server (default: start redis-server on a free 127.0.0.1 port, and stop it at the end)")
	fs.IntVar(&c.redisKillAt, "redis-kill-at", 0, "-tiers redis: kill the redis-server started here once this many requests of "+namePrefixTiers+" are done (0: never)")
	fs.IntVar(&c.replicas, "replicas", 1, "-tiers redis: replicas of "+namePrefixTiers+", each with its cache and host tier, sharing the Redis; 2: replica B replays the requests after A")
	fs.DurationVar(&c.tierWait, "tier-wait", 0, "-tiers: how long a lookup waits for the tiers' loads, and a store for its tier, in wall-clock time, then goes on without (0: the cache's default, 100ms)")
	fs.BoolVar(&c.tierThrough, "tier-write-through", false, "-tiers: store a cached entry's blocks into the tiers as soon as the cache holds them (kv.PrefixCacheOptions.TierWriteThrough), not only as they are evicted")
	fileTierFlags(fs, c)
	fs.IntVar(&c.tierMinHits, "tier-min-hits", 0, "-tiers: the reuse threshold: store only the blocks of entries lookups hit this many times (kv.PrefixCacheOptions.TierMinHits) (0: every block)")
	fs.IntVar(&c.adapters, "adapters", 0, fmt.Sprintf("prefix-cache replay: serve the requests under this many LoRA adapters, request i under adapter i mod N, each in a kv.Namespace of its own (no hit crosses adapters; the paged baseline keeps them apart by token IDs), and print each adapter's hit rate (0 or 1: the base model only; at most %d)", maxAdapters))
	fs.Float64Var(&c.budgetIdeal, "budget-ideal", 0, "prefix-cache replay: set -budget to this fraction of the ideal cache (the distinct prompt tokens an unbounded cache's hits read, from the trace) (0: -budget)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	c.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { c.set[f.Name] = true })
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (flags only; see -help)", fs.Arg(0))
	}
	return c, nil
}

// validate checks the flags and turns them into a setup and workload shape.
func (c *config) validate() (setup, []string, error) {
	var s setup
	g, groups, err := lookupModel(c.model)
	if err != nil {
		return s, nil, err
	}
	dt, err := parseKVDType(c.kvDType)
	if err != nil {
		return s, nil, err
	}
	if g, groups, err = withDType(g, groups, dt); err != nil {
		return s, nil, err
	}
	if g, groups, err = withShrink(g, groups, c.kvShrink); err != nil {
		return s, nil, err
	}
	if c.uniform {
		if groups == nil {
			return s, nil, fmt.Errorf("-uniform: -model %s is uniform, every layer full attention already", g.Name)
		}
		u := groups.Uniform()
		groups = &u
	}
	s.model, s.groups = g, groups
	switch {
	case c.requests < 0:
		return s, nil, fmt.Errorf("-requests %d is negative", c.requests)
	case c.skip < 0:
		return s, nil, fmt.Errorf("-skip %d is negative", c.skip)
	case c.speed < 0:
		return s, nil, fmt.Errorf("-speed %v is negative", c.speed)
	case c.step <= 0:
		return s, nil, fmt.Errorf("-step %v must be positive", c.step)
	case c.system < 0:
		return s, nil, fmt.Errorf("-system-prompt %d is negative", c.system)
	case c.maxTokens <= c.system:
		return s, nil, fmt.Errorf("-max-tokens %d must exceed -system-prompt %d", c.maxTokens, c.system)
	case c.concurrency <= 0:
		return s, nil, fmt.Errorf("-concurrency %d must be positive", c.concurrency)
	case c.format != "png" && c.format != "svg":
		return s, nil, fmt.Errorf("-format %q: want png or svg", c.format)
	}
	switch c.progress {
	case "auto", "bar", "lines", "none":
	default:
		return s, nil, fmt.Errorf("-progress %q: want auto, bar, lines or none", c.progress)
	}
	known := false
	for _, l := range []kv.Layout{kv.Blocked, kv.PerLayer} {
		if c.layout == l.String() {
			s.layout, known = l, true
		}
	}
	if !known {
		return s, nil, fmt.Errorf("-layout %q: want blocked or per-layer", c.layout)
	}
	if c.runTokens != 0 && (c.runTokens < 0 || s.layout != kv.Blocked) {
		return s, nil, fmt.Errorf("-run-tokens %d: want a power of two, with -layout %v", c.runTokens, kv.Blocked)
	}
	s.runTokens = c.runTokens
	known = false
	for _, b := range backings {
		known = known || b == c.backing
	}
	if !known {
		return s, nil, fmt.Errorf("-backing %q: want one of %s", c.backing, strings.Join(backings, ", "))
	}
	if c.granule != 0 && (c.granule&(c.granule-1) != 0 || c.granule < 4096) {
		return s, nil, fmt.Errorf("-granule %v: want a power of two of at least 4KiB", c.granule)
	}
	var names []string
	seen := map[string]bool{}
	strategies := allStrategies
	if c.prefix {
		strategies = prefixStrategies
		if c.tiers != "" {
			strategies = append(slices.Clip(strategies), namePrefixTiers)
		}
	}
	strategies = append(slices.Clip(strategies), aheadTwins(strategies)...)
	for _, n := range strings.Split(c.strategies, ",") {
		n = strings.TrimSpace(n)
		ok := false
		for _, k := range strategies {
			ok = ok || k == n
		}
		if !ok {
			return s, nil, fmt.Errorf("-strategies: unknown strategy %q (known: %s)", n, strings.Join(strategies, ", "))
		}
		if !seen[n] {
			names = append(names, n)
			seen[n] = true
		}
	}
	if groups != nil {
		if names, s.notes, err = c.groupsOnly(groups, names); err != nil {
			return s, nil, err
		}
	}
	s.backing, s.granule, s.populate, s.huge = c.backing, int(c.granule), c.populate, c.huge
	if c.poolLow < 0 {
		return s, nil, fmt.Errorf("-pool-low %d: must not be negative", c.poolLow)
	}
	s.poolLow = c.poolLow
	switch {
	case c.poolHigh < 0:
		return s, nil, fmt.Errorf("-pool-high %d: must not be negative", c.poolHigh)
	case c.poolHigh > 0 && c.poolHigh < c.poolLow:
		return s, nil, fmt.Errorf("-pool-high %d is below -pool-low %d", c.poolHigh, c.poolLow)
	case !(c.promptScale > 0) || math.IsInf(c.promptScale, 0):
		return s, nil, fmt.Errorf("-prompt-scale %v: want a positive number", c.promptScale)
	case c.promptScale != 1 && c.prefix:
		return s, nil, fmt.Errorf("-prompt-scale %v: a trace with token IDs can not be scaled (its prompts are its blocks)", c.promptScale)
	case c.idle < 0:
		return s, nil, fmt.Errorf("-idle %v is negative", c.idle)
	case c.rounds < 0:
		return s, nil, fmt.Errorf("-rounds %d is negative", c.rounds)
	case c.rounds > 0 && c.cpuprofile != "":
		return s, nil, fmt.Errorf("-cpuprofile profiles one process: it can not be used with -rounds %d (each strategy replays in a process of its own)", c.rounds)
	case c.rounds > 0 && c.causes:
		return s, nil, fmt.Errorf("-causes counts one process: it can not be used with -rounds %d (each strategy replays in a process of its own)", c.rounds)
	case c.rounds > 0 && c.metrics != "":
		return s, nil, fmt.Errorf("-metrics serves one process: it can not be used with -rounds %d (each strategy replays in a process of its own)", c.rounds)
	case c.child && len(names) != 1:
		return s, nil, fmt.Errorf("-%s replays one strategy, not %d (-strategies %s)", childFlag, len(names), strings.Join(names, ","))
	}
	switch {
	case c.budgetIdeal < 0 || math.IsNaN(c.budgetIdeal) || math.IsInf(c.budgetIdeal, 0):
		return s, nil, fmt.Errorf("-budget-ideal %v: want a positive fraction", c.budgetIdeal)
	case c.budgetIdeal > 0 && !c.prefix:
		return s, nil, fmt.Errorf("-budget-ideal needs a trace with token IDs (-trace %s)", mooncakeFlag)
	case c.adapters < 0 || c.adapters > maxAdapters:
		return s, nil, fmt.Errorf("-adapters %d: want 0 to %d", c.adapters, maxAdapters)
	case c.adapters > 1 && !c.prefix:
		return s, nil, fmt.Errorf("-adapters needs a trace with token IDs (-trace %s)", mooncakeFlag)
	case c.budgetIdeal > 0 && c.set["budget"]:
		return s, nil, fmt.Errorf("-budget-ideal %v and -budget %s both set the budget: give one", c.budgetIdeal, formatBytes(int64(c.budget)))
	}
	if err := c.validateTiers(&s); err != nil {
		return s, nil, err
	}
	if s.tiers != nil && !c.set["strategies"] {
		names = []string{namePrefixOn, namePrefixTiers}
	}
	s.poolHigh = c.poolHigh
	s.mapAhead = c.mapAhead
	if c.causes {
		causes.Enable() // NB: before any backing is built, so that they count their calls
	}
	s.maxTokens, s.budget = c.maxTokens, int64(c.budget)
	if err := s.shape().Validate(); err != nil {
		return s, nil, fmt.Errorf("-max-tokens %d with %s: %w", c.maxTokens, g.Name, err)
	}
	if groups != nil {
		if err := groups.Validate(c.maxTokens); err != nil {
			return s, nil, fmt.Errorf("-max-tokens %d with %s: %w", c.maxTokens, g.Name, err)
		}
	}
	return s, names, nil
}

// loadTrace reads the trace the flags name and slices it.
func (c *config) loadTrace() ([]Request, string, error) {
	name, data := bundledTraceName, bundledTrace
	switch c.trace {
	case "":
	case mooncakeFlag:
		name, data = bundledMooncakeName, bundledMooncake
	default:
		b, err := os.ReadFile(c.trace)
		if err != nil {
			return nil, "", err
		}
		name, data = c.trace, b
	}
	reqs, err := ReadAnyTrace(data)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", name, err)
	}
	if c.skip >= len(reqs) {
		return nil, "", fmt.Errorf("-skip %d: the trace has only %d requests", c.skip, len(reqs))
	}
	reqs = reqs[c.skip:]
	if c.requests > 0 && c.requests < len(reqs) {
		reqs = reqs[:c.requests]
	}
	// Renumber from 0 so that request IDs index this replay.
	out := make([]Request, len(reqs))
	for i, r := range reqs {
		r.ID = i
		if c.promptScale != 1 {
			r.Context = max(1, int(math.Round(float64(r.Context)*c.promptScale)))
		}
		out[i] = r
	}
	return out, name, nil
}

// plotsDir is where the plots go unless -out says: a directory under the current one.
const plotsDir = "kvcache-plots"

// defaultOut returns the plots' directory for a run without -out: plotsDir/RUN, RUN
// naming the trace, the model (and its KV type when -kv-dtype set it) and the tiers.
func defaultOut(c *config, s setup) string {
	trace := "azure-conv"
	switch c.trace {
	case "":
	case mooncakeFlag:
		trace = mooncakeFlag
	default:
		trace = strings.TrimSuffix(filepath.Base(c.trace), filepath.Ext(c.trace))
	}
	parts := []string{trace, c.model}
	if c.set["kv-dtype"] {
		parts = append(parts, c.kvDType)
	}
	if s.tiers != nil {
		parts = append(parts, "tiers")
	}
	return filepath.Join(plotsDir, strings.Join(parts, "-"))
}

// run is the program: it returns the exit status (0 ok, 1 failure, 2 bad usage).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: %v\n", err)
		return 2
	}
	if err := c.prefixDefaults(); err != nil {
		fmt.Fprintf(stderr, "kvcache: %v\n", err)
		return 1
	}
	s, names, err := c.validate()
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: %v\n", err)
		return 2
	}
	reqs, traceName, err := c.loadTrace()
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: %v\n", err)
		return 1
	}
	if c.out == "" {
		c.out = defaultOut(c, s)
	}
	if c.cpuprofile != "" {
		stop, err := startCPUProfile(c.cpuprofile)
		if err != nil {
			fmt.Fprintf(stderr, "kvcache: %v\n", err)
			return 1
		}
		defer func() {
			if err := stop(); err != nil {
				fmt.Fprintf(stderr, "kvcache: %v\n", err)
			}
		}()
	}
	if c.metrics != "" {
		ms, err := startMetrics(c.metrics)
		if err != nil {
			fmt.Fprintf(stderr, "kvcache: %v\n", err)
			return 1
		}
		defer ms.Close()
		s.metrics = ms
		fmt.Fprintf(stdout, "Serving metrics at http://%s/metrics\n", ms.Addr())
	}
	if c.prefix {
		w := PrefixWorkload{Requests: reqs, Speed: c.speed, Step: c.step, PrefillRate: c.prefillRate,
			Concurrency: c.concurrency, MaxTokens: c.maxTokens, TokenBytes: s.model.Groups[0].TokenBytes(), Layers: s.model.Layers,
			Plan: planLayers(s.groups), Groups: s.groups, Verify: s.tiers != nil || c.verify, Adapters: c.adapters, Causes: c.causes}
		if code := c.prefixBudget(&s, w, stderr); code != 0 {
			return code
		}
		w.Requests = c.restartRequests(w.Requests)
		if s.tiers != nil {
			if err := s.tiers.connect(); err != nil {
				fmt.Fprintf(stderr, "kvcache: %v\n", err)
				return 1
			}
			defer func() {
				if err := s.tiers.close(); err != nil {
					fmt.Fprintf(stderr, "kvcache: %v\n", err)
				}
			}()
		}
		switch {
		case c.child:
			return runChild(stdout, stderr, names[0], func() (any, error) {
				res, err := replayPrefixOne(ctx, names[0], s, w)
				res.Samples = nil
				return res, err
			})
		case c.rounds > 0:
			printPrefixHeader(stdout, c, s, reqs, traceName)
			return runFairHere(ctx, prefixFairReplay, args, names, c, stdout, stderr)
		case c.restart:
			return runRestart(ctx, c, s, w, args, traceName, stdout, stderr)
		}
		return runPrefix(ctx, c, s, names, w, traceName, stdout, stderr)
	}
	w := Workload{
		Requests:     reqs,
		Speed:        c.speed,
		Step:         c.step,
		Concurrency:  c.concurrency,
		SystemPrompt: c.system,
		Layers:       s.model.Layers,
		Plan:         planLayers(s.groups),
		MaxTokens:    c.maxTokens,
		Idle:         c.idle,
		Verify:       c.verify,
		Causes:       c.causes,
	}
	w.TokenBytes = planBytes(w.Plan, s.model.Groups[0].TokenBytes())
	if err := w.validate(); err != nil {
		fmt.Fprintf(stderr, "kvcache: %v\n", err)
		return 2
	}
	if c.child {
		return runChild(stdout, stderr, names[0], func() (any, error) {
			res, err := replayOne(ctx, names[0], s, w, nopProgress{}, nil)
			res.Samples = nil
			return res, err
		})
	}
	if err := probe(names, s); err != nil {
		fmt.Fprintf(stderr, "kvcache: %v\n", err)
		return 1
	}
	printHeader(stdout, c, s, w, traceName)
	if c.rounds > 0 {
		return runFairHere(ctx, mainFairReplay, args, names, c, stdout, stderr)
	}

	ui := newProgress(c.progress, stdout)
	results, failed, stopped := replayEach(ctx, stderr, names, func(name string) (Result, error) {
		return replayOne(ctx, name, s, w, ui, nil)
	})
	if stopped || len(results) == 0 {
		return 1
	}
	fmt.Fprintln(stdout)
	printTable(stdout, results, s)
	if c.causes {
		printCauses(stdout, resultNames(results), resultCauses(results))
	}
	path, err := writePlot(c.out, c.format, results, s, w)
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: plot: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "\nPlot of physical memory over time: %s\n", path)
	for _, r := range results {
		if r.GroupPeak == nil {
			continue
		}
		path, err := writeGroupPlot(c.out, c.format, r, s, w)
		if err != nil {
			fmt.Fprintf(stderr, "kvcache: plot: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "Plot of each layer group's memory over time: %s\n", path)
	}
	if failed {
		return 1
	}
	return 0
}

// replayEach replays each strategy in turn and returns the results of those that
// succeeded and whether any failed; each failure is reported on stderr. It stops at
// a failure once ctx has ended, and then reports stopped.
func replayEach[R any](ctx context.Context, stderr io.Writer, names []string, replay func(name string) (R, error)) (results []R, failed, stopped bool) {
	for _, name := range names {
		res, err := replay(name)
		if err != nil {
			fmt.Fprintf(stderr, "kvcache: %s: %v\n", name, err)
			failed = true
			if ctx.Err() != nil {
				return results, true, true
			}
			continue
		}
		results = append(results, res)
	}
	return results, failed, false
}

// probe builds and closes every strategy once, so that one that can not be had (a
// CUDA backing without a driver) fails before anything runs.
func probe(names []string, s setup) error {
	for _, name := range names {
		b, err := build(name, s)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if err := b.st.Close(); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

// replayOne builds one strategy, replays the workload on it, closes it and checks
// that everything came back. watch, when set, sees the strategy at every progress
// report.
func replayOne(ctx context.Context, name string, s setup, w Workload, ui progressUI, watch func(baseline.Strategy, Sample)) (Result, error) {
	b, err := build(name, s)
	if err != nil {
		return Result{}, err
	}
	if s.metrics != nil {
		if err := s.metrics.watch(name, b.gov, b.dev, b.st); err != nil {
			return Result{}, errors.Join(err, b.st.Close())
		}
	}
	if s.budget > 0 {
		// The baselines hold Go heap memory, which the garbage collector would let
		// grow to twice what is live (append's outgrown slices) before collecting: cap
		// the heap at half again the budget, as a server would with GOMEMLIMIT.
		defer debug.SetMemoryLimit(debug.SetMemoryLimit(s.budget + s.budget/2))
	}
	ui.start(name, len(w.Requests))
	update := ui.update
	if watch != nil {
		update = func(done int, smp Sample) {
			ui.update(done, smp)
			watch(b.st, smp)
		}
	}
	res, err := Replay(ctx, b.st, w, update)
	ui.finish(res, err)
	if cerr := b.st.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("close: %w", cerr)
	}
	res.GovernorAfter = b.gov.Stats(b.dev).Used
	if b.pool != nil {
		res.PoolAfter = b.pool()
	}
	if err == nil && res.GovernorAfter != 0 {
		err = fmt.Errorf("%d bytes still charged to the governor after Close", res.GovernorAfter)
	}
	// NB: Idle may trail Owned in this snapshot while the pool's background refill
	// has a granule in creation; the governor at zero after the backing's Close
	// (above) is what proves every byte came back.
	if p := res.PoolAfter; err == nil && p != nil && p.Mapped != 0 {
		err = fmt.Errorf("pool not drained after Close: %d bytes still mapped (%d of %d owned idle)", p.Mapped, p.Idle, p.Owned)
	}
	// Give the memory back to the OS before the next strategy runs, so that each
	// starts from the same state and peaks do not add up.
	runtime.GC()
	debug.FreeOSMemory()
	return res, err
}
