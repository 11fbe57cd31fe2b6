package main

import (
	"image"
	"image/color"
	"image/png"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStrategyColors gives every strategy a run can have an opaque colour of its own:
// a line in the zero colour is transparent, and two lines in one colour can not be
// told apart.
func TestStrategyColors(t *testing.T) {
	for _, tt := range []struct {
		name   string
		colors map[string]color.RGBA
		names  []string
	}{
		{"main replay", strategyColors, slices.Concat(allStrategies, aheadTwins(allStrategies))},
		{"prefix-cache replay", prefixColors, slices.Concat(prefixStrategies, []string{namePrefixTiers, nameFullLayers}, aheadTwins(prefixStrategies))},
		{"two replicas", prefixColors, []string{namePrefixOn, namePrefixTiers + "/A", namePrefixTiers + "/B"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			seen := map[color.RGBA]string{}
			for _, n := range tt.names {
				c, ok := tt.colors[n]
				require.True(t, ok, "%s has no colour", n)
				assert.Equal(t, uint8(255), c.A, "%s is not opaque", n)
				if other, dup := seen[c]; dup {
					t.Errorf("%s and %s share the colour %v", n, other, c)
				}
				seen[c] = n
			}
		})
	}
}

// TestPlotsShowEveryStrategy renders each plot as a PNG and finds every strategy's
// colour (every layer group's, in the group plot) in it: each line the legend names
// is drawn where it can be seen.
func TestPlotsShowEveryStrategy(t *testing.T) {
	sec := func(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
	t.Run("memory", func(t *testing.T) {
		var rs []Result
		for i, n := range allStrategies {
			rs = append(rs, plotRun(n, 50+float64(i), 6, int64(i+1)<<30, 0))
		}
		path, err := writePlot(t.TempDir(), "png", rs, testSetup(5<<30), Workload{Requests: make([]Request, 2), SystemPrompt: 100, Idle: 6 * time.Second})
		require.NoError(t, err)
		img := decodePNG(t, path)
		for _, r := range rs {
			assert.Greater(t, pixelsOf(img, strategyColors[r.Strategy]), 100, "%s's line", r.Strategy)
		}
	})
	t.Run("prefix", func(t *testing.T) {
		names := append(append([]string(nil), prefixStrategies...), namePrefixTiers+"/A", namePrefixTiers+"/B")
		var rs []PrefixResult
		for i, n := range names {
			r := PrefixResult{Strategy: n, Queries: 1000, Hits: 40, IdealHits: 50, PeakPhysical: int64(i+1) << 28}
			for j := range 40 {
				r.Samples = append(r.Samples, PrefixSample{At: sec(float64(j)), Physical: int64(i+1) << 28, Cached: int64(i+1) << 27, HitRate: float64(i+1) / 100})
			}
			rs = append(rs, r)
		}
		paths, err := writePrefixPlots(t.TempDir(), "png", rs, 2<<30)
		require.NoError(t, err)
		require.Len(t, paths, 2)
		for _, path := range paths {
			img := decodePNG(t, path)
			for _, r := range rs {
				assert.Greater(t, pixelsOf(img, prefixColors[r.Strategy]), 100, "%s's line in %s", r.Strategy, path)
			}
		}
		_, err = writePrefixPlots(t.TempDir(), "png", []PrefixResult{{Strategy: "unknown", Samples: rs[0].Samples}}, 2<<30)
		assert.ErrorContains(t, err, "unknown: no colour to draw it in")
	})
	t.Run("groups", func(t *testing.T) {
		g, groups, err := lookupModel("gpt-oss-20b")
		require.NoError(t, err)
		s := testSetup(0)
		s.model, s.groups = g, groups
		r := Result{Strategy: nameCache, GroupPeak: []int64{3 << 20, 9 << 20}, UniformPeak: []int64{9 << 20, 9 << 20}}
		for i := range 10 {
			b := int64(i) << 20
			r.Samples = append(r.Samples, Sample{At: sec(float64(i)), Groups: []int64{min(b, 3<<20), b}, Uniform: []int64{b + 1<<20, b + 1<<20}})
		}
		path, err := writeGroupPlot(t.TempDir(), "png", r, s, Workload{Requests: make([]Request, 2)})
		require.NoError(t, err)
		img := decodePNG(t, path)
		for i := range groups.Groups {
			assert.Greater(t, pixelsOf(img, groupColors[i]), 100, "group %d's line", i)
		}
	})
}

func decodePNG(t *testing.T, path string) image.Image {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	img, err := png.Decode(f)
	require.NoError(t, err, path)
	return img
}

// pixelsOf counts the pixels of img within a small distance of c: a line's core,
// which anti-aliasing leaves in its own colour.
func pixelsOf(img image.Image, c color.RGBA) int {
	near := func(a uint32, b uint8) bool {
		d := int(a>>8) - int(b)
		return d >= -8 && d <= 8
	}
	n := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, a := img.At(x, y).RGBA()
			if a>>8 > 240 && near(r, c.R) && near(g, c.G) && near(bl, c.B) {
				n++
			}
		}
	}
	return n
}
