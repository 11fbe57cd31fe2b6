package snapshot_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/snapshot"
)

// imcSnapshot replays, on any store, the steps Kronk v1.32.6 takes to snapshot a
// session after decoding its cached prefix (sdk/kronk/model: the snapshot step of
// startSlot in batchgen_slot_start.go, through prepareSessionSnapshot in
// caching_imc.go): Prepare the state's size, check the slice's length, extract the
// state into it (here: fill with seed's pattern), Commit only a complete transfer
// and otherwise Reset, then trust the snapshot only if Len is the full size. It
// reports whether the session keeps a snapshot; Kronk logs err and goes on serving
// the request either way.
func imcSnapshot(ctx context.Context, store sessionStore, size int, seed byte) (ok bool, err error) {
	buf, err := store.Prepare(ctx, size)
	if err == nil && len(buf) != size {
		err = fmt.Errorf("Prepare returned %d bytes, want %d", len(buf), size)
	}
	extracted := 0
	if err == nil {
		testutil.Fill(buf, seed)
		extracted = size
	}
	ok = err == nil && size > 0 && extracted == size
	if ok {
		if cerr := store.Commit(ctx, extracted); cerr != nil {
			ok, err = false, cerr
		}
	} else if rerr := store.Reset(ctx); rerr != nil {
		err = errors.Join(err, rerr)
	}
	return ok && store.Len() == size, err
}

// TestRefusalCostsOnlyTheSnapshot runs Kronk's calling pattern under a budget that
// can not hold every session's peak: the refused session loses its own snapshot and
// nothing else, its memory goes to the others, the total never exceeds the budget,
// and a later turn snapshots again once bytes come back.
func TestRefusalCostsOnlyTheSnapshot(t *testing.T) {
	for _, kind := range backings {
		t.Run(kind.String(), func(t *testing.T) {
			const limit = 10 * gran
			opts := snapshot.Options{Backing: kind}
			if kind == snapshot.Shared {
				opts.Pool.High = -1 // keep no idle granule: the ledger is then what the stores hold
			}
			f, g := newFactory(t, limit, opts)
			ctx := context.Background()
			a, b := newStore(t, f), newStore(t, f)

			ok, err := imcSnapshot(ctx, a, 6*gran, 1)
			require.NoError(t, err)
			require.True(t, ok)
			ok, err = imcSnapshot(ctx, b, 3*gran, 2)
			require.NoError(t, err)
			require.True(t, ok)

			// b's next turn needs 6 granules: 3 more than it has, 1 is free.
			ok, err = imcSnapshot(ctx, b, 6*gran, 3)
			assert.False(t, ok)
			require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
			var refused *accounting.BudgetError
			require.ErrorAs(t, err, &refused)
			assert.Equal(t, int64(3*gran), refused.Requested)
			assert.Zero(t, b.Len(), "the refused session has no snapshot to restore")
			assert.Zero(t, b.Cap(), "and holds nothing")
			b2, err := b.Bytes(ctx)
			require.NoError(t, err)
			assert.Nil(t, b2)
			assert.Equal(t, testutil.Pattern(6*gran, 1), bytesOf(t, a), "the other session's snapshot is untouched")
			assert.Equal(t, int64(6*gran), g.Stats(accounting.HostKey).Used, "b's granules went back to the budget")
			assert.Equal(t, int64(1), f.Stats().Refusals)

			// The same store serves the session's next turn once a (smaller) one fits.
			ok, err = imcSnapshot(ctx, b, 4*gran, 4)
			require.NoError(t, err)
			assert.True(t, ok)
			assert.Equal(t, testutil.Pattern(4*gran, 4), bytesOf(t, b))

			// a's conversation ends: its reset lets b grow to what was refused.
			require.NoError(t, a.Reset(ctx))
			ok, err = imcSnapshot(ctx, b, 6*gran, 5)
			require.NoError(t, err)
			assert.True(t, ok)
			assert.Equal(t, testutil.Pattern(6*gran, 5), bytesOf(t, b))
			assert.LessOrEqual(t, g.Stats(accounting.HostKey).Peak, int64(limit), "the total never exceeded the budget")
		})
	}
}

// TestRefusalAtFirstPrepare: a store whose very first snapshot does not fit stays
// empty and keeps working.
func TestRefusalAtFirstPrepare(t *testing.T) {
	f, _ := newFactory(t, 2*gran, snapshot.Options{})
	s := newStore(t, f)
	buf, err := s.Prepare(context.Background(), 3*gran)
	require.ErrorIs(t, err, accounting.ErrExceedsLimit, "more than the whole limit can never fit")
	require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Nil(t, buf)
	assert.Zero(t, s.Len())
	assert.Zero(t, s.Cap())
	snap(t, s, 2*gran, 7)
	assert.Equal(t, testutil.Pattern(2*gran, 7), bytesOf(t, s))
}

