package kv_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv"
)

// mappedAhead waits until the cache holds want bytes committed ahead.
func (e *env) mappedAhead(t *testing.T, want int64) {
	t.Helper()
	e.c.WaitAhead()
	require.Equal(t, want, e.c.Stats().Ahead, "bytes committed ahead")
}

// TestMapAheadMapsIntoTheSequence: once a sequence is within a few tokens of its next
// block, that block's granule is committed into the sequence's own range, charged
// and shown, and the append that crosses into the block makes no backing call.
func TestMapAheadMapsIntoTheSequence(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			// Two blocks at most: once the second is taken nothing more is asked.
			e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(32, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			require.NoError(t, s.Append(16)) // one block, the next one ahead
			e.mappedAhead(t, blockGranule)
			st := e.c.Stats()
			assert.Equal(t, blockGranule, st.Committed, "the run is no part of the sequence yet")
			assert.Equal(t, 2*blockGranule, e.pool.PoolStats().Owned, "the block's granule and the one ahead")
			assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, e.pool.PoolStats().Owned, "the governor shows it")
			assert.Zero(t, e.pool.PoolStats().Idle, "it is mapped, not idle")

			calls := e.faults.Calls()
			require.NoError(t, s.Append(1))
			assert.Equal(t, calls, e.faults.Calls(), "the step that crossed the boundary made no backing call")
			st = e.c.Stats()
			assert.Equal(t, 2*blockGranule, st.Committed)
			assert.Zero(t, st.Ahead)
			assert.Equal(t, 2*blockGranule, e.pool.PoolStats().Owned, "nothing more was made")
			// The adopted block is the sequence's: its tokens read back what was written.
			tok := make([]byte, oneBlock.Groups[0].TokenBytes())
			for i := range tok {
				tok[i] = byte(i)
			}
			require.NoError(t, s.WriteTokens(0, kv.V, 16, 17, tok))
			got := make([]byte, len(tok))
			require.NoError(t, s.ReadTokens(0, kv.V, 16, 17, got))
			assert.Equal(t, tok, got)
		})
	}
}

// TestMapAheadGivesBack: Truncate, ForkAt, Freeze, PrefixCache.Insert and Close give
// a sequence's run ahead back before they change or share its ranges: it goes idle
// to the pool, a fork neither maps nor copies it, and the ledger holds what the
// tokens need.
func TestMapAheadGivesBack(t *testing.T) {
	ops := []struct {
		name string
		op   func(t *testing.T, e *env, s *kv.Sequence)
	}{
		{"Truncate", func(t *testing.T, e *env, s *kv.Sequence) { require.NoError(t, s.Truncate(20)) }},
		{"ForkAt", func(t *testing.T, e *env, s *kv.Sequence) {
			f, err := s.ForkAt(20)
			require.NoError(t, err)
			assert.Equal(t, 2*blockGranule, e.c.SequenceStats()[1].Committed, "the fork holds the tokens' blocks only")
			assert.True(t, f.Close().OK())
		}},
		{"Freeze", func(t *testing.T, e *env, s *kv.Sequence) {
			p, err := s.Freeze(20)
			require.NoError(t, err)
			p.Release()
		}},
		{"Insert", func(t *testing.T, e *env, s *kv.Sequence) {
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			ids := make([]int32, 20)
			for i := range ids {
				ids[i] = int32(i)
			}
			require.NoError(t, pc.Insert(s, ids))
			assert.Zero(t, e.c.Stats().Ahead)
			assert.True(t, s.Close().OK())
			require.NoError(t, pc.Close())
		}},
	}
	for _, name := range aheadBackings {
		for _, tt := range ops {
			t.Run(name+"/"+tt.name, func(t *testing.T) {
				e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(256, true)), aheadBacking(t, name))
				s, err := e.c.NewSequence()
				require.NoError(t, err)
				require.NoError(t, s.Append(20)) // two blocks, the third ahead
				e.mappedAhead(t, blockGranule)
				tt.op(t, e, s)
				assert.Zero(t, e.c.Stats().Ahead, "the run went back")
				if tt.name != "Insert" {
					assert.Equal(t, 2*blockGranule, e.c.SequenceStats()[0].Committed)
					assert.GreaterOrEqual(t, e.pool.PoolStats().Idle, blockGranule, "it is idle in the pool")
					assert.True(t, s.Close().OK())
				}
				assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, e.pool.PoolStats().Owned)
				assert.Equal(t, e.pool.PoolStats().Owned, e.pool.PoolStats().Idle, "all closed: only idle granules are left")
			})
		}
		t.Run(name+"/Close", func(t *testing.T) {
			e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(256, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(20))
			e.mappedAhead(t, blockGranule)
			filled := e.pool.PoolStats().Idle // the granule made for the next run (TestMapAheadFillsThePool)
			require.Equal(t, blockGranule, filled)
			require.True(t, s.Close().OK())
			assert.Zero(t, e.c.Stats().Ahead)
			assert.Equal(t, filled+3*blockGranule, e.pool.PoolStats().Idle, "its blocks and its run went idle")
			assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, e.pool.PoolStats().Owned)
		})
	}
}

