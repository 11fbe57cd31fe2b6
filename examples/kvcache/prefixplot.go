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

// prefixColors are colour-blind-safe (Okabe-Ito), one per prefix-cache strategy and
// per replica of the tiered one (-replicas 2 labels them /A and /B).
var prefixColors = map[string]color.RGBA{
	namePrefixOn:           {R: 0, G: 114, B: 178, A: 255},
	namePrefixOff:          {R: 230, G: 159, B: 0, A: 255},
	namePagedPC:            {R: 0, G: 158, B: 115, A: 255},
	namePrefixTiers:        {R: 204, G: 121, B: 167, A: 255},
	namePrefixTiers + "/A": {R: 204, G: 121, B: 167, A: 255},
	namePrefixTiers + "/B": {R: 86, G: 180, B: 233, A: 255},
	// the full-attention layers alone beside a recurrent hybrid (checkpoints.go):
	// black, the eighth Okabe-Ito colour, so that it differs from every twin below
	nameFullLayers: {R: 0, G: 0, B: 0, A: 255},
	// the twins with map-ahead off (noahead.go)
	namePrefixOn + noAheadSuffix:  {R: 213, G: 94, B: 0, A: 255},
	namePrefixOff + noAheadSuffix: {R: 240, G: 228, B: 66, A: 255},
}

// writePrefixPlots draws, over model time, each strategy's physical memory (and what
// its prefix cache holds, dashed) into dir/kvcache-prefix-memory.<format>, and its
// cumulative hit rate next to the unbounded ideal into dir/kvcache-prefix-hits.<format>.
// It returns the two paths.
func writePrefixPlots(dir, format string, rs []PrefixResult, budget int64) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	mem := plot.New()
	mem.Title.Text = "KV cache memory with prefix caching"
	mem.X.Label.Text = "model time (s)"
	mem.Y.Label.Text = "GiB"
	hits := plot.New()
	hits.Title.Text = "prefix-cache hit rate (prompt tokens, cumulative)"
	hits.X.Label.Text = "model time (s)"
	hits.Y.Label.Text = "%"
	for _, p := range []*plot.Plot{mem, hits} {
		p.Legend.Top = true
		p.Add(plotter.NewGrid())
	}
	var top int64 = budget
	for _, r := range rs {
		top = max(top, r.PeakPhysical)
		phys := make([]Sample, len(r.Samples))
		cached := make([]Sample, len(r.Samples))
		rate := make([]Sample, len(r.Samples))
		for i, s := range r.Samples {
			phys[i] = Sample{At: s.At, Physical: s.Physical}
			cached[i] = Sample{At: s.At, Physical: s.Cached}
			// downsample reads Physical in GiB: a GiB per percent.
			rate[i] = Sample{At: s.At, Physical: int64(s.HitRate * 100 * (1 << 30))}
		}
		c, ok := prefixColors[r.Strategy]
		if !ok {
			// NB: the zero colour is transparent: a line without one would not show.
			return nil, fmt.Errorf("%s: no colour to draw it in", r.Strategy)
		}
		for _, line := range []struct {
			p      *plot.Plot
			xy     plotter.XYs
			label  string
			dashed bool
		}{
			{mem, downsample(phys), fmt.Sprintf("%s held (peak %s)", r.Strategy, formatBytes(r.PeakPhysical)), false},
			{mem, downsample(cached), r.Strategy + " cached", true},
			{hits, downsample(rate), r.Strategy, false},
		} {
			if len(line.xy) == 0 || line.dashed && noPrefixCache(r.Strategy) {
				continue
			}
			l, err := plotter.NewLine(line.xy)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", r.Strategy, err)
			}
			l.Color, l.Width = c, vg.Points(1.5)
			if line.dashed {
				l.Width = vg.Points(1)
				l.Dashes = []vg.Length{vg.Points(3), vg.Points(2)}
			}
			line.p.Add(l)
			line.p.Legend.Add(line.label, l)
		}
	}
	if len(rs) > 0 && rs[0].Queries > 0 && len(rs[0].Samples) > 0 {
		ideal := 100 * float64(rs[0].IdealHits) / float64(rs[0].Queries)
		end := rs[0].Samples[len(rs[0].Samples)-1].At.Seconds()
		l, err := plotter.NewLine(plotter.XYs{{X: 0, Y: ideal}, {X: end, Y: ideal}})
		if err != nil {
			return nil, err
		}
		l.Color = color.Gray{Y: 100}
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		hits.Add(l)
		hits.Legend.Add(fmt.Sprintf("unbounded cache, whole replay (%.1f%%)", ideal), l)
	}
	mem.Y.Min, mem.Y.Max = 0, 1.3*float64(top)/(1<<30)
	hits.Y.Min = 0
	var paths []string
	for name, p := range map[string]*plot.Plot{"memory": mem, "hits": hits} {
		path := filepath.Join(dir, "kvcache-prefix-"+name+"."+format)
		if err := p.Save(10*vg.Inch, 5*vg.Inch, path); err != nil {
			return nil, err
		}
		paths = append(paths, path)
	}
	return paths, nil
}
