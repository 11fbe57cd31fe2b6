package kvevents_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/golden"
)

// python is Debian's interpreter, which python3-zmq and python3-msgpack serve (a
// python3 earlier on PATH may not see them).
const python = "/usr/bin/python3"

// requireLibzmq skips the test when Debian's python3-zmq or python3-msgpack is
// missing, unless VMARENA_REQUIRE_LIBZMQ is set (as .ci/run sets it, having
// installed them): then it fails.
func requireLibzmq(t *testing.T) {
	t.Helper()
	out, err := exec.Command(python, "-c", "import zmq, msgpack; print(zmq.zmq_version())").CombinedOutput()
	if err == nil {
		t.Logf("libzmq %s", bytes.TrimSpace(out))
		return
	}
	msg := fmt.Sprintf("%s can not import zmq and msgpack (apt-get install python3-zmq python3-msgpack): %v: %s", python, err, out)
	if os.Getenv("VMARENA_REQUIRE_LIBZMQ") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// syncBuffer is a bytes.Buffer safe for the logger's goroutines and the test's.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func exactJSON(t *testing.T, b []byte) any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	require.NoError(t, d.Decode(&v))
	return v
}

// libzmqEvents queues a replay's worth of events of every kind and shape on p, and
// returns what each must read as in the test's Python decoder: [form, [[field,
// value], ...]], the fields in wire order, as vLLM's definitions lay them out in
// the form of v0.26.0 (maps) or, with arrays, v0.23.0 (arrays: only trailing
// defaults left out).
func libzmqEvents(p *kvevents.Publisher, arrays bool) []any {
	var want []any
	pair := func(k string, v any) []any { return []any{k, v} }
	form := "map"
	if arrays {
		form = "array"
	}
	hashes := func(hs []uint64) []any {
		out := make([]any, len(hs))
		for i, h := range hs {
			out[i] = h
		}
		return out
	}
	for i := range 20 {
		s := stored(uint64(100*i+1), 1+i%3, uint64(100*i), i%2 == 1)
		s.Hashes[0] |= uint64(i%4) << 62 // some past int64
		s.Group = i % 2
		switch i % 3 { // the group's spec: none, a sliding window, a chunk (no window sent)
		case 1:
			s.Attention, s.Window = kv.SlidingWindow, 128
		case 2:
			s.Attention, s.Window = kv.ChunkedLocal, 9
		}
		if i%5 == 0 {
			s.LoRA = "lora-x"
			s.ExtraKeys = make([][]any, len(s.Hashes))
			s.ExtraKeys[0] = []any{"lora-x", int64(i)}
		}
		p.BlocksStored(s)
		tokens := make([]any, len(s.Tokens))
		for j, tok := range s.Tokens {
			tokens[j] = tok
		}
		var parent any
		if s.HasParent {
			parent = s.Parent
		}
		var lora any
		if s.LoRA != "" {
			lora = s.LoRA
		}
		ev := []any{pair("type", "BlockStored"), pair("block_hashes", hashes(s.Hashes)), pair("parent_block_hash", parent),
			pair("token_ids", tokens), pair("block_size", 4), pair("lora_id", nil), pair("medium", "CPU"), pair("lora_name", lora)}
		switch {
		case s.ExtraKeys != nil:
			extra := make([]any, len(s.ExtraKeys))
			for j, k := range s.ExtraKeys {
				if k != nil {
					extra[j] = k
				}
			}
			ev = append(ev, pair("extra_keys", extra))
		case arrays: // not trailing: written as None
			ev = append(ev, pair("extra_keys", nil))
		}
		ev = append(ev, pair("group_idx", s.Group))
		switch s.Attention {
		case kv.SlidingWindow:
			ev = append(ev, pair("kv_cache_spec_kind", "sliding_window"), pair("kv_cache_spec_sliding_window", s.Window))
		case kv.ChunkedLocal:
			ev = append(ev, pair("kv_cache_spec_kind", "chunked_local_attention"))
		}
		want = append(want, []any{form, ev})
		if i%4 == 3 {
			p.BlocksRemoved(kv.BlocksRemoved{Hashes: s.Hashes, Medium: "GPU", Group: s.Group})
			want = append(want, []any{form, []any{pair("type", "BlockRemoved"), pair("block_hashes", hashes(s.Hashes)), pair("medium", "GPU"), pair("group_idx", s.Group)}})
		}
	}
	p.AllBlocksCleared()
	return append(want, []any{form, []any{pair("type", "AllBlocksCleared")}})
}

// libzmqScript starts the test's Python subscriber with args and returns its stdin,
// its stdout and a wait that returns its JSON result once it exits.
func libzmqScript(t *testing.T, args ...string) (io.Writer, *bufio.Reader, func() []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, python, append([]string{"testdata/libzmq_subscriber.py"}, args...)...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr syncBuffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the subscriber's stderr: %s", stderr.String())
		}
	})
	lines := bufio.NewReader(stdout)
	return stdin, lines, func() []byte {
		out, err := io.ReadAll(lines)
		require.NoError(t, err)
		require.NoError(t, cmd.Wait(), "stderr: %s", stderr.String())
		return out
	}
}

