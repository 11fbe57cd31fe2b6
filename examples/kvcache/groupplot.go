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

// groupColors are the layer groups' lines (Okabe-Ito, after the strategies' own).
var groupColors = []color.RGBA{
	{R: 0, G: 114, B: 178, A: 255},
	{R: 230, G: 159, B: 0, A: 255},
	{R: 0, G: 158, B: 115, A: 255},
	{R: 204, G: 121, B: 167, A: 255},
}

// writeGroupPlot draws, for vmarena's run r on a model of layer groups, each group's
// committed bytes over time (solid) and what a uniform full-attention cache of the
// same sequences would commit for it (dashed), into dir/kvcache-groups.<format>,
// and returns the file's path: the window groups' lines stay flat while the full
// groups' grow with the tokens.
func writeGroupPlot(dir, format string, r Result, s setup, w Workload) (string, error) {
	if s.groups == nil || r.GroupPeak == nil {
		return "", fmt.Errorf("%s: no layer groups to plot", r.Strategy)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("KV cache memory per layer group: %s, %s, %d requests", s.groups.Name, r.Strategy, len(w.Requests))
	p.X.Label.Text = "model time (s)"
	p.Y.Label.Text = "committed (MiB)"
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())
	// The uniform lines last, dashed over vmarena's: a window group's uniform line
	// is often a full group's vmarena line (the same layers and shape).
	for _, uniform := range []bool{false, true} {
		for i, g := range s.groups.Groups {
			var xy plotter.XYs
			for _, smp := range r.Samples {
				if smp.Groups == nil {
					continue // the idle tail: nothing live
				}
				b := smp.Groups[i]
				if uniform {
					b = smp.Uniform[i]
				}
				xy = append(xy, plotter.XY{X: smp.At.Seconds(), Y: float64(b) / (1 << 20)})
			}
			if len(xy) == 0 {
				continue
			}
			l, err := plotter.NewLine(xy)
			if err != nil {
				return "", fmt.Errorf("group %d: %w", i, err)
			}
			l.Color = groupColors[i%len(groupColors)]
			l.Width = vg.Points(1.5)
			label := fmt.Sprintf("%s: %s (peak %s)", groupName(g), r.Strategy, formatBytes(r.GroupPeak[i]))
			if uniform {
				// Each group's dashes in slots of their own: uniform lines often lie on
				// one another (the same layers and shape), and each stays visible.
				n := len(s.groups.Groups)
				l.Width = vg.Points(1)
				l.Dashes = []vg.Length{vg.Points(3), vg.Points(float64(3 * max(1, n-1)))}
				l.DashOffs = vg.Points(float64(3 * i))
				label = fmt.Sprintf("%s: uniform full-attention cache (peak %s)", groupName(g), formatBytes(r.UniformPeak[i]))
			}
			p.Add(l)
			p.Legend.Add(label, l)
		}
	}
	p.Y.Min = 0
	p.Y.Max *= 1.3 // room for the legend
	path := filepath.Join(dir, "kvcache-groups."+format)
	return path, p.Save(plotWidth, plotHeight, path)
}
