package main

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMain is also a client process of the replay: replayNode starts this test
// binary again with clientEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(clientEnv) == "1" {
		if err := runClient(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "node client:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

const testTrace = "../kvcache/testdata/azure-llm-2023-conv.csv"

func TestParseFlags(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"budget", []string{"-budget-mib", "0"}, "-budget-mib"},
		{"step", []string{"-step", "0s"}, "-step"},
		{"burst", []string{"-burst", "0"}, "-burst must be positive"},
		{"max tokens", []string{"-max-tokens", "1"}, "-max-tokens"},
		{"unknown model", []string{"-model", "no-such-model"}, "-model"},
		{"model of groups", []string{"-model", "gpt-oss-20b"}, "one full-attention group"},
		{"arguments", []string{"extra"}, "unexpected arguments"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseFlags(tt.args, &strings.Builder{})
			assert.ErrorContains(t, err, tt.want)
		})
	}
	o, err := parseFlags(nil, &strings.Builder{})
	require.NoError(t, err)
	assert.Equal(t, int64(4<<30), o.budget)
	assert.Equal(t, 2<<20, o.granule)
}

func TestReadTrace(t *testing.T) {
	for _, tt := range []struct {
		name, csv, want string
	}{
		{"no column", "TIMESTAMP,ContextTokens\n", "no generatedtokens column"},
		{"bad count", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,x,3\n", "line 2: contexttokens"},
		{"bad time", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,3\n", "line 2"},
		{"empty", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readTrace(strings.NewReader(tt.csv), 10)
			require.ErrorIs(t, err, errTrace)
			assert.ErrorContains(t, err, tt.want)
		})
	}
	f, err := os.Open(testTrace)
	require.NoError(t, err)
	defer f.Close()
	reqs, err := readTrace(f, 5)
	require.NoError(t, err)
	require.Len(t, reqs, 5)
	assert.Equal(t, traceRequest{Arrival: 0, Context: 374, Generated: 44}, reqs[0])
	assert.Equal(t, 396, reqs[1].Context)
	assert.Greater(t, reqs[1].Arrival, 4*time.Second)
}

// TestSchedule gives B the short load and the second burst and A the first, each
// burst from its start at the trace's pace divided by -speed, every request clipped
// to -max-tokens, and every trace line to one job.
func TestSchedule(t *testing.T) {
	reqs := []traceRequest{
		{0, 10, 5}, {time.Second, 20, 5}, // B's short load
		{2 * time.Second, 900, 300}, {4 * time.Second, 0, 0}, // A's burst
		{5 * time.Second, 30, 2}, {7 * time.Second, 40, 2}, // B's burst
	}
	o := options{short: 2, burst: 2, burstAt: time.Second, swapAt: 10 * time.Second, speed: 2, maxTokens: 1000}
	jobs, err := schedule(o, reqs)
	require.NoError(t, err)
	assert.Equal(t, []job{
		{ID: 2, Arrival: time.Second, Context: 700, Generated: 300, Burst: true},
		{ID: 3, Arrival: 2 * time.Second, Context: 1, Generated: 1, Burst: true},
	}, jobs[0])
	assert.Equal(t, []job{
		{ID: 0, Arrival: 0, Context: 10, Generated: 5},
		{ID: 1, Arrival: time.Second / 2, Context: 20, Generated: 5},
		{ID: 4, Arrival: 10 * time.Second, Context: 30, Generated: 2, Burst: true},
		{ID: 5, Arrival: 11 * time.Second, Context: 40, Generated: 2, Burst: true},
	}, jobs[1])
	o.swapAt = 0
	jobs, err = schedule(o, reqs)
	require.NoError(t, err)
	assert.Len(t, jobs[1], 2, "no second burst")
	o.burst = 3
	o.swapAt = time.Second
	_, err = schedule(o, reqs)
	assert.ErrorContains(t, err, "the replay needs 8")
}
