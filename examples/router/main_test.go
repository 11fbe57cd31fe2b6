package main

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-replicas", "0"}, {"-replicas", "65"}, {"-budget-mib", "0"}, {"-concurrency", "0"}, {"-queue-threshold", "0"},
		{"-prefill-rate", "-1"}, {"-max-tokens", "1"}, {"-block", "0"}, {"-transport", "udp"},
		{"-prefix-weight", "-1"}, {"-load-weight", "-1"}, {"-active-weight", "-0.5"}, {"-nonsense"},
	} {
		assert.Error(t, run(args, io.Discard, io.Discard), "%v", args)
	}
	assert.Error(t, run([]string{"-trace", "/nonexistent"}, io.Discard, io.Discard))
}

func TestBadTrace(t *testing.T) {
	for _, in := range []string{
		"", "not json\n", `{"timestamp": 0}` + "\n",
		`{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}` + "\n",
		`{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]}` + "\n" + `{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [1]}` + "\n",
	} {
		_, err := readTrace(strings.NewReader(in), 0)
		assert.True(t, errors.Is(err, errTrace), "%q: %v", in, err)
	}
	reqs, err := readTrace(strings.NewReader(`{"timestamp": 7, "input_length": 3, "output_length": 2, "hash_ids": [9]}`+"\n"+
		`{"timestamp": 9, "input_length": 3, "output_length": 2, "hash_ids": [9]}`+"\n"), 0)
	require.NoError(t, err)
	require.Len(t, reqs, 2)
	assert.Equal(t, reqs[0].tokens(3), reqs[1].tokens(3), "equal hash ids, equal tokens")
	assert.Equal(t, int64(2e6), reqs[1].arrival.Nanoseconds(), "arrivals from the first request")
}

// TestScorer: a replica holding the longest prefix wins until its queue outweighs it;
// ties go round-robin.
func TestScorer(t *testing.T) {
	s := Scorer{PrefixWeight: 1, LoadWeight: 2, QueueThreshold: 8}
	assert.Equal(t, 2, s.Pick([]int{3, 0, 9, 3}, waiting(0, 0, 0, 0)))
	assert.Equal(t, 2, s.Pick([]int{3, 0, 9, 3}, waiting(0, 0, 3, 0)), "a short queue does not outweigh the prefix")
	assert.NotEqual(t, 2, s.Pick([]int{3, 0, 9, 3}, waiting(0, 0, 8, 0)), "a full one does")
	var got []int
	for range 4 {
		got = append(got, s.Pick([]int{0, 0, 0, 0}, waiting(0, 0, 0, 0)))
	}
	assert.ElementsMatch(t, []int{0, 1, 2, 3}, got, "ties go round-robin")
	assert.Equal(t, []float64{0, 0, 1, 0}, prefixScores([]int{3, 0, 9, 3}))
	assert.Equal(t, []float64{1, 0.75, 0, 1}, activeScores([]load{{0, 0}, {0, 4}, {2, 16}, {0, 0}}))
	assert.Equal(t, []float64{1, 1}, activeScores([]load{{}, {}}))
}

// TestScorerActive: with the active-request score, a replica that holds the prefix
// but runs a full batch with one request waiting loses the request to an idle one
// (the waiting queue alone reads it as barely loaded), and keeps it while the others
// are as busy.
func TestScorerActive(t *testing.T) {
	s := Scorer{PrefixWeight: 1, LoadWeight: 2, ActiveWeight: 1, QueueThreshold: 8}
	match := []int{9, 0, 0, 0}
	busy := []load{{1, 17}, {0, 0}, {0, 0}, {0, 0}}
	assert.NotEqual(t, 0, s.Pick(match, busy))
	s.ActiveWeight = 0
	assert.Equal(t, 0, s.Pick(match, busy), "the waiting queue alone does not see the batch")
	s.ActiveWeight = 1
	assert.Equal(t, 0, s.Pick(match, []load{{1, 17}, {1, 17}, {0, 16}, {1, 17}}))
	assert.Equal(t, []float64{1, 0, 1}, prefixScores([]int{4, 0, 4}))
}

// waiting returns the loads of replicas with w[r] requests waiting, none running.
func waiting(w ...int) []load {
	out := make([]load, len(w))
	for i, n := range w {
		out[i] = load{waiting: n, active: n}
	}
	return out
}
