package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/baseline"
)

// Workload is what a replay serves, the same for every strategy.
type Workload struct {
	Requests []Request
	// Speed divides the trace's arrival times: 2 replays an hour of trace in half an
	// hour of simulated time. 0 makes every request arrive at once (the batch is
	// always full: the most pressure on memory).
	Speed float64
	// Step is the simulated model time of one batch iteration: one decode step of
	// every running request (and the prefill of those admitted in it).
	Step time.Duration
	// Concurrency is the most requests in the batch at once.
	Concurrency int
	// SystemPrompt is the tokens of the shared prefix every request starts on.
	SystemPrompt int
	// Layers and TokenBytes are the model's KV shape; MaxTokens caps one sequence:
	// longer requests have their prompt clipped from the front, as servers do.
	Layers, TokenBytes, MaxTokens int
	// Plan is, layer by layer, what each layer keeps (planLayers: a model of layer
	// groups, each in its own shape); nil: every layer K and V of TokenBytes, which
	// is then the largest token or state of the plan.
	Plan []layerPlan
	// Verify reads back, before a sequence closes, every token it still holds in every
	// layer and every recurrent state, and fails the replay on a byte that is not what
	// was written (checkSequence).
	Verify bool
	// Idle is how long, on the wall clock, memory is sampled after the load stopped
	// (every sequence closed, the prefix released): a pool gives idle granules back
	// by decay on the real clock. 0: not at all.
	Idle time.Duration
	// Causes counts what each decode step paid, by cause (causes.go); the counting
	// must have been enabled (causes.Enable) before the strategy was built.
	Causes bool
}

func (w Workload) validate() error {
	switch {
	case len(w.Requests) == 0:
		return errors.New("no requests to replay")
	case w.Speed < 0:
		return fmt.Errorf("speed %v is negative", w.Speed)
	case w.Step <= 0:
		return fmt.Errorf("step %v must be positive", w.Step)
	case w.Concurrency <= 0:
		return fmt.Errorf("concurrency %d must be positive", w.Concurrency)
	case w.SystemPrompt < 0:
		return fmt.Errorf("system prompt of %d tokens is negative", w.SystemPrompt)
	case w.Layers <= 0 || w.TokenBytes <= 0:
		return fmt.Errorf("model shape %d layers × %d bytes is empty", w.Layers, w.TokenBytes)
	case w.MaxTokens <= w.SystemPrompt:
		return fmt.Errorf("max tokens %d leaves no room past the %d-token system prompt", w.MaxTokens, w.SystemPrompt)
	case w.Idle < 0:
		return fmt.Errorf("idle time %v is negative", w.Idle)
	case w.Plan != nil && len(w.Plan) != w.Layers:
		return fmt.Errorf("a layer plan of %d layers for a model of %d", len(w.Plan), w.Layers)
	case w.Plan != nil && planBytes(w.Plan, 0) > w.TokenBytes:
		return fmt.Errorf("token bytes %d are less than the plan's largest token or state, %d", w.TokenBytes, planBytes(w.Plan, 0))
	}
	return nil
}

// bytesPerToken is one token of every layer's tensors: K and V of TokenBytes in each,
// or what the plan says.
func (w Workload) bytesPerToken() int64 {
	if w.Plan == nil {
		return 2 * int64(w.Layers) * int64(w.TokenBytes)
	}
	var n int64
	for _, p := range w.Plan {
		n += int64(len(p.kinds)) * int64(p.tokenBytes)
	}
	return n
}

// Sample is one reading of memory, taken after a batch iteration.
type Sample struct {
	At       time.Duration // simulated time
	Physical int64         // what the strategy holds
	Needed   int64         // the live tokens' bytes, the shared prefix counted once
	Saved    int64         // bytes sharing spared (Stats.Saved)
	Running  int           // requests in the batch
	Waiting  int           // requests arrived and not yet admitted
	Live     int           // live sequences (Stats.Sequences)
	// Groups is, for vmarena on a model of layer groups, the bytes each group
	// commits, and Uniform what a uniform full-attention cache of the same model
	// (kv.Model.Uniform) would commit for each for the same sequences; nil otherwise.
	Groups, Uniform []int64
}

