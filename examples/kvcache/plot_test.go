package main

import (
	"bytes"
	"image/png"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// plotRun is a run whose load stops at stop seconds and whose memory falls from held
// to left over idle seconds after it.
func plotRun(name string, stop, idle float64, held, left int64) Result {
	sec := func(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
	r := Result{Strategy: name, Makespan: sec(stop), PeakPhysical: held, IdleStart: held, IdleEnd: left}
	for t := 0.0; t < stop; t += 0.5 {
		r.Samples = append(r.Samples, Sample{At: sec(t), Physical: held, Needed: held / 2, Running: 1})
	}
	if idle > 0 {
		r.IdleFor = sec(idle)
		for t := 0.0; t <= idle; t += 0.25 {
			p := held
			if t >= idle/2 {
				p = left // given back halfway through the tail
			}
			r.Samples = append(r.Samples, Sample{At: sec(stop + t), Physical: p})
		}
	}
	return r
}

func TestSpanOf(t *testing.T) {
	// No run far longer than the others: one panel to the last end.
	sp := spanOf([]Result{plotRun(nameCache, 50, 6, 3<<30, 0), plotRun(namePaged, 65, 6, 3<<30, 3<<30)})
	assert.InDelta(t, 71*1.02, sp.main, 0.01)
	assert.Zero(t, sp.to, "no break")

	// Eager ends four times later: past the break, at the main panel's scale.
	rs := []Result{plotRun(nameCache, 53, 6, 3<<30, 0), plotRun(nameEager, 222, 6, 2<<30, 2<<30), plotRun(namePaged, 53, 6, 3<<30, 3<<30)}
	sp = spanOf(rs)
	assert.InDelta(t, 59*1.02, sp.main, 0.01, "the main panel ends with the others' idle tails")
	assert.InDelta(t, 228*1.005, sp.to, 0.01)
	assert.Less(t, sp.from, 222.0, "the long run's load stop is past the break")
	assert.InDelta(t, sp.main*breakShare/(1-breakShare), sp.to-sp.from, 0.5, "the same seconds per inch as the main panel")

	assert.Equal(t, "; after the load: 3 GiB to 0 B in 3.0 s", idleNote(rs[0]))
	assert.Equal(t, "; after the load: keeps 3 GiB", idleNote(rs[2]))
	assert.Equal(t, "; after the load: 0 B", idleNote(plotRun(nameAppend, 65, 6, 0, 0)))
	assert.Empty(t, idleNote(plotRun(nameCache, 10, 0, 1<<30, 0)), "no idle tail, no note")
}

// TestWritePlotBroken draws a plot with a broken time axis in both formats.
func TestWritePlotBroken(t *testing.T) {
	rs := []Result{plotRun(nameCache, 53, 6, 3<<30, 0), plotRun(nameEager, 222, 6, 2<<30, 2<<30)}
	s := testSetup(3 << 30)
	w := Workload{Requests: make([]Request, 2), SystemPrompt: 100, Idle: 6 * time.Second}
	for _, format := range []string{"png", "svg"} {
		path, err := writePlot(t.TempDir(), format, rs, s, w)
		require.NoError(t, err)
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		if format == "png" {
			img, err := png.Decode(bytes.NewReader(data))
			require.NoError(t, err)
			assert.Equal(t, 960, img.Bounds().Dx(), "10 inches at 96 dpi")
		} else {
			assert.Contains(t, string(data), "past the break")
		}
	}
}
