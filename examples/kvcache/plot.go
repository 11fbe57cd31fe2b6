package main

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
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
}

// writePlot draws physical memory over simulated time, one line per strategy, and
// the budget, into dir/kvcache-memory.<format>. It returns the file's path.
func writePlot(dir, format string, rs []Result, s setup, w Workload) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("KV cache memory: %s, %d requests, system prompt %d tokens", s.model.Name, len(w.Requests), w.SystemPrompt)
	p.X.Label.Text = "model time (s)"
	p.Y.Label.Text = "physical memory (GiB)"
	p.Legend.Top = true
	p.Legend.Left = false
	p.Add(plotter.NewGrid())
	var xmax float64
	for _, r := range rs {
		xy := downsample(r.Samples)
		if len(xy) == 0 {
			continue
		}
		xmax = max(xmax, xy[len(xy)-1].X)
		l, err := plotter.NewLine(xy)
		if err != nil {
			return "", fmt.Errorf("%s: %w", r.Strategy, err)
		}
		l.Color = strategyColors[r.Strategy]
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(fmt.Sprintf("%s (peak %s)", r.Strategy, formatBytes(r.PeakPhysical)), l)
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
			return "", err
		}
		l.Color = color.Black
		l.Width = vg.Points(0.75)
		l.Dashes = []vg.Length{vg.Points(1), vg.Points(2)}
		p.Add(l)
		p.Legend.Add(fmt.Sprintf("live tokens (%s run)", rs[0].Strategy), l)
	}
	if s.budget > 0 && xmax > 0 {
		gib := float64(s.budget) / (1 << 30)
		b, err := plotter.NewLine(plotter.XYs{{X: 0, Y: gib}, {X: xmax, Y: gib}})
		if err != nil {
			return "", err
		}
		b.Color = color.Gray{Y: 100}
		b.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(b)
		p.Legend.Add("budget "+formatBytes(s.budget), b)
	}
	// Leave room above the highest line for the legend.
	var top int64 = s.budget
	for _, r := range rs {
		top = max(top, r.PeakPhysical)
	}
	p.Y.Min, p.Y.Max = 0, 1.3*float64(top)/(1<<30)
	path := filepath.Join(dir, "kvcache-memory."+format)
	if err := p.Save(10*vg.Inch, 5.5*vg.Inch, path); err != nil {
		return "", err
	}
	return path, nil
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
