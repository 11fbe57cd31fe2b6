package main

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// procFigures is what one process did in one run.
type procFigures struct {
	Name             string
	Requests, Served int
	Rejected         int // refused for good
	// Waited counts the served requests memory held up: queued while memory refused
	// the head of the queue (itself or one before it), or refused a decode step.
	Waited           int
	Preempted        int // evictions mid-decode
	Refusals         int64
	TTFTp50, TTFTp99 time.Duration // arrival to the prompt written
	WaitP50, WaitP99 time.Duration // for Waited: arrival to the prompt's memory granted
	WaitSum          time.Duration // their sum
	PeakOwned        int64         // the owner's ledger, sampled
	BackToZero       time.Duration // from its last close to 0 in the owner's ledger; -1: not seen
	Beyond           int           // admissions that took it past half the budget
	// IdleBeyond are those of Beyond asked for while the other process held nothing
	// (the owner's ledger): memory a static split would have kept idle for the
	// other. Granted at the first try, IdleAskP50/P99/Max is the first try to the
	// grant; IdleRefused were first refused (the process's own sequences held the
	// rest of the budget) and are not in those figures.
	IdleBeyond, IdleRefused            int
	IdleAskP50, IdleAskP99, IdleAskMax time.Duration
	// Handoffs are its requests that memory refused and that were granted next
	// after the other process closed a sequence: the other's memory, served.
	Handoffs               int
	HandoffP50, HandoffMax time.Duration // from that close to the grant
}

// runFigures is one run.
type runFigures struct {
	Mode       string
	Procs      [2]procFigures
	Peak       int64
	NodeToZero time.Duration // from the last close of both to 0 used; -1: not seen
	// Totals over both processes.
	Rejected, Waited int
	WaitSum          time.Duration
	Refusals         int64
	BurstTTFTp99     time.Duration
}

// report is every run's figures.
type report struct {
	o    options
	Runs []runFigures
}

func makeReport(o options, rs []runResult) report {
	rep := report{o: o}
	for _, r := range rs {
		f := runFigures{Mode: r.Mode, Peak: r.Peak, NodeToZero: -1}
		var burst []time.Duration
		var last time.Duration
		for i, p := range r.Procs {
			other := r.Procs[1-i].Closes
			pf := procFigures{Name: p.Name, Requests: len(p.Jobs), Refusals: p.Refusals, BackToZero: -1}
			var ttft, wait, handoff, idleAsk []time.Duration
			for _, j := range p.Jobs {
				pf.Preempted += j.Preempts
				if j.Rejected {
					pf.Rejected++
					continue
				}
				pf.Served++
				ttft = append(ttft, j.Admitted-j.Arrival)
				if j.Burst {
					burst = append(burst, j.Admitted-j.Arrival)
				}
				if j.Blocked || j.Stalls > 0 || j.Preempts > 0 {
					pf.Waited++
					wait = append(wait, j.Granted-j.Arrival)
					pf.WaitSum += j.Granted - j.Arrival
				}
				if j.Owned > r.Limit/2 {
					pf.Beyond++
					if ownedAt(r.Samples, 1-i, j.Asked) == 0 {
						pf.IdleBeyond++
						if j.Refused >= 0 {
							pf.IdleRefused++
						} else {
							idleAsk = append(idleAsk, j.Granted-j.Asked)
						}
					}
				}
				if j.Refused >= 0 {
					// The last memory given back before the grant, by either process.
					own, oth := lastBefore(p.Closes, j.Granted), lastBefore(other, j.Granted)
					if oth >= j.Refused && oth > own {
						handoff = append(handoff, j.Granted-oth)
					}
				}
			}
			pf.TTFTp50, pf.TTFTp99 = quantile(ttft, 0.5), quantile(ttft, 0.99)
			pf.WaitP50, pf.WaitP99 = quantile(wait, 0.5), quantile(wait, 0.99)
			pf.IdleAskP50, pf.IdleAskP99, pf.IdleAskMax = quantile(idleAsk, 0.5), quantile(idleAsk, 0.99), quantile(idleAsk, 1)
			pf.Handoffs, pf.HandoffP50, pf.HandoffMax = len(handoff), quantile(handoff, 0.5), quantile(handoff, 1)
			for _, s := range r.Samples {
				pf.PeakOwned = max(pf.PeakOwned, s.Owned[i])
				if pf.BackToZero < 0 && s.At >= p.LastClose && s.Owned[i] == 0 {
					pf.BackToZero = s.At - p.LastClose
				}
			}
			last = max(last, p.LastClose)
			f.Procs[i] = pf
			f.Rejected += pf.Rejected
			f.Waited += pf.Waited
			f.WaitSum += pf.WaitSum
			f.Refusals += pf.Refusals
		}
		for _, s := range r.Samples {
			if s.At >= last && s.Used == 0 {
				f.NodeToZero = s.At - last
				break
			}
		}
		f.BurstTTFTp99 = quantile(burst, 0.99)
		rep.Runs = append(rep.Runs, f)
	}
	return rep
}

// ownedAt returns process i's bytes in the last sample at or before t (-1 before
// the first).
func ownedAt(ss []nodeSample, i int, t time.Duration) int64 {
	k, _ := slices.BinarySearchFunc(ss, t+1, func(s nodeSample, t time.Duration) int { return cmp.Compare(s.At, t) })
	if k == 0 {
		return -1
	}
	return ss[k-1].Owned[i]
}

// lastBefore returns the last of the sorted times ts at or before t, or -1.
func lastBefore(ts []time.Duration, t time.Duration) time.Duration {
	i, _ := slices.BinarySearch(ts, t+1)
	if i == 0 {
		return -1
	}
	return ts[i-1]
}

