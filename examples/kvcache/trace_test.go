package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReadTraceBundled(t *testing.T) {
	reqs, err := ReadTrace(bytes.NewReader(bundledTrace))
	require.NoError(t, err)
	// One request per line after the header.
	lines := bytes.Count(bytes.TrimSpace(bundledTrace), []byte("\n"))
	assert.Len(t, reqs, lines)
	assert.Zero(t, reqs[0].Arrival)
	for i := 1; i < len(reqs); i++ {
		require.GreaterOrEqual(t, reqs[i].Arrival, reqs[i-1].Arrival, "request %d", i)
		require.Equal(t, i, reqs[i].ID)
	}
	// The first line of the file, as written there.
	assert.Equal(t, 374, reqs[0].Context)
	assert.Equal(t, 44, reqs[0].Generated)
	assert.Equal(t, 4314579000*time.Nanosecond, reqs[1].Arrival, "18:15:50.9951690 - 18:15:46.6805900")
}

func TestReadTrace(t *testing.T) {
	tests := []struct {
		name string
		csv  string
		want []Request
	}{
		{"columns in another order, other columns ignored, spaces",
			"GeneratedTokens, Model, TIMESTAMP, ContextTokens\n5, x, 2023-11-16 18:15:46.5, 10\n7, y, 2023-11-16 18:15:47, 0\n",
			[]Request{{ID: 0, Context: 10, Generated: 5}, {ID: 1, Arrival: 500 * time.Millisecond, Context: 0, Generated: 7}}},
		{"out of order lines are sorted by arrival",
			"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:00:02Z,2,2\n2023-11-16T18:00:01Z,1,1\n",
			[]Request{{ID: 0, Context: 1, Generated: 1}, {ID: 1, Arrival: time.Second, Context: 2, Generated: 2}}},
		{"byte order mark and lower-case header, no final newline",
			"\ufefftimestamp,contexttokens,generatedtokens\n2023-11-16 18:15:46,3,4",
			[]Request{{ID: 0, Context: 3, Generated: 4}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ReadTrace(strings.NewReader(tt.csv))
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestReadTraceMalformed(t *testing.T) {
	const head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	tests := []struct {
		name, csv, msg string
	}{
		{"empty", "", "empty file"},
		{"header only", head, "no requests"},
		{"missing column", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n", "no GeneratedTokens column"},
		{"not a number", head + "2023-11-16 18:15:46,1,2\n2023-11-16 18:15:47,lots,2\n", `line 3: ContextTokens "lots"`},
		{"negative", head + "2023-11-16 18:15:46,1,-2\n", `line 2: GeneratedTokens "-2"`},
		{"bad timestamp", head + "yesterday,1,2\n", `line 2: timestamp "yesterday"`},
		{"short line", head + "2023-11-16 18:15:46,1\n", "wrong number of fields"},
		{"bad quoting", head + "\"2023-11-16 18:15:46,1,2\n", "extraneous or missing"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ReadTrace(strings.NewReader(tt.csv))
			require.Error(t, err)
			assert.ErrorIs(t, err, errTrace)
			assert.Contains(t, err.Error(), tt.msg)
		})
	}
}

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"4GiB", 4 << 30, true},
		{"512 MiB", 512 << 20, true},
		{"1.5G", 3 << 29, true},
		{"64k", 64 << 10, true},
		{"2GB", 2e9, true},
		{"1048576", 1 << 20, true},
		{"0", 0, true},
		{"10B", 10, true},
		{"", 0, false},
		{"GiB", 0, false},
		{"-1GiB", 0, false},
		{"lots", 0, false},
		{"1e30TiB", 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := parseSize(tt.in)
			if !tt.ok {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
	assert.Equal(t, "3 GiB", formatBytes(3<<30))
	assert.Equal(t, "1.5 MiB", formatBytes(3<<19))
	assert.Equal(t, "100 B", formatBytes(100))
}

func ExampleReadTrace() {
	reqs, err := ReadTrace(strings.NewReader(`TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
`))
	if err != nil {
		panic(err)
	}
	for _, r := range reqs {
		fmt.Printf("request %d at %v: %d prompt tokens, %d generated\n", r.ID, r.Arrival, r.Context, r.Generated)
	}
	// Output:
	// request 0 at 0s: 374 prompt tokens, 44 generated
	// request 1 at 4.314579s: 396 prompt tokens, 109 generated
}
