package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// traceBlockTokens is the tokens of one hash id of a Mooncake trace.
const traceBlockTokens = 512

// vocabulary bounds the token IDs derived from hash ids (Llama 3's).
const vocabulary = 128256

// errTrace is matched by every error readTrace returns for a malformed trace.
var errTrace = errors.New("router: trace")

// request is one line of a Mooncake conversation trace (JSON lines of timestamp in
// ms, input_length, output_length, hash_ids: one id per 512-token block of the
// prompt, equal ids being equal tokens).
type request struct {
	id      int
	arrival time.Duration // since the trace's first request
	input   int
	output  int
	blocks  []int64
}

type traceLine struct {
	Timestamp    *int64  `json:"timestamp"`
	InputLength  *int    `json:"input_length"`
	OutputLength *int    `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"`
}

// readTrace reads at most limit requests (all when limit <= 0) of a Mooncake trace.
func readTrace(r io.Reader, limit int) ([]request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	var out []request
	var first int64
	for line := 1; sc.Scan() && (limit <= 0 || len(out) < limit); line++ {
		if len(sc.Bytes()) == 0 {
			continue
		}
		var l traceLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", errTrace, line, err)
		}
		switch {
		case l.Timestamp == nil || l.InputLength == nil || l.OutputLength == nil || l.HashIDs == nil:
			return nil, fmt.Errorf("%w: line %d: want timestamp, input_length, output_length and hash_ids", errTrace, line)
		case *l.InputLength < 0 || *l.OutputLength < 0 || len(l.HashIDs)*traceBlockTokens < *l.InputLength:
			return nil, fmt.Errorf("%w: line %d: %d hash ids for %d input tokens", errTrace, line, len(l.HashIDs), *l.InputLength)
		}
		if len(out) == 0 {
			first = *l.Timestamp
		}
		at := time.Duration(*l.Timestamp-first) * time.Millisecond
		if at < 0 || len(out) > 0 && at < out[len(out)-1].arrival {
			return nil, fmt.Errorf("%w: line %d: timestamp goes back", errTrace, line)
		}
		out = append(out, request{id: len(out), arrival: at, input: *l.InputLength, output: *l.OutputLength, blocks: l.HashIDs})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", errTrace, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no requests", errTrace)
	}
	return out, nil
}

// tokens returns the request's first n prompt tokens: token i of a hash id is a fixed
// mix of the id and i, so that prompts whose hash ids start alike start alike.
func (q request) tokens(n int) []int32 {
	n = min(n, q.input)
	out := make([]int32, n)
	for i := range out {
		x := uint64(q.blocks[i/traceBlockTokens])<<9 | uint64(i%traceBlockTokens)
		x = (x + 1) * 0xd6e8feb86659fd93
		x ^= x >> 32
		out[i] = int32(x % vocabulary)
	}
	return out
}
