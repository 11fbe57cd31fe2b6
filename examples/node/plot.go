package main

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// processColors are the two processes' lines (Okabe-Ito, colour-blind-safe).
var processColors = [2]color.RGBA{
	{R: 0, G: 114, B: 178, A: 255}, // A
	{R: 213, G: 94, B: 0, A: 255},  // B
}

const (
	plotWidth       = 10 * vg.Inch
	plotPanelHeight = 4 * vg.Inch
	plotName        = "node-memory.png"
)

// writePlot draws each process's memory over time as the owner's ledger counts it,
// and the node's, one panel per run, into dir/node-memory.png, and returns the
// file's path.
func writePlot(dir string, o options, rs []runResult) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	var end float64
	for _, r := range rs {
		if n := len(r.Samples); n > 0 {
			end = max(end, r.Samples[n-1].At.Seconds())
		}
	}
	panels := make([][]*plot.Plot, len(rs))
	for i, r := range rs {
		p, err := memoryPanel(o, r, end)
		if err != nil {
			return "", err
		}
		panels[i] = []*plot.Plot{p}
	}
	img := vgimg.New(plotWidth, plotPanelHeight*vg.Length(len(rs)))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: len(rs), Cols: 1, PadTop: vg.Points(4), PadBottom: vg.Points(4), PadX: vg.Points(4), PadY: vg.Points(8)}
	canvases := plot.Align(panels, tiles, dc)
	for i := range panels {
		panels[i][0].Draw(canvases[i][0])
	}
	path := filepath.Join(dir, plotName)
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return "", err
	}
	return path, f.Close()
}

// memoryPanel is one run: each process's bytes, the node's, its budget and, under a
// static split, each process's cap.
func memoryPanel(o options, r runResult, end float64) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("%s: %s budget, two processes (%s)", r.Mode, formatBytes(r.Limit), o.model)
	p.X.Label.Text = "time since the replay's start (s, wall clock)"
	p.Y.Label.Text = "memory held, owner's ledger (GiB)"
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	gib := func(b int64) float64 { return float64(b) / (1 << 30) }
	line := func(xy plotter.XYs, c color.Color, width vg.Length, dashes []vg.Length, label string) error {
		l, err := plotter.NewLine(xy)
		if err != nil {
			return fmt.Errorf("%s: %w", label, err)
		}
		l.Color, l.Width, l.Dashes = c, width, dashes
		p.Add(l)
		p.Legend.Add(label, l)
		return nil
	}
	node := make(plotter.XYs, len(r.Samples))
	for i, s := range r.Samples {
		node[i] = plotter.XY{X: s.At.Seconds(), Y: gib(s.Used)}
	}
	if len(node) == 0 {
		return nil, fmt.Errorf("%s: no sample of the ledger", r.Mode)
	}
	if err := line(node, color.Black, vg.Points(0.75), []vg.Length{vg.Points(1), vg.Points(2)}, "node (both)"); err != nil {
		return nil, err
	}
	for k := range 2 {
		xy := make(plotter.XYs, len(r.Samples))
		for i, s := range r.Samples {
			xy[i] = plotter.XY{X: s.At.Seconds(), Y: gib(s.Owned[k])}
		}
		if err := line(xy, processColors[k], vg.Points(1.5), nil, "process "+processNames[k]); err != nil {
			return nil, err
		}
	}
	flat := func(y int64, label string, dashes []vg.Length) error {
		return line(plotter.XYs{{X: 0, Y: gib(y)}, {X: end, Y: gib(y)}}, color.Gray{Y: 100}, vg.Points(1), dashes, label)
	}
	if err := flat(r.Limit, "budget "+formatBytes(r.Limit), []vg.Length{vg.Points(4), vg.Points(3)}); err != nil {
		return nil, err
	}
	if r.Cap > 0 {
		if err := flat(r.Cap, "each process's cap "+formatBytes(r.Cap), []vg.Length{vg.Points(1), vg.Points(3)}); err != nil {
			return nil, err
		}
	}
	p.X.Min, p.X.Max = 0, end
	p.Y.Min, p.Y.Max = 0, 1.45*gib(r.Limit) // room for the legend above the budget
	return p, nil
}
