package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// printHeader says what is about to be replayed.
func printHeader(w io.Writer, c *config, s setup, wl Workload, traceName string) {
	last := wl.Requests[len(wl.Requests)-1].Arrival - wl.Requests[0].Arrival
	speed := fmt.Sprintf("%gx speed", wl.Speed)
	if wl.Speed == 0 {
		speed = "all at once"
	}
	budget := "unlimited"
	if s.budget > 0 {
		budget = formatBytes(s.budget)
	}
	if c.promptScale != 1 {
		speed += fmt.Sprintf(", prompts ×%g", c.promptScale)
	}
	fmt.Fprintf(w, "Trace:   %s: %d requests over %v of trace time (%s)\n", traceName, len(wl.Requests), last.Round(time.Second), speed)
	fmt.Fprintf(w, "Model:   %s, %s of K/V per token; system prompt %d tokens (%s), max %d tokens per sequence\n",
		s.model.Name, formatBytes(wl.bytesPerToken()), wl.SystemPrompt, formatBytes(int64(wl.SystemPrompt)*wl.bytesPerToken()), wl.MaxTokens)
	if s.groups != nil {
		fmt.Fprintf(w, "Groups:  %s; vmarena's cache on them (kv.Config.Model); K/V per token above is every layer's\n", groupKinds(*s.groups))
		for _, n := range s.notes {
			fmt.Fprintf(w, "         %s\n", n)
		}
	}
	fmt.Fprintf(w, "Server:  batch of at most %d, %v of model time per step, budget %s per strategy\n", wl.Concurrency, wl.Step, budget)
	granule := "default granule"
	if s.granule > 0 {
		granule = formatBytes(int64(s.granule)) + " granule"
	}
	layout := c.layout + " layout"
	if s.runTokens > 0 {
		layout += fmt.Sprintf(" in runs of %d tokens", s.runTokens)
	}
	fmt.Fprintf(w, "vmarena: %s backing, %s, %s\n\n", s.backing, layout, granule)
}

// printTable writes the comparison: a table of memory, then one of time.
func printTable(w io.Writer, rs []Result, s setup) {
	table(w, "Memory", []string{"strategy", "peak", "/need", "waste", "saved"}, rs, func(r Result) []string {
		ratio := "-"
		if r.PeakNeeded > 0 {
			ratio = fmt.Sprintf("%.2fx", float64(r.PeakPhysical)/float64(r.PeakNeeded))
		}
		return []string{r.Strategy, formatBytes(r.PeakPhysical), ratio, fmt.Sprintf("%.1f%%", r.Waste), formatBytes(r.MaxSaved)}
	})
	fmt.Fprintln(w)
	printGroups(w, rs, s)
	table(w, "Time", []string{"strategy", "step p50", "step p99", "memory", "waited", "refused", "wait p50", "wait p99", "makespan", "done"}, rs, func(r Result) []string {
		done := fmt.Sprintf("%d/%d", r.Completed, r.Requests)
		if r.Rejected > 0 {
			done += fmt.Sprintf(" (%d rejected)", r.Rejected)
		}
		return []string{
			r.Strategy,
			fmtDur(r.StepP50),
			fmtDur(r.StepP99),
			fmtDur(r.MemoryTime),
			fmt.Sprintf("%d", r.Waited),
			fmt.Sprintf("%d", r.MemoryRefused),
			fmtDur(r.WaitP50),
			fmtDur(r.WaitP99),
			fmtDur(r.Makespan),
			done,
		}
	})
	var notes []string
	for _, r := range rs {
		if r.Clipped > 0 {
			notes = append(notes, fmt.Sprintf("%d requests longer than %d tokens had their prompt clipped", r.Clipped, s.maxTokens))
			break
		}
	}
	for _, r := range rs {
		if r.Preempted > 0 {
			notes = append(notes, fmt.Sprintf("%s preempted %d running requests (no room for any to grow) and redid them", r.Strategy, r.Preempted))
		}
	}
	for _, r := range rs {
		if r.IdleFor > 0 {
			notes = append(notes, fmt.Sprintf("%s held %s when the load stopped and %s after %s without load (wall clock)",
				r.Strategy, formatBytes(r.IdleStart), formatBytes(r.IdleEnd), fmtDur(r.IdleFor)))
		}
	}
	for _, n := range notes {
		fmt.Fprintln(w, "Note: "+n)
	}
	for _, r := range rs {
		if v := r.Verified; v.Sequences > 0 {
			states := ""
			if v.States > 0 {
				states = fmt.Sprintf(" and %d recurrent states", v.States)
			}
			fmt.Fprintf(w, "Verified: %s read back %d sequences before each closed, %d tokens: %d token reads (K, V or latent, one layer each)%s, every byte as written\n",
				r.Strategy, v.Sequences, v.Tokens, v.Reads, states)
		}
	}
	if line := readingLine(rs); line != "" {
		fmt.Fprintln(w, "Reading: "+line)
	}
}

