// Package logrec records slog events for tests: a Recorder hands out a
// *slog.Logger whose records it keeps, and returns them as maps of their
// attributes (the standard JSON handler's output, decoded), so that a test can
// check which events a package logged and with what.
package logrec

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
)

// Recorder keeps every record logged through its Logger. The zero value is ready to
// use; a Recorder is safe for concurrent use.
type Recorder struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends one encoded record; the JSON handler calls it once per record.
func (r *Recorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.buf.Write(p)
}

// Logger returns a logger that records every event, Debug and up, in r.
func (r *Recorder) Logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(r, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// Records returns the records logged so far, oldest first, each as the map of its
// attributes with the keys "time", "level" and "msg" besides. Numbers are float64.
func (r *Recorder) Records() []map[string]any {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(r.buf.Bytes()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		m := map[string]any{}
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			panic(fmt.Sprintf("logrec: undecodable record %q: %v", sc.Text(), err))
		}
		out = append(out, m)
	}
	return out
}

// Messages returns the msg of every record logged so far, oldest first.
func (r *Recorder) Messages() []string {
	var out []string
	for _, m := range r.Records() {
		msg, _ := m["msg"].(string)
		out = append(out, msg)
	}
	return out
}

// Find returns the records whose msg is msg, oldest first.
func (r *Recorder) Find(msg string) []map[string]any {
	var out []map[string]any
	for _, m := range r.Records() {
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}