// TestMapAheadWorkerFails: a run the backing fails to commit, or the budget can not
// hold, is not mapped, and the step that crosses commits its block itself, as
// without map-ahead; the ledger stays exact.
func TestMapAheadWorkerFails(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name+"/fault", func(t *testing.T) {
			e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(32, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			boom := errors.New("injected")
			e.faults.FailOp(backingtest.OpCommit, 2, boom) // the step's commit, then the worker's
			calls := e.faults.Calls()
			require.NoError(t, s.Append(16))
			e.mappedAhead(t, 0)
			assert.Equal(t, calls+2, e.faults.Calls(), "the worker tried")
			require.NoError(t, s.Append(1))
			assert.Equal(t, calls+3, e.faults.Calls(), "the step committed its block itself")
			assert.Equal(t, 2*blockGranule, e.c.Stats().Committed)
			assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, e.pool.PoolStats().Owned)
			assert.Equal(t, 2*blockGranule, e.pool.PoolStats().Owned-e.pool.PoolStats().Idle)
		})
		t.Run(name+"/budget", func(t *testing.T) {
			e := openEnv(t, withGranule(int(blockGranule)), withLimit(blockGranule), withConfig(oneBlockConfig(32, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			require.NoError(t, s.Append(16))
			e.mappedAhead(t, 0)
			err = s.Append(1)
			require.ErrorIs(t, err, accounting.ErrBudgetExceeded, "refused as without map-ahead")
			var be *accounting.BudgetError
			require.ErrorAs(t, err, &be)
			assert.Equal(t, blockGranule, be.Requested)
			assert.Equal(t, blockGranule, e.c.Stats().Committed)
			assert.Equal(t, blockGranule, e.gov.Stats(e.auth.Device()).Used)
		})
	}
}

// TestMapAheadStepWaitsForRunInFlight: a step that crosses into its run while the
// worker still commits it (the rare case) waits for that commit and adopts the run:
// it makes no granule of its own.
func TestMapAheadStepWaitsForRunInFlight(t *testing.T) {
	granule := int(blockGranule)
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: granule, Memory: 1 << 30})
	drv := f.Driver()
	gate := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	entered := make(chan struct{}, 4)
	var creates int
	create := drv.MemCreate
	drv.MemCreate = func(handle *uint64, size uintptr, prop *cuda.MemAllocationProp, flags uint64) cuda.Code {
		creates++ // NB: one at a time: the step's, then the worker's
		if creates == 2 {
			entered <- struct{}{}
			<-gate
		}
		return create(handle, size, prop, flags)
	}
	t.Cleanup(func() { assert.NoError(t, f.CheckLeaks()) }) // NB: after the env's cleanup, which closes the backing
	e := openEnv(t, onCUDA, withGranule(granule), withCUDA(cuda.Options{Driver: drv, High: 16}), withConfig(oneBlockConfig(32, true)))
	e.onFail(release)
	c := e.c
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(16))
	select {
	case <-entered: // the worker commits the run, inside cuMemCreate
	case <-time.After(10 * time.Second):
		t.Fatal("the worker did not start the run")
	}
	done := make(chan error, 1)
	go func() { done <- s.Append(1) }()
	release()
	require.NoError(t, <-done)
	assert.Equal(t, 2, creates, "the step made no granule: it took the run")
	assert.Equal(t, 2*blockGranule, c.Stats().Committed)
	assert.Zero(t, c.Stats().Ahead)
	require.True(t, s.Close().OK())
}

