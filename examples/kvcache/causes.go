package main

import (
	"fmt"
	"io"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/vmarena/vmarena/internal/causes"
)

// -causes: what each decode step paid beyond its writes, counted by cause on the
// replaying thread (internal/causes): page faults, sleeps (a lock or the kernel's
// memory-map lock waited on), preemptions, the backing's system calls by kind, the
// locks of the map-ahead worker, the prefix cache and the host pool found held, and
// the kicks and broadcasts that may wake another goroutine. The counts, not the
// times, are the figures: the counting itself (two getrusage calls a step, a
// gettid per counted site) is outside the timed step but slows the replay.
//
// NB: allocations are not counted per step: the runtime adds a P's small
// allocations to its statistics only when the P takes a new span, so a per-step
// difference lands on whichever step refills. kv's step test counts them
// (testing.AllocsPerRun) instead.

// causeMeter records, for every decode step that went through, its wall time and
// what it paid.
type causeMeter struct {
	c0, d causes.Counts // at the step's start; what it paid (stop)
	steps []stepCauses
}

type stepCauses struct {
	dt time.Duration
	c  causes.Counts
}

// startCauses locks the calling goroutine to its thread and counts for that thread
// from now on; the function it returns stops counting and unlocks the thread.
func startCauses() (*causeMeter, func(), error) {
	runtime.LockOSThread()
	if err := causes.Track(); err != nil {
		runtime.UnlockOSThread()
		return nil, nil, fmt.Errorf("-causes: counting by thread: %w", err)
	}
	return &causeMeter{}, func() {
		causes.Untrack()
		runtime.UnlockOSThread()
	}, nil
}

// begin is called before a step's clock starts.
func (m *causeMeter) begin() {
	if m != nil {
		m.c0 = causes.Now()
	}
}

// stop is called as the step's clock stops: what the replay does after it (its own
// books) is not the step's.
func (m *causeMeter) stop() {
	if m != nil {
		m.d = causes.Now().Sub(m.c0)
	}
}

// end records the step that stopped last, which took dt, as one that went through.
func (m *causeMeter) end(dt time.Duration) {
	if m != nil {
		m.steps = append(m.steps, stepCauses{dt: dt, c: m.d})
	}
}

// CauseClass is the causes of the steps of one class: all of them, or those slower
// than the p50 or the p99 step.
type CauseClass struct {
	Name  string
	Steps int
	// Mean and Any are, per cause (causeColumns), the mean count per step and the
	// share of steps with at least one.
	Mean, Any []float64
}

// causeColumns are the causes a table shows, in order.
var causeColumns = func() []string {
	cols := []string{"faults", "slept", "preempted", "syscalls"}
	for _, k := range causes.Kinds() {
		cols = append(cols, k.String())
	}
	return cols
}()

// causeValues returns c's counts in the order of causeColumns.
func causeValues(c causes.Counts) []int64 {
	v := []int64{c.Faults, c.Slept, c.Preempted, c.Syscalls()}
	for _, k := range causes.Kinds() {
		v = append(v, c.Of(k))
	}
	return v
}

// classes returns the causes of all steps, of those above the p50 step and of those
// above the p99 step (by wall time).
func (m *causeMeter) classes() []CauseClass {
	if m == nil || len(m.steps) == 0 {
		return nil
	}
	ds := make([]time.Duration, len(m.steps))
	for i, s := range m.steps {
		ds[i] = s.dt
	}
	p50, p99 := quantile(ds, 0.5), quantile(ds, 0.99)
	var out []CauseClass
	for _, cl := range []struct {
		name string
		keep func(time.Duration) bool
	}{
		{"all", func(time.Duration) bool { return true }},
		{"> p50", func(d time.Duration) bool { return d > p50 }},
		{"> p99", func(d time.Duration) bool { return d > p99 }},
	} {
		cc := CauseClass{Name: cl.name, Mean: make([]float64, len(causeColumns)), Any: make([]float64, len(causeColumns))}
		for _, s := range m.steps {
			if !cl.keep(s.dt) {
				continue
			}
			cc.Steps++
			for i, v := range causeValues(s.c) {
				cc.Mean[i] += float64(v)
				if v > 0 {
					cc.Any[i]++
				}
			}
		}
		for i := range cc.Mean {
			if cc.Steps > 0 {
				cc.Mean[i] /= float64(cc.Steps)
				cc.Any[i] = 100 * cc.Any[i] / float64(cc.Steps)
			}
		}
		out = append(out, cc)
	}
	return out
}

// printCauses writes, per strategy and class of steps, the mean count of each cause
// per step and the share of steps with any; a kind of call, lock or wake that no
// step paid is left out.
func printCauses(w io.Writer, names []string, cls [][]CauseClass) {
	shown := make([]bool, len(causeColumns))
	for i := range 4 {
		shown[i] = true // faults, slept, preempted, syscalls
	}
	for _, cs := range cls {
		for _, c := range cs {
			for i, a := range c.Any {
				shown[i] = shown[i] || a > 0
			}
		}
	}
	fmt.Fprintln(w, "\nCauses per decode step, on the replaying thread (-causes): mean count per step (share of steps with any)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head := []string{"strategy", "steps", "n"}
	for i, c := range causeColumns {
		if shown[i] {
			head = append(head, c)
		}
	}
	fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
	for j, cs := range cls {
		for _, c := range cs {
			row := []string{names[j], c.Name, fmt.Sprint(c.Steps)}
			for i := range causeColumns {
				if shown[i] {
					row = append(row, fmt.Sprintf("%.3g (%.1f%%)", c.Mean[i], c.Any[i]))
				}
			}
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
	}
	_ = tw.Flush()
}

// resultNames and resultCauses return the strategies' names and causes, in order.
func resultNames(rs []Result) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.Strategy
	}
	return out
}

func resultCauses(rs []Result) [][]CauseClass {
	out := make([][]CauseClass, len(rs))
	for i, r := range rs {
		out[i] = r.Causes
	}
	return out
}
