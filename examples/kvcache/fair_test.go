package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/invariants"
)

// asProgramEnv makes this test binary, run again by fair timing (which runs its own
// executable), act as the program: "run" does what the program does; "exit:NAME"
// and "garbage:NAME" make the child replaying NAME fail (status 3, a line on
// stderr) or answer with something that is not a result.
const asProgramEnv = "KVCACHE_TEST_AS_PROGRAM"

func TestMain(m *testing.M) {
	if mode, ok := os.LookupEnv(asProgramEnv); ok {
		os.Exit(asProgram(mode, os.Args[1:]))
	}
	// The children of this process are the program.
	if err := os.Setenv(asProgramEnv, "run"); err != nil {
		panic(err)
	}
	invariants.Exit(m.Run())
}

func asProgram(mode string, args []string) int {
	// The strategy a child replays: the last -strategies wins.
	var strategy string
	for i, a := range args {
		if a == "-strategies" && i+1 < len(args) {
			strategy = args[i+1]
		}
	}
	if how, name, ok := strings.Cut(mode, ":"); ok && name == strategy {
		switch how {
		case "exit":
			fmt.Fprintf(os.Stderr, "kvcache: %s: the injected failure\n", name)
			return 3
		case "garbage":
			fmt.Println("not a result")
			return 0
		}
	}
	return run(context.Background(), args, os.Stdout, os.Stderr)
}

func TestFairOrder(t *testing.T) {
	names := []string{"a", "b", "c"}
	assert.Equal(t, []string{"a", "b", "c"}, fairOrder(names, 0))
	assert.Equal(t, []string{"c", "b", "a"}, fairOrder(names, 1))
	assert.Equal(t, []string{"a", "b", "c"}, fairOrder(names, 2))
	assert.Equal(t, []string{"c", "b", "a"}, fairOrder(names, 3))
	assert.Equal(t, []string{"a", "b", "c"}, names, "the caller's slice is left alone")
}

func TestFairReference(t *testing.T) {
	assert.Equal(t, nameCache, fairReference(allStrategies))
	assert.Equal(t, nameCache, fairReference([]string{namePaged, nameCache}))
	assert.Equal(t, namePrefixOn, fairReference(prefixStrategies), "the prefix replay's vmarena is the one with its cache")
	assert.Equal(t, namePrefixOn, fairReference([]string{namePagedPC, namePrefixOff, namePrefixOn}))
	assert.Equal(t, namePrefixOff, fairReference([]string{namePagedPC, namePrefixOff}))
	assert.Equal(t, namePaged, fairReference([]string{namePaged, nameEager}), "without vmarena: the first")
}

func TestSpreadOf(t *testing.T) {
	nan := math.NaN()
	tests := []struct {
		name          string
		vs            []float64
		med, min, max float64
		n             int
	}{
		{"one", []float64{7}, 7, 7, 7, 1},
		{"odd", []float64{3, 1, 2}, 2, 1, 3, 3},
		{"even: the mean of the middle two", []float64{4, 1, 3, 2}, 2.5, 1, 4, 4},
		{"NaN left out", []float64{nan, 2, nan, 4}, 3, 2, 4, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := spreadOf(tt.vs)
			assert.Equal(t, spread{Median: tt.med, Min: tt.min, Max: tt.max, N: tt.n}, s)
		})
	}
	s := spreadOf([]float64{nan})
	assert.Zero(t, s.N)
	assert.True(t, math.IsNaN(s.Median))
	assert.True(t, math.IsNaN(ratio(1, 0)))
	assert.True(t, math.IsNaN(ratio(nan, 2)))
	assert.Equal(t, 0.5, ratio(1, 2))
}

// TestPrintFair: each ratio is taken within a round, then its median and range;
// each strategy's figures get theirs.
func TestPrintFair(t *testing.T) {
	res := func(name string, memory time.Duration, peak int64) Result {
		return Result{Strategy: name, Requests: 5, Completed: 5, MemoryTime: memory, PeakPhysical: peak, PeakNeeded: 100,
			StepP50: time.Microsecond, StepP99: 10 * time.Microsecond, Makespan: time.Minute}
	}
	s := time.Second
	runs := []fairRun[Result]{ // in the order they ran: alternating
		{1, nameCache, res(nameCache, 2*s, 100), s, 3 * s}, {1, namePaged, res(namePaged, 1*s, 200), s, 2 * s},
		{2, namePaged, res(namePaged, 8*s, 200), s, 4 * s}, {2, nameCache, res(nameCache, 4*s, 100), s, 2 * s},
		{3, nameCache, res(nameCache, 6*s, 100), s, 5 * s}, {3, namePaged, res(namePaged, 3*s, 100), s, 5 * s},
	}
	var out bytes.Buffer
	printFair(&out, mainFairReplay, []string{nameCache, namePaged}, 3, runs)
	got := out.String()
	// vmarena 2, 4, 6 s against paged 1, 8, 3 s: ratios 2, 0.5, 2. (The ratio of the
	// medians, 4/3, would be wrong.)
	assert.Regexp(t, `(?m)^ *memory +4s \[2s, 6s\] +3s \[1s, 8s\]`, got)
	assert.Regexp(t, `(?m)^ *memory +2\.00x \[0\.50x, 2\.00x\] *$`, got)
	// peak/need: 1.00x every round against 2.00x, 2.00x and 1.00x.
	assert.Regexp(t, `(?m)^ *peak/need +0\.50x \[0\.50x, 1\.00x\] *$`, got)
	assert.Regexp(t, `(?m)^ *makespan +1\.00x \[1\.00x, 1\.00x\] *$`, got)
	assert.Contains(t, got, "vmarena over each strategy: median [min, max] of the 3 rounds' ratios")
	assert.Regexp(t, `(?m)^ +2 +paged +8s .* 4s +5/5 +1s *$`, got, "every run has its row, its CPU time too")
	// cpu: vmarena 3, 2, 5 s against paged 2, 4, 5 s: ratios 1.5, 0.5, 1.
	assert.Regexp(t, `(?m)^ *cpu +3s \[2s, 5s\] +4s \[2s, 5s\]`, got)
	assert.Regexp(t, `(?m)^ *cpu +1\.00x \[0\.50x, 1\.50x\] *$`, got)
}

