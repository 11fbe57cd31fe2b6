package main

import (
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/causes"
)

// TestCauseClasses: the classes hold all steps, those slower than the p50 step and
// those slower than the p99 step, with each cause's mean count and share of steps.
func TestCauseClasses(t *testing.T) {
	m := &causeMeter{}
	for i := 1; i <= 100; i++ {
		var c causes.Counts
		if i == 100 {
			c.Faults = 10 // the slowest step alone
		}
		if i%2 == 0 {
			c.Kinds[causes.SysMap] = 1
		}
		m.steps = append(m.steps, stepCauses{dt: time.Duration(i) * time.Microsecond, c: c})
	}
	cls := m.classes()
	require.Len(t, cls, 3)
	col := func(name string) int {
		for i, c := range causeColumns {
			if c == name {
				return i
			}
		}
		t.Fatalf("no column %q", name)
		return -1
	}
	faults, mmaps := col("faults"), col(causes.SysMap.String())
	assert.Equal(t, []int{100, 50, 1}, []int{cls[0].Steps, cls[1].Steps, cls[2].Steps})
	assert.InDelta(t, 0.1, cls[0].Mean[faults], 1e-9)
	assert.InDelta(t, 1.0, cls[0].Any[faults], 1e-9, "1% of all steps")
	assert.InDelta(t, 10.0, cls[2].Mean[faults], 1e-9)
	assert.InDelta(t, 100.0, cls[2].Any[faults], 1e-9)
	assert.InDelta(t, 50.0, cls[0].Any[mmaps], 1e-9)
	assert.InDelta(t, 0.5, cls[1].Mean[mmaps], 1e-9, "the steps above p50 are 51..100, the even ones half of them")
	assert.Nil(t, (*causeMeter)(nil).classes())
}

// TestRunCauses: -causes prints, for each strategy, the causes of all its steps and
// of those above its p50 and p99 step, on the main replay and the prefix-cache one.
func TestRunCauses(t *testing.T) {
	for _, tt := range []struct {
		name  string
		args  []string
		names []string
	}{
		{"main", small(t, "-strategies", "vmarena,paged", "-progress", "none", "-causes"), []string{"vmarena", "paged"}},
		{"mooncake", []string{"-trace", "mooncake", "-requests", "3", "-budget", "512MiB", "-progress", "none", "-out", t.TempDir(), "-causes"}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runArgs(t, tt.args...)
			require.Equal(t, 0, code, errOut)
			require.Contains(t, out, "Causes per decode step")
			assert.Regexp(t, regexp.MustCompile(`(?m)^strategy +steps +n +faults +`), out)
			for _, name := range tt.names {
				for _, class := range []string{"all", "> p50", "> p99"} {
					assert.Regexp(t, regexp.MustCompile(`(?m)^`+name+` +`+regexp.QuoteMeta(class)+` +\d+ `), out, name+" "+class)
				}
			}
		})
	}
	checkUsage(t, []usageCase{{"with rounds", []string{"-causes", "-rounds", "2"}, "-causes counts one process"}})
}