// readingLine says in one line what the tables mean and what to compare: vmarena's
// memory against the strategy a Go server would use instead, and what each gave back
// once the load stopped. It is empty when nothing can be compared.
func readingLine(rs []Result) string {
	var cache *Result
	for i := range rs {
		if rs[i].Strategy == nameCache {
			cache = &rs[i]
		}
	}
	if cache == nil || cache.PeakNeeded == 0 {
		return ""
	}
	line := fmt.Sprintf("peak /need is memory held over what the live tokens needed (1.00x is exact): vmarena %.2fx", float64(cache.PeakPhysical)/float64(cache.PeakNeeded))
	why := map[string]string{
		nameEager:                 "a whole window per request",
		namePaged:                 "blocks of a pool it never shrinks",
		nameAppend:                "slices that double and wait for the GC",
		nameCache + noAheadSuffix: "map-ahead off",
	}
	for _, r := range rs {
		if r.Strategy != nameCache && r.PeakNeeded > 0 {
			line += fmt.Sprintf(", %s %.2fx (%s)", r.Strategy, float64(r.PeakPhysical)/float64(r.PeakNeeded), why[r.Strategy])
		}
	}
	if cache.GroupPeak != nil {
		var peak, uniform int64
		for i := range cache.GroupPeak {
			peak, uniform = peak+cache.GroupPeak[i], uniform+cache.UniformPeak[i]
		}
		line += fmt.Sprintf("; on layer groups compare the committed peak with a uniform full-attention cache of the same sequences: %s (window groups give back what their window left; full, MLA and recurrent groups keep what they hold)", fmtRatio(peak, uniform))
	}
	if cache.IdleFor > 0 {
		line += fmt.Sprintf("; once the load stops, vmarena's pool gives idle granules back by decay (%s left after %s)", formatBytes(cache.IdleEnd), fmtDur(cache.IdleFor))
		for _, r := range rs {
			if r.Strategy == namePaged && r.IdleFor > 0 {
				line += fmt.Sprintf(", paged keeps its pool (%s)", formatBytes(r.IdleEnd))
			}
		}
	}
	return line
}

// printGroups writes, for a model of layer groups, each group's committed bytes in
// vmarena at their peak and on average while requests ran, against a uniform
// full-attention cache of the same model holding the same sequences.
func printGroups(w io.Writer, rs []Result, s setup) {
	if s.groups == nil {
		return
	}
	for _, r := range rs {
		if r.GroupPeak == nil {
			continue
		}
		fmt.Fprintf(w, "Layer groups (%s): committed bytes while requests ran (a mapped granule in every sequence that maps it), against a uniform full-attention cache (kv.Model.Uniform) of the same sequences\n", r.Strategy)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "group\tpeak\tmean\tuniform peak\tuniform mean\tpeak/uniform\t")
		var peak, upeak, mean, umean int64
		for i, g := range s.groups.Groups {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", groupName(g), formatBytes(r.GroupPeak[i]), formatBytes(r.GroupMean[i]),
				formatBytes(r.UniformPeak[i]), formatBytes(r.UniformMean[i]), fmtRatio(r.GroupPeak[i], r.UniformPeak[i]))
			peak, upeak, mean, umean = peak+r.GroupPeak[i], upeak+r.UniformPeak[i], mean+r.GroupMean[i], umean+r.UniformMean[i]
		}
		fmt.Fprintf(tw, "all groups (sums)\t%s\t%s\t%s\t%s\t%s\t\n", formatBytes(peak), formatBytes(mean), formatBytes(upeak), formatBytes(umean), fmtRatio(peak, upeak))
		_ = tw.Flush()
		fmt.Fprintln(w)
	}
}

// fmtRatio writes a/b as "0.25x", or "-" without a b.
func fmtRatio(a, b int64) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", float64(a)/float64(b))
}

// table writes one right-aligned table with a title.
func table(w io.Writer, title string, head []string, rs []Result, row func(Result) []string) {
	fmt.Fprintln(w, title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
	for _, r := range rs {
		fmt.Fprintln(tw, strings.Join(row(r), "\t")+"\t")
	}
	_ = tw.Flush()
}

// fmtDur writes d with three significant digits in a unit that suits it.
func fmtDur(d time.Duration) string {
	switch {
	case d == 0:
		return "0"
	case d < time.Microsecond:
		return fmt.Sprintf("%dns", d.Nanoseconds())
	case d < time.Millisecond:
		return fmt.Sprintf("%.3gµs", float64(d)/float64(time.Microsecond))
	case d < time.Second:
		return fmt.Sprintf("%.3gms", float64(d)/float64(time.Millisecond))
	case d < 100*time.Second:
		return fmt.Sprintf("%.3gs", d.Seconds())
	}
	return d.Round(time.Second).String()
}