// Result is what one strategy did with the workload.
type Result struct {
	Strategy  string
	Requests  int // replayed
	Completed int // finished every generated token
	Rejected  int // could never fit in the budget, even alone
	Clipped   int // longer than MaxTokens: prompt clipped
	Preempted int // evicted mid-decode when no running request could grow, and redone

	PeakPhysical int64 // the strategy's own peak (Stats.PeakPhysical)
	PeakNeeded   int64 // the highest exact need seen
	MaxSaved     int64 // the most bytes sharing spared at once
	Waste        float64
	Samples      []Sample
	// GroupPeak and GroupMean are, on a model of layer groups, each group's highest
	// and mean committed bytes while requests ran (Sample.Groups), UniformPeak and
	// UniformMean the uniform cache's (Sample.Uniform); nil otherwise.
	GroupPeak, GroupMean, UniformPeak, UniformMean []int64

	// Time per decode step of one request spent in the memory layer (Append of one
	// token and the write of its K and V in every layer), on the wall clock.
	StepP50, StepP99, StepMax time.Duration
	Steps                     int
	// Causes is, with Workload.Causes, what the steps paid by cause: all of them,
	// and those above StepP50 and StepP99.
	Causes     []CauseClass  `json:",omitempty"`
	MemoryTime time.Duration // all memory-layer calls, prefill included

	// Requests that finished later than they would have on an idle server (admitted
	// on arrival, one token per step), and by how much, in simulated time: the wait
	// for a place in the batch or for memory, decode steps that found no memory, and
	// work lost to preemption. MemoryRefused counts the requests that memory refused
	// at least once (at admission or mid-decode).
	Waited                    int
	MemoryRefused             int
	WaitP50, WaitP99, WaitMax time.Duration
	Makespan                  time.Duration // simulated time from the first arrival to the last completion
	Wall                      time.Duration

	// With Workload.Idle: memory held when the load stopped and after IdleFor of
	// wall-clock time without load.
	IdleStart, IdleEnd int64
	IdleFor            time.Duration

	// End is the strategy's final stats after every sequence closed and the prefix
	// was released, before the strategy closed.
	End baseline.Stats
	// After the strategy closed: vmarena's pool as the cache left it (nil for the
	// baselines), and the bytes still charged to the governor.
	PoolAfter     *backing.PoolStats
	GovernorAfter int64
	// Verified is what Workload.Verify read back and found as written.
	Verified Verified
}

// request is a request's state during the replay.
type request struct {
	Request
	ctx, gen int // after clipping
	seq      baseline.Sequence
	done     int           // generated tokens so far
	arrived  time.Duration // the first iteration at or after its arrival
	refused  bool          // memory refused it at least once
	fill     []byte
}

// replayer runs one workload against one strategy.
type replayer struct {
	w      Workload
	st     baseline.Strategy
	prefix baseline.Prefix
	bpt    int64
	now    time.Duration
	res    Result
	steps  []time.Duration
	waits  []time.Duration
	// progress is called after every completion or rejection with the count so far.
	progress func(done int, s Sample)
	gerr     error                 // the first failure to read the groups
	verr     error                 // with Workload.Verify, the first read-back that failed
	prompt   []byte                // the system prompt's fill
	scratch  []byte                // a token's or a state's bytes, for the read-back
	causes   *causeMeter           // with Workload.Causes
	live     map[*request]struct{} // admitted requests not yet closed, for planNeed
}

// groupReader is a strategy that measures its layer groups: has is false where it has
// none (a uniform model).
type groupReader interface {
	readGroups() (u groupUse, has bool, err error)
}

// Replay serves w with st and returns what happened. It stops early with ctx's error.
// st must be empty; Replay leaves it empty (every sequence closed, the prefix
// released) but open.
func Replay(ctx context.Context, st baseline.Strategy, w Workload, progress func(done int, s Sample)) (Result, error) {
	if err := w.validate(); err != nil {
		return Result{}, err
	}
	if progress == nil {
		progress = func(int, Sample) {}
	}
	r := &replayer{w: w, st: st, bpt: w.bytesPerToken(), progress: progress, live: map[*request]struct{}{}}
	r.prompt, r.scratch = r.fillBytes(0xA5), make([]byte, w.TokenBytes)
	r.res.Strategy = st.Name()
	r.res.Requests = len(w.Requests)
	if w.Causes {
		m, stop, err := startCauses()
		if err != nil {
			return r.res, err
		}
		defer stop()
		r.causes = m
	}
	start := time.Now()
	err := r.run(ctx)
	if err == nil {
		err = r.gerr
	}
	if err == nil {
		err = r.verr
	}
	r.res.Wall = time.Since(start)
	r.finish()
	if err == nil && w.Idle > 0 {
		err = r.idleTail(ctx)
	}
	return r.res, err
}

