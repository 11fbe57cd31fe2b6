package main

import (
	"cmp"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// maxPlotPoints bounds the points drawn per line; each kept point is the highest of
// the samples it stands for, so that peaks stay visible.
const maxPlotPoints = 1500

// strategyColors are colour-blind-safe (Okabe-Ito), one per strategy in run order.
var strategyColors = map[string]color.RGBA{
	nameCache:  {R: 0, G: 114, B: 178, A: 255},
	nameEager:  {R: 213, G: 94, B: 0, A: 255},
	namePaged:  {R: 0, G: 158, B: 115, A: 255},
	nameAppend: {R: 204, G: 121, B: 167, A: 255},
	// vmarena's twin with map-ahead off (noahead.go)
	nameCache + noAheadSuffix: {R: 86, G: 180, B: 233, A: 255},
}

// The plot's size, and the share of its width the second panel of a broken axis
// takes.
const (
	plotWidth   = 10 * vg.Inch
	plotHeight  = 6 * vg.Inch
	breakShare  = 0.22
	breakFactor = 2 // a run that ends after this many times the earliest end goes past the break
)

// plotSpan is the time axis: [0, main] and, when some run ends far later than the
// others, a second panel [from, to] past a break.
type plotSpan struct {
	main     float64 // seconds
	from, to float64 // the panel past the break; to == 0: none
}

// spanOf places the axis break: runs that end after breakFactor times the earliest
// end are drawn past it, at about the main panel's scale, so that one long run (eager
// preallocation waits minutes for memory) does not squash the others.
func spanOf(rs []Result) plotSpan {
	var ends []float64
	for _, r := range rs {
		if len(r.Samples) > 0 {
			ends = append(ends, r.Samples[len(r.Samples)-1].At.Seconds())
		}
	}
	if len(ends) == 0 {
		return plotSpan{main: 1}
	}
	slices.Sort(ends)
	var sp plotSpan
	for _, e := range ends {
		if e > breakFactor*ends[0] && ends[0] > 0 {
			sp.to = ends[len(ends)-1]
			break
		}
		sp.main = e
	}
	sp.main *= 1.02
	if sp.to > 0 {
		// The same seconds per inch as the main panel, and at least a tenth of the
		// main panel's span before the first long run's load stopped.
		width := sp.main * breakShare / (1 - breakShare)
		firstStop := math.Inf(1)
		for _, r := range rs {
			if len(r.Samples) > 0 && r.Samples[len(r.Samples)-1].At.Seconds() > sp.main {
				firstStop = min(firstStop, r.Makespan.Seconds())
			}
		}
		sp.to *= 1.005
		sp.from = max(sp.main, min(sp.to-width, firstStop-sp.main/10))
	}
	return sp
}

// idleNote says what r held after the load stopped, for the legend: what it gave
// back and how soon, or what it kept.
func idleNote(r Result) string {
	if r.IdleFor <= 0 {
		return ""
	}
	switch {
	case r.IdleStart == 0:
		return "; after the load: 0 B"
	case r.IdleEnd >= r.IdleStart:
		return fmt.Sprintf("; after the load: keeps %s", formatBytes(r.IdleStart))
	}
	// The first sample of the tail at the level it ended at: the tail only falls.
	var at float64
	for _, s := range r.Samples {
		if s.At >= r.Makespan && s.Physical <= r.IdleEnd {
			at = (s.At - r.Makespan).Seconds()
			break
		}
	}
	return fmt.Sprintf("; after the load: %s to %s in %.1f s", formatBytes(r.IdleStart), formatBytes(r.IdleEnd), at)
}

// writePlot draws physical memory over time, one line per strategy, the first
// strategy's live tokens and the budget, into dir/kvcache-memory.<format>, and
// returns the file's path. The time axis is model time while the load runs and
// wall-clock time in the idle tail after it (the pool's decay runs on the real
// clock); a run that ends far later than the others is drawn past a break.
func writePlot(dir, format string, rs []Result, s setup, w Workload) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	sp := spanOf(rs)
	main, err := memoryPanel(rs, s, 0, sp.main, true)
	if err != nil {
		return "", err
	}
	main.Title.Text = fmt.Sprintf("KV cache memory: %s, %d requests, system prompt %d tokens", s.model.Name, len(w.Requests), w.SystemPrompt)
	main.X.Label.Text = "time (s): model time while the load runs, then wall-clock time without load"
	if w.Idle == 0 {
		main.X.Label.Text = "model time (s)"
	}
	path := filepath.Join(dir, "kvcache-memory."+format)
	if sp.to == 0 {
		return path, main.Save(plotWidth, plotHeight, path)
	}
	past, err := memoryPanel(rs, s, sp.from, sp.to, false)
	if err != nil {
		return "", err
	}
	past.Title.Text = "past the break"
	past.X.Label.Text = "time (s)"
	c, err := draw.NewFormattedCanvas(plotWidth, plotHeight, format)
	if err != nil {
		return "", err
	}
	dc := draw.New(c)
	right := plotWidth * breakShare
	main.Draw(draw.Crop(dc, 0, -right, 0, 0))
	past.Draw(draw.Crop(dc, plotWidth-right, 0, 0, 0))
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return "", err
	}
	return path, f.Close()
}

