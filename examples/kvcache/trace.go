package main

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Request is one line of a trace: when it arrived, relative to the trace's first
// request, and how many tokens it read and wrote.
type Request struct {
	ID        int           // 0-based, in arrival order
	Arrival   time.Duration // since the first request of the trace
	Context   int           // prompt tokens (ContextTokens)
	Generated int           // output tokens (GeneratedTokens)
	// Blocks lists the hash ids of the prompt's 512-token blocks (Mooncake traces
	// only; nil otherwise): equal ids are equal tokens. See Request.Tokens.
	Blocks []int64
}

// errTrace is matched by every error ReadTrace returns for a malformed trace.
var errTrace = errors.New("trace")

// timestamp layouts accepted in the TIMESTAMP column: the Azure trace's, and RFC 3339.
var timestampLayouts = []string{
	"2006-01-02 15:04:05.999999999",
	"2006-01-02 15:04:05",
	time.RFC3339Nano,
}

func parseTimestamp(s string) (time.Time, error) {
	for _, l := range timestampLayouts {
		if t, err := time.Parse(l, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("timestamp %q is not like 2023-11-16 18:15:46.6805900", s)
}

// ReadTrace reads a CSV trace with a header naming the columns TIMESTAMP,
// ContextTokens and GeneratedTokens (any order, any case; other columns are ignored)
// and returns its requests in arrival order. It fails on a missing column, a bad
// field, a negative token count or a trace with no request, naming the line.
func ReadTrace(r io.Reader) ([]Request, error) {
	cr := csv.NewReader(r)
	cr.TrimLeadingSpace = true
	cr.ReuseRecord = true
	header, err := cr.Read()
	if err == io.EOF {
		return nil, fmt.Errorf("%w: empty file, want a header TIMESTAMP,ContextTokens,GeneratedTokens", errTrace)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: header: %w", errTrace, err)
	}
	cols := map[string]int{"timestamp": -1, "contexttokens": -1, "generatedtokens": -1}
	for i, h := range header {
		key := strings.ToLower(strings.TrimSpace(strings.TrimPrefix(h, "\ufeff")))
		if _, ok := cols[key]; ok {
			cols[key] = i
		}
	}
	for _, name := range []string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"} {
		if cols[strings.ToLower(name)] < 0 {
			return nil, fmt.Errorf("%w: header %q has no %s column", errTrace, strings.Join(header, ","), name)
		}
	}
	type row struct {
		at       time.Time
		ctx, gen int
	}
	var rows []row
	for {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %w", errTrace, err)
		}
		line, _ := cr.FieldPos(0)
		at, err := parseTimestamp(strings.TrimSpace(rec[cols["timestamp"]]))
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", errTrace, line, err)
		}
		var n [2]int
		for i, col := range []string{"ContextTokens", "GeneratedTokens"} {
			s := strings.TrimSpace(rec[cols[strings.ToLower(col)]])
			v, err := strconv.Atoi(s)
			if err != nil || v < 0 {
				return nil, fmt.Errorf("%w: line %d: %s %q is not a token count", errTrace, line, col, s)
			}
			n[i] = v
		}
		rows = append(rows, row{at: at, ctx: n[0], gen: n[1]})
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("%w: no requests after the header", errTrace)
	}
	// Traces are usually in order already; a stable sort keeps ties as written.
	slices.SortStableFunc(rows, func(a, b row) int { return a.at.Compare(b.at) })
	out := make([]Request, len(rows))
	for i, r := range rows {
		out[i] = Request{ID: i, Arrival: r.at.Sub(rows[0].at), Context: r.ctx, Generated: r.gen}
	}
	return out, nil
}