// TestFairRounds runs fair timing for real: each strategy in a child process of this
// test binary, in alternating order.
func TestFairRounds(t *testing.T) {
	code, out, errOut := runArgs(t, small(t, "-rounds", "2", "-strategies", "vmarena,paged", "-progress", "lines")...)
	require.Equal(t, 0, code, errOut)
	assert.Empty(t, errOut)
	rows := regexp.MustCompile(`(?m)^ +(\d) +(vmarena|paged) .* 12/12 +\S+ *$`).FindAllStringSubmatch(out, -1)
	var order []string
	for _, r := range rows {
		order = append(order, r[1]+" "+r[2])
	}
	assert.Equal(t, []string{"1 vmarena", "1 paged", "2 paged", "2 vmarena"}, order, out)
	assert.Contains(t, out, "round 2/2  paged    12/12 in ", "names padded to the longest")
	assert.Contains(t, out, "Each strategy: median [min, max] over 2 rounds")
	assert.Regexp(t, `(?m)^ *makespan +1\.00x \[1\.00x, 1\.00x\] *$`, out, "the same schedule in every process")
	assert.NotContains(t, out, "Plot of", "fair timing draws no plot")
	assert.Regexp(t, `(?m)^ *cpu +[0-9]`, out, "each child's CPU time")
	assert.NotRegexp(t, `(?m)^ *cpu +(0s|-) `, out, "measured in every round")
}

// TestFairChild: a child replays one strategy and writes only its result, as JSON.
func TestFairChild(t *testing.T) {
	code, out, errOut := runArgs(t, small(t, "-strategies", "paged", "-progress", "lines", "-"+childFlag)...)
	require.Equal(t, 0, code, errOut)
	assert.Empty(t, errOut)
	var r Result
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&r), out)
	assert.False(t, dec.More(), "one JSON value and nothing else")
	assert.Equal(t, namePaged, r.Strategy)
	assert.Equal(t, 12, r.Completed)
	assert.Positive(t, r.MemoryTime)
	assert.Nil(t, r.Samples, "no samples: the parent draws no plot")

	code, out, errOut = runArgs(t, "-trace", "mooncake", "-requests", "2", "-budget", "512MiB",
		"-strategies", namePagedPC, "-"+childFlag, "-out", t.TempDir())
	require.Equal(t, 0, code, errOut)
	var p PrefixResult
	require.NoError(t, json.Unmarshal([]byte(out), &p), out)
	assert.Equal(t, 2, p.Completed)

	code, out, errOut = runArgs(t, small(t, "-strategies", "vmarena,paged", "-"+childFlag)...)
	assert.Equal(t, 2, code)
	assert.Contains(t, errOut, "-child replays one strategy, not 2")
	assert.Empty(t, out)

	_, _, help := runArgs(t, "-help")
	assert.Contains(t, help, "-rounds")
	assert.NotContains(t, help, "-"+childFlag, "the child's flag is hidden")
}

// TestFairChildFails: a child that fails, or answers with something that is not a
// result, stops fair timing with an error that names the round and the strategy.
func TestFairChildFails(t *testing.T) {
	tests := []struct {
		mode string
		msg  string
	}{
		{"exit:paged", "kvcache: fair timing: round 1 of 2, paged: child process: exit status 3: kvcache: paged: the injected failure"},
		{"garbage:vmarena", "kvcache: fair timing: round 1 of 2, vmarena: child process: its result: invalid character"},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			t.Setenv(asProgramEnv, tt.mode)
			code, out, errOut := runArgs(t, small(t, "-rounds", "2", "-strategies", "vmarena,paged")...)
			assert.Equal(t, 1, code)
			assert.Contains(t, errOut, tt.msg)
			assert.NotContains(t, out, "Each strategy", "no figures from a failed round")
		})
	}
}