// TestMapAheadConcurrentOwners: goroutines that each own their sequences append,
// truncate, fork and close them at once under a tight budget, while the worker
// commits runs into them and growths take runs back (run under -race): every
// operation succeeds or is refused for budget, the data each sequence wrote reads
// back, and the ledger balances at the end.
func TestMapAheadConcurrentOwners(t *testing.T) {
	caches := []struct {
		name  string
		cfg   kv.Config
		layer int // the full-attention layer each owner writes and reads
	}{
		{"one-block", kv.Config{Model: oneBlock, MaxTokens: 96, Layout: kv.Blocked, BlockTokens: 16}, 0},
		{"hybrid", kv.Config{Model: aheadHybrid, MaxTokens: 96, Layout: kv.Blocked}, 1},
	}
	for _, name := range aheadBackings {
		for _, cc := range caches {
			t.Run(name+"/"+cc.name, func(t *testing.T) {
				cfg := cc.cfg
				cfg.MapAhead = true
				e := openEnv(t, withGranule(int(blockGranule)), withLimit(24*blockGranule), withConfig(cfg), aheadBacking(t, name))
				st, err := e.c.LayerStrides(cc.layer)
				require.NoError(t, err)
				const owners = 4
				var wg sync.WaitGroup
				errs := make(chan error, owners)
				for w := range owners {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if err := aheadOwner(e.c, rand.New(rand.NewPCG(uint64(w), 23)), cc.layer, st.TokenBytes); err != nil {
							errs <- fmt.Errorf("owner %d: %w", w, err)
						}
					}()
				}
				waitAll(t, &wg, errs)
				e.c.WaitAhead()
				cst := e.c.Stats()
				assert.Zero(t, cst.Ahead, "every run went back with its sequence")
				assert.Zero(t, cst.Committed)
				ps := e.pool.PoolStats()
				assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, ps.Owned)
				assert.Equal(t, ps.Owned, ps.Idle, "only idle granules are left")
			})
		}
	}
}

// aheadOwner runs random operations on sequences of its own and checks that each
// sequence's first byte of every token of layer's K (tokenBytes each) reads back as
// written. An operation refused for budget, or by a window group (ErrDropped), is
// not an error.
func aheadOwner(c *kv.Cache, r *rand.Rand, layer, tokenBytes int) error {
	type seq struct {
		s   *kv.Sequence
		tag byte
	}
	var seqs []seq
	defer func() {
		for _, q := range seqs {
			q.s.Close()
		}
	}()
	tok := make([]byte, tokenBytes)
	check := func(q seq) error {
		for i := 0; i < q.s.Len(); i += 7 {
			if err := q.s.ReadTokens(layer, kv.K, i, i+1, tok); err != nil {
				return err
			}
			if tok[0] != q.tag+byte(i) {
				return fmt.Errorf("sequence %d token %d reads %d, wrote %d", q.s.ID(), i, tok[0], q.tag+byte(i))
			}
		}
		return nil
	}
	budget := func(err error) error {
		if err == nil || errors.Is(err, accounting.ErrBudgetExceeded) || errors.Is(err, kv.ErrDropped) {
			return nil
		}
		return err
	}
	for op := range 300 {
		switch k := r.IntN(10); {
		case k == 0 && len(seqs) < 3 || len(seqs) == 0:
			s, err := c.NewSequence()
			if err != nil {
				return err
			}
			seqs = append(seqs, seq{s, byte(r.IntN(256))})
		case k == 1:
			i := r.IntN(len(seqs))
			if err := check(seqs[i]); err != nil {
				return err
			}
			seqs[i].s.Close()
			seqs = append(seqs[:i], seqs[i+1:]...)
		case k == 2:
			i := r.IntN(len(seqs))
			q := seqs[i]
			// NB: a truncation into a granule shared with a fork needs one of its
			// own, which the budget may refuse: the sequence then keeps fewer tokens,
			// or, on a Model where a group after the first was refused, is damaged
			// (as Truncate says) and must be closed.
			if err := budget(q.s.Truncate(r.IntN(q.s.Len() + 1))); err != nil {
				return fmt.Errorf("op %d: truncate: %w", op, err)
			}
			if q.s.Damaged() {
				q.s.Close()
				seqs = append(seqs[:i], seqs[i+1:]...)
			}
		case k == 3 && len(seqs) < 4:
			q := seqs[r.IntN(len(seqs))]
			f, err := q.s.ForkAt(r.IntN(q.s.Len() + 1))
			if err := budget(err); err != nil {
				return fmt.Errorf("op %d: fork: %w", op, err)
			}
			if f != nil {
				if err := check(seq{f, q.tag}); err != nil {
					return err
				}
				// The fork grows on its own: tokens past its copy are its.
				seqs = append(seqs, seq{f, q.tag})
			}
		default:
			q := seqs[r.IntN(len(seqs))]
			n := min(1+r.IntN(3), 96-q.s.Len())
			if k == 4 {
				n = min(r.IntN(40), 96-q.s.Len())
			}
			from := q.s.Len()
			if err := budget(q.s.Append(n)); err != nil {
				return fmt.Errorf("op %d: append %d: %w", op, n, err)
			}
			for i := from; i < q.s.Len(); i++ {
				tok[0] = q.tag + byte(i)
				if err := q.s.WriteTokens(layer, kv.K, i, i+1, tok); err != nil {
					return fmt.Errorf("op %d: write token %d: %w", op, i, err)
				}
			}
		}
	}
	for _, q := range seqs {
		if err := check(q); err != nil {
			return err
		}
	}
	return nil
}

