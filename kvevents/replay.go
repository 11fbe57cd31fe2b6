package kvevents

import (
	"encoding/binary"
	"log/slog"
	"sync"
	"time"

	"github.com/vmarena/vmarena/kvevents/internal/zmtp"
)

// The replay: the ROUTER socket takes a request [empty frame, start sequence number as
// 8 bytes big-endian] from a DEALER and answers with every kept message from that
// number on, each as [empty, seq, payload], then the end marker [empty, -1 as 8
// signed big-endian bytes, empty]. vLLM drops a request of another shape with a
// log line; so does this package, and counts it (Stats.BadRequests).

// endSeq is the replay's end marker: -1 as 8 signed big-endian bytes (vLLM's END_SEQ).
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

type replayItem struct {
	seq     uint64
	payload []byte
}

// replayBuffer keeps the latest published messages, at most maxItems of them and
// maxBytes of payload (always the latest one, however large), in a ring.
type replayBuffer struct {
	mu       sync.Mutex
	items    []replayItem // ring of capacity maxItems
	start, n int
	bytes    int64
	maxItems int
	maxBytes int64
}

func newReplayBuffer(maxItems, maxBytes int) *replayBuffer {
	return &replayBuffer{maxItems: maxItems, maxBytes: int64(maxBytes)}
}

func (r *replayBuffer) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for r.n > 0 && (r.n == r.maxItems || r.bytes+int64(len(payload)) > r.maxBytes) {
		old := &r.items[r.start]
		r.bytes -= int64(len(old.payload))
		*old = replayItem{}
		r.start = (r.start + 1) % r.maxItems
		r.n--
	}
	if r.items == nil {
		// Grown on use, up to maxItems, so that an idle publisher holds no ring.
		r.items = make([]replayItem, 0, min(r.maxItems, 64))
	}
	if len(r.items) < r.maxItems && r.start+r.n == len(r.items) {
		r.items = append(r.items, replayItem{seq, payload})
	} else {
		r.items[(r.start+r.n)%len(r.items)] = replayItem{seq, payload}
	}
	r.n++
	r.bytes += int64(len(payload))
}

// from returns the kept messages from sequence number seq on, oldest first.
func (r *replayBuffer) from(seq uint64) []replayItem {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []replayItem
	for i := 0; i < r.n; i++ {
		it := r.items[(r.start+i)%len(r.items)]
		if it.seq >= seq {
			out = append(out, it)
		}
	}
	return out
}

func (r *replayBuffer) size() (n int, bytes int64, first uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n > 0 {
		first = r.items[r.start].seq
	}
	return r.n, r.bytes, first
}

// serveReplay answers one request on the ROUTER socket: [empty, start sequence as 8
// big-endian bytes] gets every kept message from there on as [empty, seq, payload],
// then [empty, endSeq, empty]. It runs in the requesting peer's goroutine, so
// publishing never waits for it.
func (p *Publisher) serveReplay(c *zmtp.Conn, m zmtp.Msg) {
	if m.Oversized || len(m.Frames) != 2 || len(m.Frames[0]) != 0 || len(m.Frames[1]) != 8 {
		n := p.bad.Add(1)
		p.logLimit.warn(p.log, "kvevents: malformed replay request dropped",
			"peer", c.RemoteAddr().String(), "frames", len(m.Frames), "oversized", m.Oversized, "malformed_total", n)
		return
	}
	select {
	case p.slots <- struct{}{}:
		defer func() { <-p.slots }()
	default:
		n := p.refused.Add(1)
		p.logLimit.warn(p.log, "kvevents: replay request dropped: replays at their limit",
			"peer", c.RemoteAddr().String(), "max_replays", p.opts.MaxReplays, "refused_total", n)
		return
	}
	start := binary.BigEndian.Uint64(m.Frames[1])
	empty := []byte{}
	for _, it := range p.replay.from(start) {
		seq := binary.BigEndian.AppendUint64(nil, it.seq)
		if err := c.WriteMsg([][]byte{empty, seq, it.payload}, time.Now().Add(p.opts.ReplayWriteTimeout)); err != nil {
			p.replayFailed(c, err)
			return
		}
	}
	// Counted before the end marker goes, so that a client that has it sees it counted.
	p.replays.Add(1)
	if err := c.WriteMsg([][]byte{empty, endSeq, empty}, time.Now().Add(p.opts.ReplayWriteTimeout)); err != nil {
		p.replays.Add(-1)
		p.replayFailed(c, err)
	}
}

func (p *Publisher) replayFailed(c *zmtp.Conn, err error) {
	p.aborted.Add(1)
	p.logLimit.warn(p.log, "kvevents: replay client dropped", "peer", c.RemoteAddr().String(), "err", err)
	_ = c.Close()
}

// logLimiter lets a line through at most once a second, so that a flood of bad
// requests can not flood the log (the counters stay exact).
type logLimiter struct {
	mu   sync.Mutex
	last time.Time
}

func (l *logLimiter) warn(log *slog.Logger, msg string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	ok := l.last.IsZero() || now.Sub(l.last) >= time.Second
	if ok {
		l.last = now
	}
	l.mu.Unlock()
	if ok {
		log.Warn(msg, args...)
	}
}
