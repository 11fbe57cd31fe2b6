package kv_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// soakEnv sets the requests TestSoakUnderFaults replays per backing and layout; unset,
// it replays a bounded number that takes a few seconds (what CI runs).
const soakEnv = "VMARENA_SOAK_REQUESTS"

const (
	soakWorkers   = 4
	soakMaxTokens = 64
	// soakBackstop ends a wait nobody cancelled: four sequences may each hold part of
	// what the others wait for. Its firing is one of the outcomes checked, never a
	// failure.
	soakBackstop = 200 * time.Millisecond
)

var errSoakFault = errors.New("soak: injected fault")

// TestSoakUnderFaults replays many requests from concurrent workers on each sharing
// backing, under a tight budget, with random context cancellations and backing
// calls failing at random (backingtest.Faulty). Each request starts empty or on a
// shared prefix, grows (waiting for memory), writes, truncates, forks and closes,
// checking every token it wrote as it goes. An operation may fail only with the
// injected fault, its context's error, or ErrDamaged after a fault; one that fails
// changes nothing it does not report. At the end, with faults off: every prefix still
// holds its tokens, the cache closes, and the governor, the pool and the ledger are
// back to zero, no mapping of the backing is left in /proc/self/maps, and no
// goroutine is left running.
func TestSoakUnderFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("a soak; -short skips it")
	}
	requests := 48
	if v := os.Getenv(soakEnv); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, soakEnv)
		requests = n
	}
	for kind := range sharingBackings {
		for _, layout := range layouts {
			t.Run(fmt.Sprintf("%s/%v", sharingNames[kind], layout), func(t *testing.T) {
				// NB: a cleanup, not a defer: it must run after openEnv's, which closes
				// the backing (and so stops its goroutines) when the soak fails.
				opt := goleak.IgnoreCurrent()
				t.Cleanup(func() { goleak.VerifyNone(t, opt) })
				e := openEnv(t, kind, pooled, withConfig(kv.Config{MaxTokens: soakMaxTokens, Layout: layout, BlockTokens: blockTokensFor(layout)}), withLimit(soakLimit(kind, layout)), withFaults)
				soak(t, e, requests)
				e.finish(t)
			})
		}
	}
}

// soakPrefixTokens are the lengths of the prefixes the requests start on: one ending
// inside a 4 KiB granule, one on a token boundary past two.
var soakPrefixTokens = []int{5, 9}

// soakLimit returns the governor's limit for the soak on backing kind: what the
// prefixes hold, plus a sequence and a quarter at their longest, so that the
// workers' appends wait for each other and forks are refused. NB: the prefixes
// count: on a 64 KiB granule (host.Shared on Windows) each PerLayer prefix holds as
// much as a whole sequence.
func soakLimit(kind backingKind, layout kv.Layout) int64 {
	cfg := kv.Config{Model: tiny8, Layout: layout, BlockTokens: blockTokensFor(layout), MaxTokens: soakMaxTokens}
	committed := func(n int) int64 {
		s, err := cfg.Size(envGranuleOf(kind), n)
		if err != nil {
			panic(err)
		}
		return s.Committed
	}
	limit := committed(soakMaxTokens) * 5 / 4
	for _, n := range soakPrefixTokens {
		limit += committed(n)
	}
	return limit
}

// soakPrefix is a prefix the requests start on, and its writer.
type soakPrefix struct {
	p *kv.Prefix
	n int
	w uint64
}

