package main

import (
	"context"
	"encoding/json"
	"image"
	"image/color"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReplay runs a short replay end to end, two client processes under each mode,
// and checks what the report rests on: every request is served or refused for good
// and counted once, the node's memory never went above its budget in the owner's
// ledger (nor a process above its cap under the static split), one budget let a
// process take more than half of it, and the plot shows each process's line.
func TestReplay(t *testing.T) {
	out := t.TempDir()
	args := []string{"-trace", testTrace, "-out", out, "-model", "llama3.2-1b", "-budget-mib", "16", "-granule-kib", "64",
		"-max-tokens", "96", "-concurrency", "8", "-step", "5ms", "-speed", "50", "-short", "1", "-burst", "8",
		"-burst-at", "100ms", "-swap-at", "800ms", "-sample", "5ms", "-idle", "100ms", "-max-wait", "20s"}
	o, err := parseFlags(args, &strings.Builder{})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout strings.Builder
	require.NoError(t, run(ctx, args, &stdout, os.Stderr))
	t.Log(stdout.String())
	for _, want := range []string{"one budget", "static split", "refused for good", "bursts' TTFT p99", filepath.Join(out, plotName)} {
		assert.Contains(t, stdout.String(), want)
	}

	b, err := os.ReadFile(filepath.Join(out, dataName))
	require.NoError(t, err)
	var rs []runResult
	require.NoError(t, json.Unmarshal(b, &rs))
	require.Len(t, rs, 2)
	want := []int{}
	for i := range o.short + 2*o.burst {
		want = append(want, i)
	}
	for _, r := range rs {
		t.Run(r.Mode, func(t *testing.T) {
			var ids []int
			for i, p := range r.Procs {
				assert.Equal(t, processNames[i], p.Name)
				for _, j := range p.Jobs {
					ids = append(ids, j.ID)
					if j.Rejected {
						assert.Negative(t, j.Done, "request %d refused for good and done", j.ID)
						continue
					}
					assert.GreaterOrEqual(t, j.Granted, j.Asked, "request %d", j.ID)
					assert.GreaterOrEqual(t, j.Admitted, j.Granted, "request %d", j.ID)
					assert.GreaterOrEqual(t, j.Done, j.Admitted, "request %d", j.ID)
				}
				assert.True(t, slices.IsSorted(p.Closes), "%s's closes in order", p.Name)
			}
			slices.Sort(ids)
			assert.Equal(t, want, ids, "every request once")
			assert.LessOrEqual(t, r.Peak, r.Limit, "the owner's peak")
			require.NotEmpty(t, r.Samples)
			var peak [2]int64
			for _, s := range r.Samples {
				assert.LessOrEqual(t, s.Used, r.Limit, "at %v", s.At)
				// NB: not Owned[0]+Owned[1] <= Used: Owner.Stats reads the governor
				// and each client's ledger one after the other, not at one instant.
				for i := range peak {
					peak[i] = max(peak[i], s.Owned[i])
					if r.Cap > 0 {
						assert.LessOrEqual(t, s.Owned[i], r.Cap, "%s at %v", processNames[i], s.At)
					}
				}
			}
			assert.Zero(t, r.Samples[len(r.Samples)-1].Used, "the node's memory after both loads")
			if r.Mode == modeShared {
				assert.Greater(t, max(peak[0], peak[1]), r.Limit/2, "a burst past half the budget")
			}
		})
	}

	img := decodePNG(t, filepath.Join(out, plotName))
	for i, c := range processColors {
		assert.Greater(t, pixelsOf(img, c), 100, "process %s's line", processNames[i])
	}
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
	near := func(a, b uint8) bool { return a >= b-min(b, 8) && a <= b+min(255-b, 8) }
	n := 0
	if m, ok := img.(*image.RGBA); ok { // what the plot's PNG decodes to: read its bytes
		for i := 0; i+3 < len(m.Pix); i += 4 {
			// NB: premultiplied, so the colour of an opaque pixel as it is.
			if p := m.Pix[i : i+4]; p[3] > 240 && near(p[0], c.R) && near(p[1], c.G) && near(p[2], c.B) {
				n++
			}
		}
		return n
	}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			p := color.NRGBAModel.Convert(img.At(x, y)).(color.NRGBA)
			if p.A > 240 && near(p.R, c.R) && near(p.G, c.G) && near(p.B, c.B) {
				n++
			}
		}
	}
	return n
}