// memoryPanel is one panel of the plot, over [from, to] seconds; the main one has
// the legend and the memory axis's labels.
func memoryPanel(rs []Result, s setup, from, to float64, isMain bool) (*plot.Plot, error) {
	p := plot.New()
	p.Y.Label.Text = "physical memory (GiB)"
	p.Legend.Top = true
	p.Legend.Left = false
	p.Add(plotter.NewGrid())
	var top int64 = s.budget
	for _, r := range rs {
		top = max(top, r.PeakPhysical)
	}
	ymax := 1.55 * float64(top) / (1 << 30)
	if !isMain {
		p.Y.Label.Text = ""
		p.Y.Tick.Marker = unlabelled{}
	}
	// Each run's idle tail, shaded: from where its load stopped to its last sample,
	// on the wall clock. Runs whose loads stopped at the same model time share one.
	type tail struct{ from, to float64 }
	var tails []tail
	for _, r := range rs {
		if r.IdleFor > 0 && len(r.Samples) > 0 {
			tails = append(tails, tail{r.Makespan.Seconds(), r.Samples[len(r.Samples)-1].At.Seconds()})
		}
	}
	slices.SortFunc(tails, func(a, b tail) int { return cmp.Compare(a.from, b.from) })
	tails = slices.CompactFunc(tails, func(a, b tail) bool { return a.from == b.from })
	for i, t := range tails {
		if i > 0 && t.from < tails[i-1].to {
			t.from = tails[i-1].to // no shade drawn twice
		}
		y := 1.1 * float64(top) / (1 << 30)
		poly, err := plotter.NewPolygon(plotter.XYs{{X: t.from, Y: 0}, {X: t.to, Y: 0}, {X: t.to, Y: y}, {X: t.from, Y: y}})
		if err != nil {
			return nil, err
		}
		poly.Color = color.NRGBA{A: 28}
		poly.LineStyle.Width = 0
		p.Add(poly)
		if i == 0 && isMain {
			p.Legend.Add("idle tail: no load, wall-clock time (the pool's decay runs)", poly)
		}
	}
	for _, r := range rs {
		xy := downsample(r.Samples)
		if len(xy) == 0 {
			continue
		}
		l, err := plotter.NewLine(xy)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", r.Strategy, err)
		}
		c, ok := strategyColors[r.Strategy]
		if !ok {
			// NB: the zero colour is transparent: a line without one would not show.
			return nil, fmt.Errorf("%s: no colour to draw it in", r.Strategy)
		}
		l.Color = c
		l.Width = vg.Points(1.5)
		p.Add(l)
		if isMain {
			p.Legend.Add(fmt.Sprintf("%s (peak %s%s)", r.Strategy, formatBytes(r.PeakPhysical), idleNote(r)), l)
		}
	}
	if len(rs) > 0 && len(rs[0].Samples) > 0 {
		// What the first strategy's live tokens needed (the prefix once): the floor
		// under its line. Each strategy's schedule differs, so its need does too.
		need := make([]Sample, len(rs[0].Samples))
		for i, smp := range rs[0].Samples {
			need[i] = smp
			need[i].Physical = smp.Needed
		}
		l, err := plotter.NewLine(downsample(need))
		if err != nil {
			return nil, err
		}
		l.Color = color.Black
		l.Width = vg.Points(0.75)
		l.Dashes = []vg.Length{vg.Points(1), vg.Points(2)}
		p.Add(l)
		if isMain {
			p.Legend.Add(fmt.Sprintf("live tokens (%s run)", rs[0].Strategy), l)
		}
	}
	if s.budget > 0 {
		gib := float64(s.budget) / (1 << 30)
		b, err := plotter.NewLine(plotter.XYs{{X: from, Y: gib}, {X: to, Y: gib}})
		if err != nil {
			return nil, err
		}
		b.Color = color.Gray{Y: 100}
		b.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(b)
		if isMain {
			p.Legend.Add("budget "+formatBytes(s.budget), b)
		}
	}
	// NB: after every Add, which widens the axes to the data's range.
	p.X.Min, p.X.Max = from, to
	p.Y.Min, p.Y.Max = 0, ymax
	return p, nil
}

// unlabelled marks the default ticks without their labels: the panel past the break
// shares the main panel's memory axis.
type unlabelled struct{}

func (unlabelled) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ts {
		ts[i].Label = ""
	}
	return ts
}

// downsample turns samples into at most maxPlotPoints points of (seconds, GiB),
// keeping the highest reading of each bucket.
func downsample(ss []Sample) plotter.XYs {
	if len(ss) == 0 {
		return nil
	}
	per := (len(ss) + maxPlotPoints - 1) / maxPlotPoints
	out := make(plotter.XYs, 0, len(ss)/per+1)
	for i := 0; i < len(ss); i += per {
		hi := ss[i]
		for _, s := range ss[i:min(i+per, len(ss))] {
			if s.Physical > hi.Physical {
				hi.Physical = s.Physical
			}
		}
		out = append(out, plotter.XY{X: hi.At.Seconds(), Y: float64(hi.Physical) / (1 << 30)})
	}
	return out
}
