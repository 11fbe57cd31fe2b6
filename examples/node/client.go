package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/kv"
)

// clientEnv, set to 1, makes the program a client process of the replay (runClient)
// instead of its driver: the driver starts itself again so, once per process.
const clientEnv = "VMARENA_NODE_EXAMPLE_CLIENT"

// job is one request a client process serves: when it arrives (since the replay's
// start, on the wall clock), its prompt and output tokens after clipping, and
// whether it belongs to the process's burst.
type job struct {
	ID        int
	Arrival   time.Duration
	Context   int
	Generated int
	Burst     bool
}

// clientConfig is what the driver tells a client process, as one JSON line on its
// standard input.
type clientConfig struct {
	Name        string
	Socket      string
	Model       string
	MaxTokens   int
	Limit       int64 // the process's own cap on what it takes from the node; 0: none
	Concurrency int
	Step        time.Duration // one decode step of the batch, on the wall clock
	MaxWait     time.Duration // a request not admitted this long after it arrived is refused for good
	// WritePrompts writes every prompt token's K and V at admission; otherwise only
	// the first, and the decoded tokens.
	WritePrompts bool
	Jobs         []job
}

// served is what became of one job. Times are since the replay's start; a field
// that did not happen is -1.
type served struct {
	ID       int
	Burst    bool
	Arrival  time.Duration
	Asked    time.Duration // the first try to admit it
	Refused  time.Duration // the first time memory refused its admission
	Granted  time.Duration // its prompt's memory had: Append succeeded
	Admitted time.Duration // its prompt written: the first token's time
	Done     time.Duration // its last token written
	Rejected bool          // never served: larger than the budget, or waited past MaxWait
	Preempts int           // evicted mid-decode for want of memory and redone
	Stalls   int           // decode steps memory refused
	Blocked  bool          // waited in the queue while memory refused its head (itself, or one before it)
	Owned    int64         // the process's bytes just after its admission, as its ledger counts
}

// clientResult is what a client process reports, as one JSON line on its standard
// output, when its last job is done.
type clientResult struct {
	Name      string
	PID       int
	Number    uint64 // its client number on the owner
	Jobs      []served
	Refusals  int64           // kv.Stats.Refusals: operations refused for memory
	Closes    []time.Duration // when each sequence closed: memory given back
	LastClose time.Duration
	Err       string `json:",omitempty"`
}

// runClient is a client process: it reads its configuration, attaches to the
// owner, says "ready", reads the replay's start (Unix nanoseconds), serves its jobs
// on the wall clock, writes its result, and waits for its standard input to close
// before it closes its cache and detaches, so that the driver reads the owner's
// ledger with the process still attached.
func runClient(in io.Reader, out io.Writer) error {
	rd := bufio.NewReader(in)
	line, err := rd.ReadBytes('\n')
	if err != nil {
		return fmt.Errorf("reading the configuration: %w", err)
	}
	var cfg clientConfig
	if err := json.Unmarshal(line, &cfg); err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	model, err := kv.Preset(cfg.Model)
	if err != nil {
		return err
	}
	gov := accounting.NewGovernor()
	if cfg.Limit > 0 {
		if err := gov.SetLimit(accounting.HostKey, cfg.Limit); err != nil {
			return err
		}
	}
	c, err := nodepool.Attach(cfg.Socket, nodepool.ClientOptions{Authority: gov.Authority(cfg.Name, accounting.HostKey)})
	if err != nil {
		return err
	}
	defer c.Close()
	cache, err := kv.New(c, kv.Config{Model: model, MaxTokens: cfg.MaxTokens})
	if err != nil {
		return err
	}
	defer cache.Close()
	if _, err := fmt.Fprintln(out, "ready"); err != nil {
		return err
	}
	line, err = rd.ReadBytes('\n')
	if err != nil {
		return fmt.Errorf("reading the start: %w", err)
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(string(line)), 10, 64)
	if err != nil {
		return fmt.Errorf("start %q: %w", line, err)
	}
	s := &server{cfg: cfg, cache: cache, start: time.Unix(0, ns), tokenBytes: model.Groups[0].TokenBytes()}
	res := clientResult{Name: cfg.Name, Number: c.Number()}
	err = s.serve()
	res.Jobs, res.Closes, res.Refusals = s.done, s.closes, cache.Stats().Refusals
	if n := len(s.closes); n > 0 {
		res.LastClose = s.closes[n-1]
	}
	if err != nil {
		res.Err = err.Error()
	}
	if err := json.NewEncoder(out).Encode(res); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, rd) // until the driver is done reading the ledger
	return nil
}

// request is a job being served.
type request struct {
	served
	ctx, gen int
	seq      *kv.Sequence
	gotten   int // output tokens so far
}

// server is one process's scheduler: a batch of at most Concurrency requests, one
// decode step every Step of wall-clock time, admission in arrival order while memory
// allows (vLLM's policy, simplified, as examples/kvcache's replay).
//
// NB: a refused head is tried again at the next step rather than waited for with
// Sequence.AppendCtx (which on a node pool's client waits in the owner's FIFO queue),
// so that the batch's running requests keep stepping meanwhile.
type server struct {
	cfg        clientConfig
	cache      *kv.Cache
	start      time.Time
	tokenBytes int
	fill       []byte // tokens' bytes for a prompt's K and V, reused
	done       []served
	closes     []time.Duration
}

