package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Fair timing (-rounds N): every strategy replays in a fresh process, the same
// binary run again with the hidden -child flag, so that none inherits the memory an
// earlier one faulted in (on these VMs a fresh page costs host faults, which the
// first strategy of a process pays and the next ones may not). The children run one
// at a time, in the order of -strategies in odd rounds and in the reverse order in
// even ones, and the parent reports the median and range of each figure and of each
// ratio of vmarena's figure to another strategy's, taken within a round.
//
// The child protocol: the parent runs its own executable with its own flags
// followed by -rounds 0 -idle 0 -progress none -strategies NAME -child; flags given
// later win, so the child replays NAME alone, in one process, as a run without
// -rounds would. It writes nothing on stdout but one JSON object, its Result (or
// PrefixResult) without samples, and exits 0; any failure is a non-zero exit with
// the reason on stderr, which the parent reports with the round and the strategy.

// childFlag is the hidden flag that makes the program a fair-timing child.
const childFlag = "child"

// fairOrder returns the order of round r (0-based): names in odd rounds (the first,
// the third, ...), reversed in the others.
func fairOrder(names []string, r int) []string {
	out := slices.Clone(names)
	if r%2 == 1 {
		slices.Reverse(out)
	}
	return out
}

// spread is the median and range of some values.
type spread struct {
	Median, Min, Max float64
	N                int // values counted (NaN left out)
}

// spreadOf returns the median (of an even count, the mean of the middle two) and
// the range of the values that are not NaN; N is 0 when there are none.
func spreadOf(vs []float64) spread {
	var xs []float64
	for _, v := range vs {
		if !math.IsNaN(v) {
			xs = append(xs, v)
		}
	}
	if len(xs) == 0 {
		return spread{Median: math.NaN(), Min: math.NaN(), Max: math.NaN()}
	}
	slices.Sort(xs)
	n := len(xs)
	m := xs[n/2]
	if n%2 == 0 {
		m = (xs[n/2-1] + xs[n/2]) / 2
	}
	return spread{Median: m, Min: xs[0], Max: xs[n-1], N: n}
}

// ratio returns a / b, NaN where b is 0 or either is NaN.
func ratio(a, b float64) float64 {
	if b == 0 || math.IsNaN(a) || math.IsNaN(b) {
		return math.NaN()
	}
	return a / b
}

// figureUnit says how a figure is written.
type figureUnit uint8

const (
	unitDuration figureUnit = iota // nanoseconds
	unitTimes                      // a ratio: 1.00x
	unitPercent                    // 3.97%
)

func (u figureUnit) format(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	switch u {
	case unitDuration:
		return fmtDur(time.Duration(v))
	case unitTimes:
		return fmt.Sprintf("%.2fx", v)
	}
	return fmt.Sprintf("%.2f%%", v)
}

// fairFigure is one figure of a strategy's run that fair timing compares.
type fairFigure[R any] struct {
	name  string
	unit  figureUnit
	value func(R) float64 // NaN: not measured
}

// fairReplay is what fair timing needs to know of a replay's results.
type fairReplay[R any] struct {
	figures []fairFigure[R]
	done    func(R) string // requests served, for the table of runs
}

func peakOverNeed(peak, need int64) float64 {
	if need <= 0 {
		return math.NaN()
	}
	return float64(peak) / float64(need)
}

var mainFairReplay = fairReplay[Result]{
	figures: []fairFigure[Result]{
		{"memory", unitDuration, func(r Result) float64 { return float64(r.MemoryTime) }},
		{"step p50", unitDuration, func(r Result) float64 { return float64(r.StepP50) }},
		{"step p99", unitDuration, func(r Result) float64 { return float64(r.StepP99) }},
		{"peak/need", unitTimes, func(r Result) float64 { return peakOverNeed(r.PeakPhysical, r.PeakNeeded) }},
		{"makespan", unitDuration, func(r Result) float64 { return float64(r.Makespan) }},
	},
	done: func(r Result) string { return fmt.Sprintf("%d/%d", r.Completed, r.Requests) },
}