// idleTail samples memory every 50th of w.Idle of wall-clock time, for w.Idle,
// after the load stopped; the samples are placed after the last one of the replay,
// at their wall-clock distance from it. It records what was held at the start and
// at the end.
func (r *replayer) idleTail(ctx context.Context) error {
	every := max(r.w.Idle/50, 10*time.Millisecond)
	t0 := time.Now()
	r.res.IdleStart = r.st.Stats().Physical
	for {
		el := time.Since(t0)
		s := r.sample(0, 0)
		s.At, s.Needed = r.now+el, 0 // nothing is live: the prefix was released too
		r.res.Samples = append(r.res.Samples, s)
		r.res.IdleEnd, r.res.IdleFor = s.Physical, el
		if el >= r.w.Idle {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(every):
		}
	}
}

// fill returns a token's worth of b: the bytes a request writes for every token, so
// that memory is really written.
func (r *replayer) fillBytes(b byte) []byte {
	f := make([]byte, r.w.TokenBytes) // the largest token or state
	for i := range f {
		f[i] = b
	}
	return f
}

// writeTokens writes tokens [from, to) of every layer's K and V (or what the layer
// plan says each layer keeps), layer by layer as a model's forward pass does (see
// writeLayerMajor).
func (r *replayer) writeTokens(q baseline.Sequence, from, to int, src []byte) error {
	if r.w.Plan == nil {
		return writeLayerMajor(q.WriteToken, baseline.K, baseline.V, r.w.Layers, from, to, src)
	}
	for l, p := range r.w.Plan {
		part := src[:p.tokenBytes]
		for t := from; t < to; t++ {
			for _, k := range p.kinds {
				if err := q.WriteToken(l, k, t, part); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// prefill writes tokens [from, to) of q and then, where the plan has recurrent
// layers, their states: the state after the prompt.
func (r *replayer) prefill(q baseline.Sequence, from, to int, src []byte) error {
	if err := r.writeTokens(q, from, to, src); err != nil {
		return err
	}
	return writeStates(q, r.w.Plan, src)
}

// writeLayerMajor writes src into tokens [from, to) of every layer's K and V with
// write, in the order of a model's forward pass: all of a layer's tokens (K, then V,
// of each), then the next layer's. A prefill thus writes each layer's run of tokens in
// one sweep; a decode step (one token) writes one token of every layer.
func writeLayerMajor[Kind any](write func(layer int, v Kind, token int, src []byte) error, k, v Kind, layers, from, to int, src []byte) error {
	for l := range layers {
		for t := from; t < to; t++ {
			if err := write(l, k, t, src); err != nil {
				return err
			}
			if err := write(l, v, t, src); err != nil {
				return err
			}
		}
	}
	return nil
}

// makePrefix prefills the system prompt once and freezes it.
func (r *replayer) makePrefix() error {
	if r.w.SystemPrompt == 0 {
		return nil
	}
	t0 := time.Now()
	defer func() { r.res.MemoryTime += time.Since(t0) }()
	root, err := r.st.NewSequence()
	if err != nil {
		return fmt.Errorf("system prompt: %w", err)
	}
	if err := root.Append(r.w.SystemPrompt); err != nil {
		_ = root.Close()
		return fmt.Errorf("system prompt of %d tokens: %w", r.w.SystemPrompt, err)
	}
	if err := r.prefill(root, 0, r.w.SystemPrompt, r.prompt); err != nil {
		_ = root.Close()
		return fmt.Errorf("system prompt: %w", err)
	}
	p, err := root.Freeze(r.w.SystemPrompt)
	if cerr := root.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		if p != nil {
			p.Release()
		}
		return fmt.Errorf("system prompt: %w", err)
	}
	r.prefix = p
	return nil
}

func isBudget(err error) bool { return errors.Is(err, accounting.ErrBudgetExceeded) }

// admit starts q's sequence on the prefix and prefills its prompt. A budget refusal
// leaves nothing behind and returns the error.
func (r *replayer) admit(q *request) error {
	t0 := time.Now()
	defer func() { r.res.MemoryTime += time.Since(t0) }()
	var seq baseline.Sequence
	var err error
	if r.prefix != nil {
		seq, err = r.st.NewSequenceFrom(r.prefix)
	} else {
		seq, err = r.st.NewSequence()
	}
	if err != nil {
		return err
	}
	if err := seq.Append(q.ctx); err != nil {
		_ = seq.Close()
		return err
	}
	if err := r.prefill(seq, r.w.SystemPrompt, r.w.SystemPrompt+q.ctx, q.fill); err != nil {
		_ = seq.Close()
		return err
	}
	q.seq = seq
	r.live[q] = struct{}{}
	return nil
}

func (r *replayer) run(ctx context.Context) error {
	w := r.w
	if err := r.makePrefix(); err != nil {
		return err
	}
	defer func() {
		if r.prefix != nil {
			r.prefix.Release()
		}
	}()
	arrival := func(i int) time.Duration {
		if w.Speed == 0 {
			return 0
		}
		return time.Duration(float64(w.Requests[i].Arrival-w.Requests[0].Arrival) / w.Speed)
	}
	reqs := make([]*request, len(w.Requests))
	for i, rq := range w.Requests {
		q := &request{Request: rq, ctx: rq.Context, gen: rq.Generated}
		if room := w.MaxTokens - w.SystemPrompt; q.ctx+q.gen > room {
			r.res.Clipped++
			q.gen = min(q.gen, room)
			q.ctx = room - q.gen
		}
		q.fill = r.fillBytes(byte(rq.ID))
		reqs[i] = q
	}
	var (
		next     int // next request to arrive
		waiting  []*request
		running  []*request
		finished int
		// Admission policy (vLLM's, simplified): running requests come first. A
		// refused head is retried only once a sequence has closed (memory came back);
		// nothing is admitted while a running request could not grow in the last
		// step; and after a preemption, nothing until a request completes, so that
		// the evicted request does not take back at once the memory the others need.
		retry    = true
		stalled  bool
		evicting bool
	)
	// Close all live sequences on the way out, whatever happened.
	defer func() {
		for _, q := range running {
			_ = q.seq.Close()
		}
	}()
	done := func(q *request, completed bool) {
		finished++
		if q.refused {
			r.res.MemoryRefused++
		}
		if completed {
			// Completed: how much later than admitted on arrival and never held up.
			if late := r.now - q.arrived - time.Duration(max(q.gen-1, 0))*w.Step; late > 0 {
				r.waits = append(r.waits, late)
			}
		}
		r.progress(finished, r.sample(len(running), len(waiting)))
	}
	for finished < len(reqs) {
		if err := ctx.Err(); err != nil {
			return err
		}
		for next < len(reqs) && arrival(next) <= r.now {
			reqs[next].arrived = r.now
			waiting = append(waiting, reqs[next])
			next++
		}
		if len(running) == 0 && len(waiting) == 0 {
			r.now = arrival(next)
			continue
		}

		// Admit in arrival order while the batch has room and memory allows.
		for len(waiting) > 0 && len(running) < w.Concurrency && retry && !stalled && !evicting {
			q := waiting[0]
			err := r.admit(q)
			if err != nil && !isBudget(err) {
				return fmt.Errorf("request %d: %w", q.ID, err)
			}
			if err != nil {
				if len(running) == 0 || errors.Is(err, accounting.ErrExceedsLimit) {
					// Nothing will free memory for it: it can never fit.
					r.res.Rejected++
					waiting = waiting[1:]
					done(q, false)
					continue
				}
				q.refused = true
				retry = false
				break
			}
			waiting = waiting[1:]
			if q.gen == 0 {
				r.closeSeq(q)
				r.res.Completed++
				done(q, true)
				continue
			}
			running = append(running, q)
		}

		// One decode step of every running request.
		progressed := false
		stalled = false
		for i := 0; i < len(running); i++ {
			q := running[i]
			r.causes.begin()
			t0 := time.Now()
			err := q.seq.Append(1)
			if err == nil {
				t := q.seq.Len() - 1
				err = r.writeTokens(q.seq, t, t+1, q.fill)
			}
			dt := time.Since(t0)
			r.causes.stop()
			r.res.MemoryTime += dt
			if isBudget(err) {
				q.refused = true
				stalled = true
				continue
			}
			if err != nil {
				return fmt.Errorf("request %d: decode: %w", q.ID, err)
			}
			r.steps = append(r.steps, dt)
			r.causes.end(dt)
			progressed = true
			q.done++
			if q.done == q.gen {
				r.closeSeq(q)
				running = slices.Delete(running, i, i+1)
				i--
				r.res.Completed++
				retry, evicting = true, false
				done(q, true)
			}
		}
		if !progressed && len(running) > 0 {
			// Every running request is stuck waiting for memory that only they hold:
			// evict the youngest and redo it later, as vLLM does (recompute).
			q := running[len(running)-1]
			running = running[:len(running)-1]
			r.closeSeq(q)
			q.done = 0
			q.refused = true
			r.res.Preempted++
			waiting = slices.Insert(waiting, 0, q)
			retry, evicting = true, true
		}
		r.now += w.Step
		r.res.Samples = append(r.res.Samples, r.sample(len(running), len(waiting)))
	}
	r.res.Makespan = r.now
	return nil
}

func (r *replayer) closeSeq(q *request) {
	if r.w.Verify && r.verr == nil {
		v, err := checkSequence(q.seq, r.w, r.prompt, q.fill, r.scratch)
		r.res.Verified.add(v)
		if err != nil {
			r.verr = fmt.Errorf("request %d: read back at %d tokens: %w", q.ID, q.seq.Len(), err)
		}
	}
	t0 := time.Now()
	_ = q.seq.Close()
	r.res.MemoryTime += time.Since(t0)
	q.seq = nil
	delete(r.live, q)
}

// sample reads the strategy's memory now.
func (r *replayer) sample(running, waiting int) Sample {
	st := r.st.Stats()
	needed := st.Tokens
	if r.prefix != nil {
		// The prefix's tokens count once, however many sequences start on it.
		needed += int64(r.w.SystemPrompt) * (1 - int64(st.Sequences))
	}
	s := Sample{
		At:       r.now,
		Physical: st.Physical,
		Needed:   needed * r.bpt,
		Saved:    st.Saved,
		Running:  running,
		Waiting:  waiting,
		Live:     st.Sequences,
	}
	if r.w.Plan != nil {
		s.Needed = r.planNeed() // a baseline on layer groups (paged with windows)
	}
	if gr, ok := r.st.(groupReader); ok {
		u, has, err := gr.readGroups()
		if err != nil && r.gerr == nil {
			r.gerr = fmt.Errorf("reading the layer groups: %w", err)
		}
		if has {
			// No prefix on groups: every sequence's tokens are its own.
			s.Groups, s.Uniform, s.Needed = u.Committed, u.Uniform, u.Need
		}
	}
	r.res.PeakNeeded = max(r.res.PeakNeeded, s.Needed)
	r.res.MaxSaved = max(r.res.MaxSaved, s.Saved)
	return s
}

// planNeed returns the bytes the live tokens need on a model of layer groups, as
// groupMeter.need counts them for vmarena: each layer's tokens from its group's
// FirstLive on in every live sequence, and the system prompt's once (of those, from
// the first that the prompt's own next step or any sequence on it still reads). The
// baselines that run on layer groups have no recurrent layer, whose state it leaves
// out.
func (r *replayer) planNeed() int64 {
	p := 0
	if r.prefix != nil {
		p = r.w.SystemPrompt
	}
	var need int64
	for _, lp := range r.w.Plan {
		bpt := int64(len(lp.kinds)) * int64(lp.tokenBytes)
		if bpt == 0 {
			continue
		}
		need += windowNeed(lp.group, bpt, p, r.prefix != nil, func(yield func(int) bool) {
			for q := range r.live {
				if !yield(q.seq.Len()) {
					return
				}
			}
		})
	}
	return need
}

// finish computes the summary figures.
func (r *replayer) finish() {
	res := &r.res
	st := r.st.Stats()
	res.End = st
	res.PeakPhysical = st.PeakPhysical
	var phys, need float64
	running := 0
	for _, s := range res.Samples {
		if s.Running > 0 {
			phys += float64(s.Physical)
			need += float64(s.Needed)
			running++
			res.GroupPeak, res.GroupMean = addGroups(res.GroupPeak, res.GroupMean, s.Groups)
			res.UniformPeak, res.UniformMean = addGroups(res.UniformPeak, res.UniformMean, s.Uniform)
		}
	}
	for i := range res.GroupMean {
		res.GroupMean[i] /= int64(running)
		res.UniformMean[i] /= int64(running)
	}
	if phys > 0 {
		res.Waste = 100 * (1 - need/phys)
	}
	res.Steps = len(r.steps)
	res.StepP50, res.StepP99, res.StepMax = quantile(r.steps, 0.5), quantile(r.steps, 0.99), quantile(r.steps, 1)
	res.Causes = r.causes.classes()
	res.Waited = len(r.waits)
	res.WaitP50, res.WaitP99, res.WaitMax = quantile(r.waits, 0.5), quantile(r.waits, 0.99), quantile(r.waits, 1)
}

// addGroups folds one sample's per-group bytes g into the running peaks and sums.
func addGroups(peak, sum, g []int64) ([]int64, []int64) {
	if g == nil {
		return peak, sum
	}
	if peak == nil {
		peak, sum = make([]int64, len(g)), make([]int64, len(g))
	}
	for i, b := range g {
		peak[i] = max(peak[i], b)
		sum[i] += b
	}
	return peak, sum
}

// quantile returns the q-quantile of d (nearest rank), sorting d.
func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	i := int(q*float64(len(d))+0.5) - 1
	return d[min(max(i, 0), len(d)-1)]
}