func soak(t *testing.T, e *env, requests int) {
	// The prefixes, made before any fault.
	var prefixes []soakPrefix
	released := 0 // prefixes[:released] are released
	e.onFail(func() {
		for _, p := range prefixes[released:] {
			p.p.Release()
		}
	})
	for i, n := range soakPrefixTokens {
		root, err := e.c.NewSequence()
		require.NoError(t, err)
		e.onFail(func() { root.Close() })
		require.NoError(t, root.Append(n))
		w := uint64(1000 + i)
		writeTokens(t, root, w, 0, n)
		p, err := root.Freeze(n)
		require.NoError(t, err)
		prefixes = append(prefixes, soakPrefix{p, n, w})
		require.True(t, root.Close().OK())
	}

	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]int{}
	count := func(what string) {
		mu.Lock()
		outcomes[what]++
		mu.Unlock()
	}
	for w := range soakWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(requests)))
			for i := w; i < requests; i += soakWorkers {
				if rng.IntN(3) == 0 {
					e.faults.FailAt(1+rng.IntN(60), errSoakFault)
				}
				r := &soakRequest{t: t, e: e, rng: rng, writer: uint64(w)<<32 | uint64(i)<<8, count: count}
				r.run(prefixes)
				if t.Failed() {
					return
				}
			}
		}()
	}
	wg.Wait()
	e.faults.Reset()
	t.Logf("%d requests on %s: %v", requests, e.name, outcomes)

	st := e.c.Stats()
	assert.Zero(t, st.Sequences)
	assert.Equal(t, len(prefixes), st.Prefixes)
	for _, p := range prefixes {
		s, err := e.c.NewSequenceFrom(p.p)
		require.NoError(t, err)
		e.onFail(func() { s.Close() })
		checkTokens(t, s, p.w, 0, p.n)
		require.True(t, s.Close().OK())
		p.p.Release()
		released++
	}
	// A range whose release failed twice stays mapped, kept by the cache for Close to
	// retry, and is reported: Unreleased is exactly what is still mapped.
	st = e.c.Stats()
	assert.Equal(t, st.Unreleased, st.Mapped, "mapped after every close vs reported unreleased")
	st.Owned, st.Mapped, st.Waits, st.Refusals, st.Unreleased = 0, 0, 0, 0, 0
	assert.Equal(t, kv.Stats{}, st, "everything closed")
}

// soakRequest is one request: a sequence and the model of its tokens' writers (0:
// contents unknown).
type soakRequest struct {
	t      *testing.T
	e      *env
	rng    *rand.Rand
	writer uint64
	count  func(string)
	s      *kv.Sequence
	toks   []uint64
}

// allowed fails the test unless err is nil or may come from a fault, the budget
// (an operation that does not wait) or ctx (one that does); it reports whether err is
// nil.
func (r *soakRequest) allowed(err error, what string, ctx bool) bool {
	switch {
	case err == nil:
		return true
	case errors.Is(err, errSoakFault):
		r.count(what + ": fault")
	case errors.Is(err, kv.ErrDamaged):
		r.count(what + ": damaged")
	case ctx && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)):
		r.count(what + ": " + err.Error())
	case !ctx && errors.Is(err, accounting.ErrBudgetExceeded) && !errors.Is(err, accounting.ErrExceedsLimit):
		r.count(what + ": budget")
	default:
		assert.NoError(r.t, err, "%s of sequence %d", what, r.s.ID())
	}
	return false
}

func (r *soakRequest) run(prefixes []soakPrefix) {
	var err error
	if r.rng.IntN(2) == 0 {
		p := prefixes[r.rng.IntN(len(prefixes))]
		r.s, err = r.e.c.NewSequenceFrom(p.p)
		if err == nil {
			r.toks = make([]uint64, p.n)
			for i := range r.toks {
				r.toks[i] = p.w
			}
		}
	} else {
		r.s, err = r.e.c.NewSequence()
	}
	if !r.allowed(err, "new", false) {
		return
	}
	for range 2 + r.rng.IntN(8) {
		switch r.rng.IntN(6) {
		case 0, 1, 2:
			r.appendCtx()
		case 3:
			r.truncate()
		case 4:
			r.fork()
		}
		if r.s.Damaged() {
			r.count("damaged")
			break
		}
		r.check(r.s, r.toks)
	}
	id := r.s.ID()
	out := r.s.Close()
	if !out.OK() {
		// A release that failed twice: the cache keeps the range and reports it.
		assert.ErrorIs(r.t, out.Err, errSoakFault, "close of sequence %d", id)
		r.count("close: " + out.Status.String())
	}
}