// checkLibzmqResult compares the Python subscriber's result with what p sent.
func checkLibzmqResult(t *testing.T, p *kvevents.Publisher, out []byte, n int64, topic string, rank int, want []any, logs *syncBuffer) {
	t.Helper()
	var got struct {
		Messages int64
		Topics   []string
		Ranks    []int
		Events   json.RawMessage
	}
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)
	assert.Equal(t, n, got.Messages)
	assert.Equal(t, []string{topic}, got.Topics)
	assert.Equal(t, []int{rank}, got.Ranks)
	wantJSON, err := json.Marshal(want)
	require.NoError(t, err)
	// Compared as json.Numbers, exact (a float64 would round hashes past 2^53).
	assert.Equal(t, exactJSON(t, wantJSON), exactJSON(t, got.Events))

	st := p.Stats()
	assert.Equal(t, int64(3), st.BadRequests, "the script's three malformed requests")
	assert.Equal(t, int64(3), st.Replays, "and its three good ones")
	assert.Equal(t, 1, strings.Count(logs.String(), "malformed replay request dropped"), "one log line a second at most: %s", logs.String())
}

// TestLibzmqSubscriber has a subscriber on the real libzmq (pyzmq) read the live
// stream and the replay and decode them with its own definition of vLLM's
// EventBatch and events; every event it decoded must be one the Go side sent, in
// order, field for field, in the form of the release asked for.
func TestLibzmqSubscriber(t *testing.T) {
	requireLibzmq(t)
	for _, tt := range []struct {
		name   string
		arrays bool
	}{{"vllm-0.26.0", false}, {"vllm-0.23.0", true}} {
		t.Run(tt.name, func(t *testing.T) {
			var logs syncBuffer
			p := newPublisher(t, kvevents.Options{
				Topic:            "kv@replica-1",
				DataParallelRank: 2,
				MaxBatchEvents:   3,
				VLLM023Events:    tt.arrays,
				Logger:           slog.New(slog.NewTextHandler(&logs, nil)),
			})
			stdin, lines, wait := libzmqScript(t, "dial", p.Endpoint(), p.ReplayEndpoint(), "kv@replica-1")
			line, err := lines.ReadString('\n')
			require.NoError(t, err)
			require.Equal(t, "subscribed\n", line)
			require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 10*time.Second, time.Millisecond)

			want := libzmqEvents(p, tt.arrays)
			require.Eventually(t, func() bool { return p.Stats().Published == int64(len(want)) }, 10*time.Second, time.Millisecond)
			n := p.Stats().Batches
			_, err = fmt.Fprintf(stdin, "done %d\n", n)
			require.NoError(t, err)
			checkLibzmqResult(t, p, wait(), n, "kv@replica-1", 2, want, &logs)
		})
	}
}

// TestLibzmqConnect: the publisher, with Connect, dials a SUB on the real libzmq
// that binds (llm-d's global socket); the SUB reads the live stream and the replay
// and decodes them with its own definition of vLLM's forms, as above.
func TestLibzmqConnect(t *testing.T) {
	requireLibzmq(t)
	stdin, lines, wait := libzmqScript(t, "bind", "kv@")
	line, err := lines.ReadString('\n')
	require.NoError(t, err)
	endpoint, ok := strings.CutPrefix(strings.TrimSpace(line), "bound ")
	require.True(t, ok, "%q", line)
	require.True(t, strings.HasPrefix(endpoint, "tcp://127.0.0.1:"), endpoint)
	var logs syncBuffer
	// Rank 0: a rank moves the dialled port as well, as vLLM's offset_endpoint_port
	// does, and the SUB listens on the one port it printed.
	p, err := kvevents.New(kvevents.Options{
		Connect:           endpoint,
		ReplayEndpoint:    "tcp://127.0.0.1:0",
		Topic:             "kv@replica-1@model",
		MaxBatchEvents:    3,
		ReconnectInterval: time.Millisecond,
		MaxReconnect:      10 * time.Millisecond,
		Logger:            slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 10*time.Second, time.Millisecond)

	want := libzmqEvents(p, false)
	require.Eventually(t, func() bool { return p.Stats().Published == int64(len(want)) }, 10*time.Second, time.Millisecond)
	n := p.Stats().Batches
	_, err = fmt.Fprintf(stdin, "done %d %s\n", n, p.ReplayEndpoint())
	require.NoError(t, err)
	checkLibzmqResult(t, p, wait(), n, "kv@replica-1@model", 0, want, &logs)
}

// TestLibzmqGolden: the test's Python decoder reads the golden payloads of both
// releases as the same events, and refuses the malformed ones (a map batch, a batch
// array of the wrong length, ...): it can fail.
func TestLibzmqGolden(t *testing.T) {
	requireLibzmq(t)
	files := []string{"vllm-0.26.0.hex", "vllm-0.23.0.hex", "bad-map-batch.hex", "bad-batch-len4.hex", "bad-batch-len1.hex",
		"bad-ts-string.hex", "bad-event-untyped.hex"}
	args := []string{"check"}
	for _, f := range files {
		b, err := golden.Read(f)
		require.NoError(t, err)
		args = append(args, hex.EncodeToString(b))
	}
	_, _, wait := libzmqScript(t, args...)
	results := strings.Split(strings.TrimSpace(string(wait())), "\n")
	require.Len(t, results, len(files))
	var events [2][][]any
	for i, f := range files {
		var r struct {
			OK    [][]any
			Error string
		}
		require.NoError(t, json.Unmarshal([]byte(results[i]), &r), results[i])
		if strings.HasPrefix(f, "bad-") {
			assert.NotEmpty(t, r.Error, "%s must be refused", f)
			continue
		}
		require.Empty(t, r.Error, f)
		require.Len(t, r.OK, 4, f)
		for _, ev := range r.OK {
			events[i] = append(events[i], ev[1].([]any)) // the fields, less the form
		}
	}
	// The same events in both forms, but for extra_keys, which an array writes as
	// None before group_idx and a map leaves out.
	assert.Equal(t, events[0][:3], events[1][:3])
	assert.Equal(t, append(events[0][3][:8:8], []any{"extra_keys", nil}, events[0][3][8]), events[1][3])
}
