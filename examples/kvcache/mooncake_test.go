package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReadMooncake(t *testing.T) {
	in := `{"timestamp": 1000, "input_length": 513, "output_length": 5, "hash_ids": [7, 8]}

{"timestamp": 1250, "input_length": 10, "output_length": 0, "hash_ids": [7]}
`
	reqs, err := ReadAnyTrace([]byte(in))
	require.NoError(t, err)
	assert.Equal(t, []Request{
		{ID: 0, Context: 513, Generated: 5, Blocks: []int64{7, 8}},
		{ID: 1, Arrival: 250 * time.Millisecond, Context: 10, Blocks: []int64{7}},
	}, reqs)
	a, b := reqs[0].Tokens(1000), reqs[1].Tokens(1000)
	require.Len(t, a, 513)
	require.Len(t, b, 10)
	assert.Equal(t, a[:10], b, "equal hash ids, equal tokens")
	assert.NotEqual(t, a[0], a[512], "another block, other tokens")
	assert.Len(t, reqs[0].Tokens(3), 3)
	for _, tok := range a {
		require.True(t, tok >= 0 && tok < Vocabulary)
	}
	assert.Nil(t, Request{Context: 5}.Tokens(5), "a CSV request has no token ids")
}

func TestReadAnyTraceTellsFormatsApart(t *testing.T) {
	csv, err := ReadAnyTrace([]byte("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\n"))
	require.NoError(t, err)
	assert.Equal(t, []Request{{Context: 3, Generated: 4}}, csv)
	js, err := ReadAnyTrace([]byte("\n  {\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [3]}"))
	require.NoError(t, err)
	assert.Equal(t, []int64{3}, js[0].Blocks)
}

func TestReadMooncakeMalformed(t *testing.T) {
	tests := []struct{ name, in, msg string }{
		{"empty", "\n\n", "no requests"},
		{"not json", "{oops}\n", "line 1"},
		{"unknown field", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "x": 2}`, "unknown field"},
		{"missing field", `{"timestamp": 0, "input_length": 1, "hash_ids": [1]}`, "want timestamp"},
		{"negative", `{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}`, "negative"},
		{"ids do not cover the prompt", `{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}`, "1 hash ids for 513 input tokens"},
		{"out of order", "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}", "line 2: timestamp 4 before"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ReadMooncake(strings.NewReader(tt.in))
			require.Error(t, err)
			assert.ErrorIs(t, err, errTrace)
			assert.Contains(t, err.Error(), tt.msg)
		})
	}
}

// TestReadMooncakeFile reads the bundled trace: the counts its README states.
func TestReadMooncakeFile(t *testing.T) {
	data := bundledMooncake
	reqs, err := ReadAnyTrace(data)
	require.NoError(t, err)
	assert.Len(t, reqs, 12031)
	var in int64
	seen := map[int64]bool{}
	repeat, blocks := 0, 0
	for _, r := range reqs {
		in += int64(r.Context)
		for _, h := range r.Blocks {
			if seen[h] {
				repeat++
			}
			seen[h] = true
			blocks++
		}
	}
	assert.InDelta(t, 12035, float64(in)/float64(len(reqs)), 1, "average input tokens")
	assert.InDelta(t, 36.6, 100*float64(repeat)/float64(blocks), 0.05, "blocks that repeat an earlier one")
}