// appendCtx grows the sequence with a context that may be cancelled before or during
// the wait, then writes the new tokens.
func (r *soakRequest) appendCtx() {
	n := min(1+r.rng.IntN(12), soakMaxTokens-len(r.toks))
	ctx, cancel := context.WithTimeout(context.Background(), soakBackstop)
	defer cancel()
	switch r.rng.IntN(4) {
	case 0:
		cancel()
	case 1:
		d := time.Duration(r.rng.IntN(200)) * time.Microsecond
		go func() {
			time.Sleep(d)
			cancel()
		}()
	}
	before := r.s.Len()
	if !r.allowed(r.s.AppendCtx(ctx, n), "append", true) {
		if !r.s.Damaged() {
			assert.Equal(r.t, before, r.s.Len(), "a failed append changes nothing")
		}
		return
	}
	from := len(r.toks)
	r.toks = append(r.toks, make([]uint64, n)...)
	r.write(r.s, r.toks, from)
}

// write writes tokens [from, len(toks)) of s as this request's writer.
func (r *soakRequest) write(s *kv.Sequence, toks []uint64, from int) {
	g := tiny8
	buf := make([]byte, g.Groups[0].TokenBytes())
	r.writer++
	for tok := from; tok < len(toks); tok++ {
		toks[tok] = r.writer
		for layer := range g.Layers {
			for _, kind := range kv.KindsOf(g) {
				for i := range buf {
					buf[i] = testutil.TokenByte(r.writer, layer, kind, tok, i)
				}
				if !r.allowed(s.WriteToken(layer, kind, tok, buf), "write", false) {
					toks[tok] = 0 // partly written
				}
			}
		}
	}
}

// truncate rolls the sequence back to a random length.
func (r *soakRequest) truncate() {
	n := r.rng.IntN(len(r.toks) + 1)
	before := r.s.Len()
	err := r.s.Truncate(n)
	if r.allowed(err, "truncate", false) {
		r.toks = r.toks[:n]
		return
	}
	if r.s.Damaged() {
		return
	}
	// Either nothing changed, or the replacement of a shared granule could not be
	// had: the tokens wholly below that granule are left.
	left := r.s.Len()
	if left != before {
		m := modelOf(r.e.c.Config(), r.e.c.Granularity())
		assert.Equal(r.t, m.kept(n), left, "truncate to %d of %d tokens", n, before)
	}
	r.toks = r.toks[:left]
}

// fork forks the sequence at a random point, checks the child, grows and writes it,
// and checks that the parent did not change.
func (r *soakRequest) fork() {
	n := r.rng.IntN(len(r.toks) + 1)
	child, err := r.s.ForkAt(n)
	if !r.allowed(err, "fork", false) {
		return
	}
	toks := append([]uint64(nil), r.toks[:n]...)
	r.check(child, toks)
	if k := min(1+r.rng.IntN(8), soakMaxTokens-n); r.allowed(child.Append(k), "fork append", false) {
		toks = append(toks, make([]uint64, k)...)
		r.write(child, toks, n)
		if !child.Damaged() {
			r.check(child, toks)
		}
	}
	if out := child.Close(); !out.OK() {
		assert.ErrorIs(r.t, out.Err, errSoakFault)
	}
}

// check reads back every known token of s.
func (r *soakRequest) check(s *kv.Sequence, toks []uint64) {
	t := r.t
	if !assert.Equal(t, len(toks), s.Len(), "sequence %d: length", s.ID()) {
		return
	}
	g := tiny8
	buf := make([]byte, g.Groups[0].TokenBytes())
	for tok, w := range toks {
		if w == 0 {
			continue
		}
		for layer := range g.Layers {
			for _, kind := range kv.KindsOf(g) {
				if !r.allowed(s.ReadToken(layer, kind, tok, buf), "read", false) {
					continue
				}
				for i := range buf {
					if buf[i] != testutil.TokenByte(w, layer, kind, tok, i) {
						assert.Failf(t, "a token lost its bytes", "sequence %d token %d layer %d %v byte %d: got %d, want %d (writer %#x)",
							s.ID(), tok, layer, kind, i, buf[i], testutil.TokenByte(w, layer, kind, tok, i), w)
						return
					}
				}
			}
		}
	}
}