func (s *server) now() time.Duration { return time.Since(s.start) }

func isBudget(err error) bool { return errors.Is(err, accounting.ErrBudgetExceeded) }

// admit starts q's sequence and writes its prompt, every layer's K and V (its first
// token only unless WritePrompts). A budget refusal leaves nothing behind.
func (s *server) admit(q *request) error {
	seq, err := s.cache.NewSequence()
	if err != nil {
		return err
	}
	if err := seq.Append(q.ctx); err != nil {
		seq.Close()
		return err
	}
	if q.Granted < 0 {
		q.Granted = s.now()
	}
	if n := q.ctx * s.tokenBytes; len(s.fill) < n {
		s.fill = make([]byte, n)
		for i := range s.fill {
			s.fill[i] = byte(i)
		}
	}
	n := 1
	if s.cfg.WritePrompts {
		n = q.ctx
	}
	if err := s.write(seq, 0, n); err != nil {
		seq.Close()
		return err
	}
	q.seq = seq
	return nil
}

// write writes tokens [from, to) of every layer's K and V of seq.
func (s *server) write(seq *kv.Sequence, from, to int) error {
	if to <= from {
		return nil
	}
	src := s.fill[:(to-from)*s.tokenBytes]
	for l := range s.cache.Config().Model.Layers {
		for _, k := range []kv.Kind{kv.K, kv.V} {
			if err := seq.WriteTokens(l, k, from, to, src); err != nil {
				return err
			}
		}
	}
	return nil
}

// closeSeq closes q's sequence, which gives its memory back.
func (s *server) closeSeq(q *request) {
	q.seq.Close()
	q.seq = nil
	s.closes = append(s.closes, s.now())
}

func (s *server) finish(q *request, rejected bool) {
	if q.seq != nil {
		s.closeSeq(q)
	}
	q.Rejected = rejected
	if !rejected {
		q.Done = s.now()
	}
	s.done = append(s.done, q.served)
}

// serve runs the jobs to the end: each is served or refused for good.
func (s *server) serve() error {
	reqs := make([]*request, len(s.cfg.Jobs))
	for i, j := range s.cfg.Jobs {
		reqs[i] = &request{served: served{ID: j.ID, Burst: j.Burst, Arrival: j.Arrival, Asked: -1, Refused: -1, Granted: -1, Admitted: -1, Done: -1},
			ctx: j.Context, gen: j.Generated}
	}
	var (
		next             int
		waiting, running []*request
		stalled          bool
	)
	defer func() {
		for _, q := range running {
			q.seq.Close()
		}
	}()
	for len(s.done) < len(reqs) {
		t := s.now()
		for next < len(reqs) && reqs[next].Arrival <= t {
			waiting = append(waiting, reqs[next])
			next++
		}
		if len(running) == 0 && len(waiting) == 0 {
			time.Sleep(min(reqs[next].Arrival-t, s.cfg.Step))
			continue
		}
		// A request that waited past MaxWait is refused for good, as a server's
		// queue timeout would.
		waiting = slices.DeleteFunc(waiting, func(q *request) bool {
			if t-q.Arrival > s.cfg.MaxWait {
				s.finish(q, true)
				return true
			}
			return false
		})
		// Admit in arrival order while the batch has room and memory allows; none
		// while a running request could not grow in the last step.
		for len(waiting) > 0 && len(running) < s.cfg.Concurrency && !stalled {
			q := waiting[0]
			if q.Asked < 0 {
				q.Asked = s.now()
			}
			err := s.admit(q)
			if err != nil && !isBudget(err) {
				return fmt.Errorf("request %d: %w", q.ID, err)
			}
			if errors.Is(err, accounting.ErrExceedsLimit) {
				waiting = waiting[1:]
				s.finish(q, true) // it can never fit
				continue
			}
			if err != nil {
				// Memory may come back from this process's requests or another's:
				// try again next step.
				if q.Refused < 0 {
					q.Refused = s.now()
				}
				for _, w := range waiting {
					w.Blocked = true
				}
				break
			}
			waiting = waiting[1:]
			if q.Admitted < 0 {
				q.Admitted = s.now()
				q.Owned = s.cache.Stats().Owned
			}
			running = append(running, q)
		}
		// One decode step of every running request.
		progressed := false
		stalled = false
		for i := 0; i < len(running); i++ {
			q := running[i]
			err := q.seq.Append(1)
			if err == nil {
				n := q.seq.Len()
				err = s.write(q.seq, n-1, n)
			}
			if isBudget(err) {
				q.Stalls++
				stalled = true
				continue
			}
			if err != nil {
				return fmt.Errorf("request %d: decode: %w", q.ID, err)
			}
			progressed = true
			if q.gotten++; q.gotten >= q.gen {
				running = slices.Delete(running, i, i+1)
				i--
				s.finish(q, false)
			}
		}
		if !progressed && len(running) > 0 {
			// Every running request waits for memory: evict the youngest and redo it
			// later (recompute), as vLLM does.
			q := running[len(running)-1]
			running = running[:len(running)-1]
			s.closeSeq(q)
			q.gotten = 0
			q.Preempts++
			waiting = slices.Insert(waiting, 0, q)
		}
		if d := t + s.cfg.Step - s.now(); d > 0 {
			time.Sleep(d)
		}
	}
	return nil
}
