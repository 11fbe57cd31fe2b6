package kronk_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ardanlabs/kronk/sdk/kronk/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/examples/kronk"
)

// imcSnapshot takes, on a model.SessionStore, the steps Kronk v1.32.6 takes to
// snapshot a session (sdk/kronk/model/batchgen_slot_start.go, startSlot's IMC
// snapshot, through prepareSessionSnapshot in caching_imc.go): Prepare the
// state's size and check the slice, extract the state into it (state writes it),
// Commit only a complete transfer and otherwise Reset, and keep the snapshot only
// when Len is the whole size. On false Kronk invalidates the session's cache and
// goes on decoding the request.
func imcSnapshot(ctx context.Context, store model.SessionStore, state []byte) (bool, error) {
	buf, err := store.Prepare(ctx, len(state))
	if err == nil && len(buf) != len(state) {
		err = fmt.Errorf("Prepare returned %d bytes, want %d", len(buf), len(state))
	}
	extracted := 0
	if err == nil {
		extracted = copy(buf, state)
	}
	ok := err == nil && len(state) > 0 && extracted == len(state)
	if ok {
		if cerr := store.Commit(ctx, extracted); cerr != nil {
			ok, err = false, cerr
		}
	} else if rerr := store.Reset(ctx); rerr != nil {
		err = errors.Join(err, rerr)
	}
	return ok && store.Len() == len(state), err
}

// imcRestore is the restore side: a cache hit reads the committed snapshot back
// (llama's StateSeqSetData in Kronk); an empty store is a miss.
func imcRestore(ctx context.Context, store model.SessionStore) ([]byte, bool) {
	if store.Len() == 0 {
		return nil, false
	}
	b, err := store.Bytes(ctx)
	return b, err == nil && len(b) == store.Len()
}

func state(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed ^ byte(i*13)
	}
	return b
}

// TestRefusalInKronksPattern plays three sessions' turns through Kronk's calling
// pattern on stores from Factory under a budget of 10 granules: the turn the
// budget refuses costs its session the cached snapshot (the next request misses
// and decodes again) and nothing more: the other sessions still restore theirs,
// the refused store serves the next turn, and the total stays within the budget.
func TestRefusalInKronksPattern(t *testing.T) {
	const limit = 10 * gran
	f := newFactory(t, limit)
	ctx := context.Background()
	factory := kronk.Factory(f)
	stores := make([]model.SessionStore, 3)
	for i := range stores {
		s, err := factory(ctx)
		require.NoError(t, err)
		stores[i] = s
		defer func() { assert.NoError(t, s.Close()) }()
	}
	want := make([][]byte, len(stores))
	turn := func(i, size int, seed byte) (bool, error) {
		st := state(size, seed)
		ok, err := imcSnapshot(ctx, stores[i], st)
		if ok {
			want[i] = st
		} else {
			want[i] = nil
		}
		return ok, err
	}

	for i, size := range []int{4 * gran, 3 * gran, 2 * gran} {
		ok, err := turn(i, size, byte(i))
		require.NoError(t, err)
		require.True(t, ok)
	}
	// Session 1 grows by 2 granules; only 1 is free.
	ok, err := turn(1, 5*gran, 9)
	assert.False(t, ok)
	var refused *accounting.BudgetError
	require.ErrorAs(t, err, &refused)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)

	for i, s := range stores {
		got, hit := imcRestore(ctx, s)
		switch i {
		case 1:
			assert.False(t, hit, "the refused session misses and decodes its prompt again")
			assert.Zero(t, s.Cap(), "and holds nothing")
		default:
			require.True(t, hit, "session %d lost its snapshot", i)
			assert.True(t, bytes.Equal(want[i], got), "session %d's snapshot changed", i)
		}
	}

	// Its next request decodes the prompt again and snapshots a state that fits.
	ok, err = turn(1, 4*gran, 10)
	require.NoError(t, err)
	require.True(t, ok)
	got, hit := imcRestore(ctx, stores[1])
	require.True(t, hit)
	assert.True(t, bytes.Equal(want[1], got))
	assert.LessOrEqual(t, f.Authority().Governor().Stats(accounting.HostKey).Peak, int64(limit))
	assert.Equal(t, int64(1), f.Stats().Refusals)
}