// print writes the tables and the targets.
func (rep report) print(w io.Writer) {
	o := rep.o
	fmt.Fprintf(w, "\nTwo processes, one node: %s, %s budget (%s granules), at most %d requests and a %v decode step each; trace %s.\n",
		o.model, formatBytes(o.budget), formatBytes(int64(o.granule)), o.concurrency, o.step, o.trace)
	fmt.Fprintf(w, "B: %d requests from the start, then idle; A: a burst of %d from %v", o.short, o.burst, o.burstAt)
	if o.swapAt > 0 {
		fmt.Fprintf(w, ", then idle; B: a burst of %d from %v", o.burst, o.swapAt)
	}
	fmt.Fprintf(w, " (arrivals at %gx the trace's speed).\n\n", o.speed)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run\tprocess\trequests\tserved\trefused for good\theld up by memory\tpreempted\tkv refusals\tTTFT p50\tTTFT p99\twait p50\twait p99\tpeak held\tto 0 after its load\t")
	for _, r := range rep.Runs {
		for _, p := range r.Procs {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t\n", r.Mode, p.Name, p.Requests, p.Served, p.Rejected, p.Waited,
				p.Preempted, p.Refusals, ms(p.TTFTp50), ms(p.TTFTp99), ms(p.WaitP50), ms(p.WaitP99), formatBytes(p.PeakOwned), msOrNot(p.BackToZero))
		}
	}
	tw.Flush()
	fmt.Fprintf(w, "\nTTFT: arrival to the prompt written. Held up: queued while memory refused the queue's head, or refused a decode step;\n"+
		"wait: arrival to the prompt's memory granted, for those. kv refusals: kv.Stats.Refusals. Peak held: the owner's ledger, read every %v.\n", o.sample)
	if len(rep.Runs) != 2 {
		return
	}
	sh, st := rep.Runs[0], rep.Runs[1]
	fmt.Fprintln(w, "\nTargets (issue 42):")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "  refused for good\t%d (%s) vs %d (%s)\t%s\n", sh.Rejected, sh.Mode, st.Rejected, st.Mode, verdict(sh.Rejected <= st.Rejected))
	fmt.Fprintf(tw, "  held up by memory\t%d vs %d\t%s\n", sh.Waited, st.Waited, verdict(sh.Waited <= st.Waited))
	fmt.Fprintf(tw, "  their waits, summed\t%.1f s vs %.1f s\t%s\n", sh.WaitSum.Seconds(), st.WaitSum.Seconds(), verdict(sh.WaitSum <= st.WaitSum))
	fmt.Fprintf(tw, "  kv refusals\t%d vs %d\t%s\n", sh.Refusals, st.Refusals, verdict(sh.Refusals <= st.Refusals))
	fmt.Fprintf(tw, "  bursts' TTFT p99\t%s vs %s\t%s\n", ms(sh.BurstTTFTp99), ms(st.BurstTTFTp99), verdict(sh.BurstTTFTp99 < st.BurstTTFTp99))
	for i, p := range sh.Procs {
		fmt.Fprintf(tw, "  %s past half the budget\t%d admissions (%s), %d while %s held nothing\t\n", p.Name, p.Beyond, sh.Mode, p.IdleBeyond, processNames[1-i])
		if n := p.IdleBeyond - p.IdleRefused; n > 0 {
			fmt.Fprintf(tw, "    of those, granted at the first try\t%d: asked to granted p50 %s, p99 %s, max %s (%d first refused: %s's own sequences held the rest)\t%s\n",
				n, ms(p.IdleAskP50), ms(p.IdleAskP99), ms(p.IdleAskMax), p.IdleRefused, p.Name, verdict(p.IdleAskP99 <= 100*time.Millisecond))
		}
		if p.Handoffs > 0 {
			fmt.Fprintf(tw, "  %s served from the other's memory\t%d waiting requests, the other's close to the grant p50 %s, max %s\t%s\n", p.Name, p.Handoffs, ms(p.HandoffP50), ms(p.HandoffMax), verdict(p.HandoffMax <= 100*time.Millisecond))
		}
	}
	fmt.Fprintf(tw, "  node at 0 after the last close\t%s (%s), %s (%s)\t%s\n", msOrNot(sh.NodeToZero), sh.Mode, msOrNot(st.NodeToZero), st.Mode,
		verdict(sh.NodeToZero >= 0 && sh.NodeToZero <= 8*time.Second))
	fmt.Fprintf(tw, "  the node's peak\t%s, %s of %s\t%s\n", formatBytes(sh.Peak), formatBytes(st.Peak), formatBytes(rep.o.budget), verdict(max(sh.Peak, st.Peak) <= rep.o.budget))
	tw.Flush()
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}

func ms(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 1, 64) + " ms" }

func msOrNot(d time.Duration) string {
	if d < 0 {
		return "not seen"
	}
	return ms(d)
}

// quantile returns the q-quantile of d (nearest rank), sorting d; 0 for none.
func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	i := int(q*float64(len(d))+0.5) - 1
	return d[min(max(i, 0), len(d)-1)]
}

// formatBytes writes n in the largest binary unit that keeps it at least 1, with up
// to two decimals.
func formatBytes(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v, u := float64(n), 0
	for math.Abs(v) >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	if u == 0 {
		return fmt.Sprintf("%d B", n)
	}
	s := strconv.FormatFloat(v, 'f', 2, 64)
	return strings.TrimRight(strings.TrimRight(s, "0"), ".") + " " + units[u]
}