// TestWaitFor: with Options.WaitFor a refused Prepare waits in the governor's queue:
// it is served when another store gives bytes back, refused with the budget's error
// when the wait runs out, and ends with ctx's error when ctx ends first.
func TestWaitFor(t *testing.T) {
	ctx := context.Background()

	t.Run("served", func(t *testing.T) {
		f, _ := newFactory(t, 4*gran, snapshot.Options{WaitFor: time.Minute})
		a, b := newStore(t, f), newStore(t, f)
		snap(t, a, 3*gran, 1)
		done := make(chan error, 1)
		go func() {
			_, err := b.Prepare(ctx, 2*gran)
			done <- err
		}()
		require.Eventually(t, func() bool {
			return f.Authority().Governor().Stats(accounting.HostKey).Waiters == 1
		}, 10*time.Second, time.Millisecond)
		require.NoError(t, a.Reset(ctx))
		require.NoError(t, <-done)
		assert.Equal(t, 2*gran, b.Cap())
	})

	t.Run("runs out", func(t *testing.T) {
		f, _ := newFactory(t, 4*gran, snapshot.Options{WaitFor: 20 * time.Millisecond})
		a, b := newStore(t, f), newStore(t, f)
		snap(t, a, 3*gran, 1)
		_, err := b.Prepare(ctx, 2*gran)
		require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
		require.NotErrorIs(t, err, context.DeadlineExceeded)
		assert.Zero(t, b.Cap())
		assert.Equal(t, int64(1), f.Stats().Refusals)
	})

	t.Run("context ends", func(t *testing.T) {
		f, _ := newFactory(t, 4*gran, snapshot.Options{WaitFor: time.Minute})
		a, b := newStore(t, f), newStore(t, f)
		snap(t, a, 3*gran, 1)
		snap(t, b, gran, 2)
		cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
		defer cancel()
		_, err := b.Prepare(cctx, 2*gran)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Zero(t, b.Len())
		assert.Zero(t, b.Cap(), "the store is empty after a wait that did not end in bytes")
		assert.Equal(t, int64(3*gran), f.Authority().Stats().Owned)
	})
}

// TestConcurrentStores drives many stores of one factory from as many goroutines,
// each a session growing turn by turn under a budget smaller than the sum of their
// peaks, with resets and refusals: no snapshot is ever wrong, the total never
// exceeds the budget, and the ledger is exact at the end.
func TestConcurrentStores(t *testing.T) {
	for _, kind := range backings {
		t.Run(kind.String(), func(t *testing.T) {
			const (
				sessions = 8
				turns    = 40
				limit    = 12 * gran
			)
			opts := snapshot.Options{Backing: kind}
			if kind == snapshot.Shared {
				opts.Pool.High = 4
			}
			f, g := newFactory(t, limit, opts)
			var wg, played sync.WaitGroup
			played.Add(sessions)
			errs := make(chan error, sessions)
			for i := range sessions {
				wg.Go(func() {
					errs <- session(f, i, turns, &played)
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			st := f.Stats()
			assert.Positive(t, st.Refusals, "the budget refused some growth")
			assert.LessOrEqual(t, g.Stats(accounting.HostKey).Peak, int64(limit))
			assert.Zero(t, st.Stores)
			assert.Zero(t, st.Committed)
			assert.Zero(t, st.Snapshots)
			assert.Equal(t, st.Idle, st.Ledger.Owned, "the ledger owns only what a pool keeps idle")
			if kind == snapshot.Private {
				assert.Zero(t, st.Ledger.Owned, "every byte went back")
			}
		})
	}
}

// session plays one session on a new store of f: it grows by up to half a granule a
// turn, resets now and then, and checks every snapshot it commits and the ledger
// at each turn. It keeps its last snapshot until every session has played (played),
// so that, however the goroutines are scheduled, the later ones meet the earlier
// ones' memory.
func session(f *snapshot.Factory, id, turns int, played *sync.WaitGroup) (err error) {
	ctx := context.Background()
	s, err := f.New(ctx)
	if err != nil {
		played.Done()
		return err
	}
	defer func() { err = errors.Join(err, s.Close()) }()
	defer func() { played.Done(); played.Wait() }()
	rng := rand.New(rand.NewPCG(uint64(id), 1))
	size := 0
	for turn := range turns {
		if rng.IntN(8) == 0 {
			if err := s.Reset(ctx); err != nil {
				return err
			}
			size = 0
		}
		size += 1 + rng.IntN(gran/2)
		seed := byte(id*turns + turn)
		ok, err := imcSnapshot(ctx, s, size, seed)
		switch {
		case ok:
			got, err := s.Bytes(ctx)
			if err != nil {
				return err
			}
			if string(got) != string(testutil.Pattern(size, seed)) {
				return fmt.Errorf("session %d turn %d: snapshot of %d bytes is wrong", id, turn, size)
			}
		case errors.Is(err, accounting.ErrBudgetExceeded):
			if s.Len() != 0 || s.Cap() != 0 {
				return fmt.Errorf("session %d turn %d: refused store holds %d/%d bytes", id, turn, s.Len(), s.Cap())
			}
			size = 0 // the conversation's cache is lost: it starts again
		default:
			return fmt.Errorf("session %d turn %d: %w", id, turn, err)
		}
		// NB: Stats().Committed may run a granule ahead of the ledger for a moment
		// (one store counts a granule it took before another has counted the one it
		// gave back); the ledger is the total that must hold.
		if owned := f.Authority().Stats().Owned; owned > f.Authority().Governor().Limit(accounting.HostKey) {
			return fmt.Errorf("session %d turn %d: %d owned over the limit", id, turn, owned)
		}
	}
	return nil
}