// TestMapAheadOwedKick: the step that crosses into its run asks for the next one but
// leaves the kick of the parked worker to the cache's next step, which pays it: the
// next run is then mapped with no wait for the test's own help (WaitAhead).
func TestMapAheadOwedKick(t *testing.T) {
	for _, name := range aheadBackings {
		t.Run(name, func(t *testing.T) {
			e := openEnv(t, withGranule(int(blockGranule)), withConfig(oneBlockConfig(64, true)), aheadBacking(t, name))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			defer func() { assert.True(t, s.Close().OK()) }()
			require.NoError(t, s.Append(16))
			e.mappedAhead(t, blockGranule) // the worker parks after this run
			calls := e.faults.Calls()
			require.NoError(t, s.Append(1)) // crosses, asks for the third block
			assert.Equal(t, calls, e.faults.Calls(), "the crossing step made no backing call")
			require.NoError(t, s.Append(1)) // pays the kick
			require.Eventually(t, func() bool { return e.c.Stats().Ahead == blockGranule }, 10*time.Second, time.Millisecond,
				"the step after the crossing one kicked the worker")
		})
	}
}

// TestMapAheadGoesOnBesideAStep: while a step commits a granule of its own (here a
// new sequence's first block), the pool holds no idle granule and the budget has room
// for more, the worker is not held off behind it: a run another sequence asked
// meanwhile is committed during the step, not after it.
func TestMapAheadGoesOnBesideAStep(t *testing.T) {
	granule := int(blockGranule)
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: granule, Memory: 1 << 30})
	drv := f.Driver()
	var armed atomic.Bool
	blocked := make(chan struct{}, 1) // the step's cuMemCreate waits
	other := make(chan struct{}, 8)   // a cuMemCreate made while it waits
	beside := make(chan bool, 1)      // whether one was
	create := drv.MemCreate
	drv.MemCreate = func(handle *uint64, size uintptr, prop *cuda.MemAllocationProp, flags uint64) cuda.Code {
		if armed.CompareAndSwap(true, false) {
			blocked <- struct{}{}
			select {
			case <-other:
				beside <- true
			case <-time.After(5 * time.Second):
				beside <- false
			}
		} else {
			select {
			case other <- struct{}{}:
			default:
			}
		}
		return create(handle, size, prop, flags)
	}
	t.Cleanup(func() { assert.NoError(t, f.CheckLeaks()) }) // NB: after the env's cleanup, which closes the backing
	e := openEnv(t, onCUDA, withGranule(granule), withLimit(64*blockGranule), withCUDA(cuda.Options{Driver: drv, High: 16}), withConfig(oneBlockConfig(64, true)))
	c, b := e.c, e.pool
	c.SetAheadFill(false) // the granules made are the runs' and the steps' alone
	y, err := c.NewSequence()
	require.NoError(t, err)
	defer func() { assert.True(t, y.Close().OK()) }()
	require.NoError(t, y.Append(16))
	c.WaitAhead() // y's second block is mapped ahead
	require.NoError(t, y.Append(1))
	// y crossed into it and asked for its third block; the kick of the parked worker
	// is owed to the next step (see TestMapAheadOwedKick).
	for len(other) > 0 {
		<-other
	}

	x, err := c.NewSequence()
	require.NoError(t, err)
	defer func() { assert.True(t, x.Close().OK()) }()
	armed.Store(true)
	done := make(chan error, 1)
	go func() { done <- x.Append(16) }() // commits x's first block itself
	select {
	case <-blocked:
	case <-time.After(10 * time.Second):
		t.Fatal("the step made no granule")
	}
	require.NoError(t, y.Append(1)) // no commit: it pays the kick
	require.NoError(t, <-done)
	assert.True(t, <-beside, "the worker committed y's run while x's step committed")
	c.WaitAhead()
	st := c.Stats()
	assert.Equal(t, 3*blockGranule, st.Committed, "x's block and y's two")
	assert.Equal(t, 2*blockGranule, st.Ahead, "y's third block and x's second")
	assert.Equal(t, e.gov.Stats(e.auth.Device()).Used, b.PoolStats().Owned, "the ledger balances")
	assert.Zero(t, b.PoolStats().Idle)
}
