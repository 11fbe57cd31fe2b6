package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// MooncakeBlockTokens is the tokens per hash id in a Mooncake trace.
const MooncakeBlockTokens = 512

// Vocabulary is the size of the token ID space Request.Tokens draws from (Llama 3's).
const Vocabulary = 128256

// mooncakeLine is one line of a Mooncake trace.
type mooncakeLine struct {
	Timestamp    *int64  `json:"timestamp"` // ms since the trace began
	InputLength  *int    `json:"input_length"`
	OutputLength *int    `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"`
}

// ReadMooncake reads a Mooncake trace: JSON lines with timestamp (ms), input_length,
// output_length and hash_ids (one id per 512-token block of the prompt, the last block
// possibly partial). It returns the requests in arrival order and fails on a missing
// field, a negative count, a hash id list whose length does not cover input_length, or
// a trace with no request, naming the line.
func ReadMooncake(r io.Reader) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	var out []Request
	var first int64
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var l mooncakeLine
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&l); err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", errTrace, line, err)
		}
		switch {
		case l.Timestamp == nil || l.InputLength == nil || l.OutputLength == nil || l.HashIDs == nil:
			return nil, fmt.Errorf("%w: line %d: want timestamp, input_length, output_length and hash_ids", errTrace, line)
		case *l.Timestamp < 0 || *l.InputLength < 0 || *l.OutputLength < 0:
			return nil, fmt.Errorf("%w: line %d: negative timestamp or length", errTrace, line)
		case len(l.HashIDs) != (*l.InputLength+MooncakeBlockTokens-1)/MooncakeBlockTokens:
			return nil, fmt.Errorf("%w: line %d: %d hash ids for %d input tokens, want one per %d", errTrace, line, len(l.HashIDs), *l.InputLength, MooncakeBlockTokens)
		}
		if len(out) == 0 {
			first = *l.Timestamp
		}
		at := *l.Timestamp - first
		if len(out) > 0 && at < int64(out[len(out)-1].Arrival/time.Millisecond) {
			return nil, fmt.Errorf("%w: line %d: timestamp %d before the previous line's", errTrace, line, *l.Timestamp)
		}
		out = append(out, Request{ID: len(out), Arrival: time.Duration(at) * time.Millisecond,
			Context: *l.InputLength, Generated: *l.OutputLength, Blocks: l.HashIDs})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: line %d: %w", errTrace, line+1, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no requests", errTrace)
	}
	return out, nil
}

// ReadAnyTrace reads a trace in either format, told apart by its content: a first
// non-blank character '{' is a Mooncake JSON-lines trace (ReadMooncake), anything else
// a CSV trace (ReadTrace).
func ReadAnyTrace(data []byte) ([]Request, error) {
	if b := bytes.TrimLeft(data, " \t\r\n\ufeff"); len(b) > 0 && b[0] == '{' {
		return ReadMooncake(bytes.NewReader(data))
	}
	return ReadTrace(bytes.NewReader(data))
}

// Tokens returns the first n token IDs of the request's prompt (n at most Context),
// derived from its block hash ids: token i of block h is a fixed function of h and i,
// so that requests whose block lists start alike have equal leading tokens. It returns
// nil for a request without block ids (a CSV trace).
func (r Request) Tokens(n int) []int32 {
	if r.Blocks == nil {
		return nil
	}
	n = min(n, r.Context, len(r.Blocks)*MooncakeBlockTokens)
	out := make([]int32, n)
	for i := range out {
		out[i] = TokenID(r.Blocks[i/MooncakeBlockTokens], i%MooncakeBlockTokens)
	}
	return out
}

// TokenID returns token i of block h: a splitmix64 finalizer of (h, i), reduced to
// the vocabulary.
func TokenID(h int64, i int) int32 {
	x := uint64(h)*MooncakeBlockTokens + uint64(i) + 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	x ^= x >> 31
	return int32(x % Vocabulary)
}
