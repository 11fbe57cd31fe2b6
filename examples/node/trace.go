package main

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// errTrace is matched by every error readTrace returns for a malformed trace.
var errTrace = errors.New("node: trace")

// traceRequest is one line of an Azure LLM inference trace: its arrival since the
// trace's first line and its prompt and output tokens.
type traceRequest struct {
	Arrival   time.Duration
	Context   int
	Generated int
}

// readTrace reads at most limit requests of a CSV trace whose header names
// TIMESTAMP, ContextTokens and GeneratedTokens (the Azure trace's columns, any order
// and case), in the order written. It fails on a missing column, a bad field or a
// trace with no request, naming the line.
func readTrace(r io.Reader, limit int) ([]traceRequest, error) {
	cr := csv.NewReader(r)
	cr.TrimLeadingSpace = true
	cr.ReuseRecord = true
	header, err := cr.Read()
	if err != nil {
		return nil, fmt.Errorf("%w: header: %w", errTrace, err)
	}
	col := map[string]int{"timestamp": -1, "contexttokens": -1, "generatedtokens": -1}
	for i, h := range header {
		key := strings.ToLower(strings.TrimSpace(strings.TrimPrefix(h, "\ufeff")))
		if _, ok := col[key]; ok {
			col[key] = i
		}
	}
	for k, i := range col {
		if i < 0 {
			return nil, fmt.Errorf("%w: header %q has no %s column", errTrace, strings.Join(header, ","), k)
		}
	}
	var out []traceRequest
	var first time.Time
	for len(out) < limit {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %w", errTrace, err)
		}
		line, _ := cr.FieldPos(0)
		at, err := time.Parse("2006-01-02 15:04:05.999999999", strings.TrimSpace(rec[col["timestamp"]]))
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", errTrace, line, err)
		}
		var n [2]int
		for i, k := range []string{"contexttokens", "generatedtokens"} {
			v, err := strconv.Atoi(strings.TrimSpace(rec[col[k]]))
			if err != nil || v < 0 {
				return nil, fmt.Errorf("%w: line %d: %s %q is not a token count", errTrace, line, k, rec[col[k]])
			}
			n[i] = v
		}
		if len(out) == 0 {
			first = at
		}
		out = append(out, traceRequest{Arrival: max(at.Sub(first), 0), Context: n[0], Generated: n[1]})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no requests after the header", errTrace)
	}
	return out, nil
}