var prefixFairReplay = fairReplay[PrefixResult]{
	figures: []fairFigure[PrefixResult]{
		{"memory", unitDuration, func(r PrefixResult) float64 { return float64(r.MemoryTime) }},
		{"TTFT p50", unitDuration, func(r PrefixResult) float64 { return float64(r.TTFTP50) }},
		{"TTFT p99", unitDuration, func(r PrefixResult) float64 { return float64(r.TTFTP99) }},
		{"step p50", unitDuration, func(r PrefixResult) float64 { return float64(r.StepP50) }},
		{"step p99", unitDuration, func(r PrefixResult) float64 { return float64(r.StepP99) }},
		{"makespan", unitDuration, func(r PrefixResult) float64 { return float64(r.Makespan) }},
		{"peak/need", unitTimes, func(r PrefixResult) float64 { return peakOverNeed(r.PeakPhysical, r.PeakNeeded) }},
		{"hit rate", unitPercent, func(r PrefixResult) float64 {
			if r.Queries == 0 {
				return math.NaN()
			}
			return 100 * float64(r.Hits) / float64(r.Queries)
		}},
	},
	done: func(r PrefixResult) string { return fmt.Sprintf("%d/%d", r.Completed, r.Requests) },
}

// fairReference returns the strategy the others are compared with: vmarena's
// (with its prefix cache where the replay has one), else the first.
func fairReference(names []string) string {
	// NB: namePrefixOn first: the prefix replay's cache-off strategy is named
	// nameCache too.
	for _, n := range []string{namePrefixOn, nameCache} {
		if slices.Contains(names, n) {
			return n
		}
	}
	return names[0]
}

// childError is a fair-timing child that did not report a result.
type childError struct {
	round, rounds int
	strategy      string
	err           error  // how it ended: an exit status, or a result that did not decode
	stderr        string // the end of what it wrote on stderr
}

func (e *childError) Error() string {
	msg := fmt.Sprintf("fair timing: round %d of %d, %s: child process: %v", e.round, e.rounds, e.strategy, e.err)
	if e.stderr != "" {
		msg += ": " + e.stderr
	}
	return msg
}

func (e *childError) Unwrap() error { return e.err }

// lastLines returns the last n lines of b, trimmed, joined by "; ".
func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "; ")
}

// fairRun is one child's run.
type fairRun[R any] struct {
	round    int
	strategy string
	res      R
	wall     time.Duration // the child process's, start to exit
	cpu      time.Duration // the child process's CPU time, user and system
}

// runFigures returns fr's figures read from a run, and the child's CPU time
// ("cpu"): the whole process's, its replay's memory layer, the cache's own
// goroutines (map-ahead) and the kernel's work for it included, which the machine's
// load does not lengthen as it does wall-clock times.
func runFigures[R any](fr fairReplay[R]) []fairFigure[fairRun[R]] {
	out := make([]fairFigure[fairRun[R]], 0, len(fr.figures)+1)
	for _, f := range fr.figures {
		out = append(out, fairFigure[fairRun[R]]{f.name, f.unit, func(r fairRun[R]) float64 { return f.value(r.res) }})
	}
	return append(out, fairFigure[fairRun[R]]{"cpu", unitDuration, func(r fairRun[R]) float64 { return float64(r.cpu) }})
}

// runChildProcess runs strategy name in a child process of exe with the parent's
// args and decodes its result; cpu is the child's CPU time, user and system.
func runChildProcess[R any](ctx context.Context, exe string, args []string, name string) (res R, cpu time.Duration, err error) {
	cargs := append(slices.Clip(args), "-rounds", "0", "-idle", "0", "-progress", "none", "-strategies", name, "-"+childFlag)
	cmd := exec.CommandContext(ctx, exe, cargs...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return res, 0, &childError{strategy: name, err: err, stderr: lastLines(errOut.Bytes(), 3)}
	}
	cpu = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	dec := json.NewDecoder(&out)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&res); err != nil {
		return res, 0, &childError{strategy: name, err: fmt.Errorf("its result: %w", err), stderr: lastLines(errOut.Bytes(), 3)}
	}
	if dec.More() {
		return res, 0, &childError{strategy: name, err: errors.New("its result: more than one JSON value on stdout")}
	}
	return res, cpu, nil
}

