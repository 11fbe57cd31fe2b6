package kvevents_test

import (
	"bufio"
	"bytes"
	"context"
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

// TestLibzmqSubscriber has a subscriber on the real libzmq (pyzmq) read the live
// stream and the replay and decode them with Python's msgpack; every event it
// decoded must be one the Go side sent, in order, field for field.
func TestLibzmqSubscriber(t *testing.T) {
	requireLibzmq(t)
	var logs syncBuffer
	p := newPublisher(t, kvevents.Options{
		Topic:            "kv@replica-1",
		DataParallelRank: 2,
		MaxBatchEvents:   3,
		Logger:           slog.New(slog.NewTextHandler(&logs, nil)),
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "testdata/libzmq_subscriber.py", p.Endpoint(), p.ReplayEndpoint(), "kv@replica-1")
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	lines := bufio.NewReader(stdout)
	line, err := lines.ReadString('\n')
	require.NoError(t, err, "stderr: %s", &stderr)
	require.Equal(t, "subscribed\n", line)
	require.Eventually(t, func() bool { return p.Subscribed() == 1 }, 10*time.Second, time.Millisecond)

	// What the Go side sends, and what each event must read as in Python.
	var want []any
	pair := func(k string, v any) []any { return []any{k, v} }
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
		if s.ExtraKeys != nil {
			extra := make([]any, len(s.ExtraKeys))
			for j, k := range s.ExtraKeys {
				if k != nil {
					extra[j] = k
				}
			}
			ev = append(ev, pair("extra_keys", extra))
		}
		ev = append(ev, pair("group_idx", s.Group))
		switch s.Attention {
		case kv.SlidingWindow:
			ev = append(ev, pair("kv_cache_spec_kind", "sliding_window"), pair("kv_cache_spec_sliding_window", s.Window))
		case kv.ChunkedLocal:
			ev = append(ev, pair("kv_cache_spec_kind", "chunked_local_attention"))
		}
		want = append(want, ev)
		if i%4 == 3 {
			p.BlocksRemoved(kv.BlocksRemoved{Hashes: s.Hashes, Medium: "GPU", Group: s.Group})
			want = append(want, []any{pair("type", "BlockRemoved"), pair("block_hashes", hashes(s.Hashes)), pair("medium", "GPU"), pair("group_idx", s.Group)})
		}
	}
	p.AllBlocksCleared()
	want = append(want, []any{pair("type", "AllBlocksCleared")})
	require.Eventually(t, func() bool { return p.Stats().Published == int64(len(want)) }, 10*time.Second, time.Millisecond)
	n := p.Stats().Batches
	_, err = fmt.Fprintf(stdin, "done %d\n", n)
	require.NoError(t, err)

	out, err := io.ReadAll(lines)
	require.NoError(t, err)
	require.NoError(t, cmd.Wait(), "stderr: %s", &stderr)
	var got struct {
		Messages int64
		Ranks    []int
		Events   json.RawMessage
	}
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)
	assert.Equal(t, n, got.Messages)
	assert.Equal(t, []int{2}, got.Ranks)
	wantJSON, err := json.Marshal(want)
	require.NoError(t, err)
	// Compared as json.Numbers, exact (a float64 would round hashes past 2^53).
	assert.Equal(t, exactJSON(t, wantJSON), exactJSON(t, got.Events))

	st := p.Stats()
	assert.Equal(t, int64(3), st.BadRequests, "the script's three malformed requests")
	assert.Equal(t, int64(3), st.Replays, "and its three good ones")
	assert.Equal(t, 1, strings.Count(logs.String(), "malformed replay request dropped"), "one log line a second at most: %s", logs.String())
}