// runFair replays each strategy in a fresh child process of exe, rounds times in
// alternating order, and prints every run, the median and range of each figure per
// strategy, and of each ratio to the reference strategy. It returns the exit status.
func runFair[R any](ctx context.Context, fr fairReplay[R], exe string, args []string, names []string, rounds int, progress string, stdout, stderr io.Writer) int {
	fmt.Fprintf(stdout, "Fair timing: %d rounds, each strategy in a fresh process of this binary, one at a time;\n", rounds)
	if len(names) > 1 {
		fmt.Fprintf(stdout, "order %s in odd rounds, %s in even ones\n\n", strings.Join(names, ", "), strings.Join(fairOrder(names, 1), ", "))
	} else {
		fmt.Fprintln(stdout)
	}
	width := 0
	for _, n := range names {
		width = max(width, len(n))
	}
	var runs []fairRun[R]
	for r := range rounds {
		for _, name := range fairOrder(names, r) {
			t0 := time.Now()
			res, cpu, err := runChildProcess[R](ctx, exe, args, name)
			if err != nil {
				var ce *childError
				if errors.As(err, &ce) {
					ce.round, ce.rounds = r+1, rounds
				}
				fmt.Fprintf(stderr, "kvcache: %v\n", err)
				return 1
			}
			run := fairRun[R]{round: r + 1, strategy: name, res: res, wall: time.Since(t0), cpu: cpu}
			runs = append(runs, run)
			if progress != "none" {
				fmt.Fprintf(stdout, "round %d/%d  %-*s  %s in %v\n", r+1, rounds, width, name, fr.done(res), run.wall.Round(time.Millisecond))
			}
		}
	}
	if progress != "none" {
		fmt.Fprintln(stdout)
	}
	printFair(stdout, fr, names, rounds, runs)
	return 0
}

// printFair writes the runs, each strategy's spread and each ratio's.
func printFair[R any](w io.Writer, fr fairReplay[R], names []string, rounds int, runs []fairRun[R]) {
	figures := runFigures(fr)
	fmt.Fprintln(w, "Runs")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := []string{"round", "strategy"}
	for _, f := range figures {
		head = append(head, f.name)
	}
	fmt.Fprintln(tw, strings.Join(append(head, "done", "wall"), "\t")+"\t")
	for _, run := range runs {
		row := []string{fmt.Sprint(run.round), run.strategy}
		for _, f := range figures {
			row = append(row, f.unit.format(f.value(run)))
		}
		row = append(row, fr.done(run.res), fmtDur(run.wall))
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	_ = tw.Flush()

	// by[strategy][round-1] is that run.
	by := map[string][]fairRun[R]{}
	for _, n := range names {
		by[n] = make([]fairRun[R], rounds)
	}
	for _, run := range runs {
		by[run.strategy][run.round-1] = run
	}
	cell := func(u figureUnit, s spread) string {
		if s.N == 0 {
			return "-"
		}
		return fmt.Sprintf("%s [%s, %s]", u.format(s.Median), u.format(s.Min), u.format(s.Max))
	}
	type figure = fairFigure[fairRun[R]]
	table := func(title string, cols []string, value func(f figure, col string) []float64, unit func(f figure) figureUnit) {
		fmt.Fprintf(w, "\n%s\n", title)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "\t"+strings.Join(cols, "\t")+"\t")
		for _, f := range figures {
			row := []string{f.name}
			for _, c := range cols {
				row = append(row, cell(unit(f), spreadOf(value(f, c))))
			}
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
		_ = tw.Flush()
	}
	table(fmt.Sprintf("Each strategy: median [min, max] over %d rounds", rounds), names,
		func(f figure, n string) []float64 {
			var vs []float64
			for _, r := range by[n] {
				vs = append(vs, f.value(r))
			}
			return vs
		}, func(f figure) figureUnit { return f.unit })

	ref := fairReference(names)
	var others []string
	for _, n := range names {
		if n != ref {
			others = append(others, n)
		}
	}
	if len(others) == 0 {
		return
	}
	table(fmt.Sprintf("%s over each strategy: median [min, max] of the %d rounds' ratios (below 1: %s's figure is lower)", ref, rounds, ref), others,
		func(f figure, n string) []float64 {
			var vs []float64
			for i := range rounds {
				vs = append(vs, ratio(f.value(by[ref][i]), f.value(by[n][i])))
			}
			return vs
		}, func(figure) figureUnit { return unitTimes })
}

// writeChildResult writes a child's result on w as the protocol says: one JSON
// object, samples left out (the parent draws no plot).
func writeChildResult(w io.Writer, v any) error {
	return json.NewEncoder(w).Encode(v)
}

// runFairHere runs fair timing with this process's executable.
func runFairHere[R any](ctx context.Context, fr fairReplay[R], args, names []string, c *config, stdout, stderr io.Writer) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: fair timing needs this program's executable: %v\n", err)
		return 1
	}
	return runFair(ctx, fr, exe, args, names, c.rounds, c.progress, stdout, stderr)
}

// runChild is the child's side of the protocol: it replays the one strategy and
// writes its result on stdout, or the reason it failed on stderr with status 1.
func runChild(stdout, stderr io.Writer, name string, replay func() (any, error)) int {
	res, err := replay()
	if err == nil {
		err = writeChildResult(stdout, res)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvcache: %s: %v\n", name, err)
		return 1
	}
	return 0
}
