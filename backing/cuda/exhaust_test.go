package cuda_test

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
)

// Device memory runs out below the governor's budget: wherever the driver says
// CUDA_ERROR_OUT_OF_MEMORY (creating a handle, mapping it, granting access), the
// commit fails with backing.ErrOutOfMemory and the driver's result, commits nothing,
// loses nothing, and the pool, the ledger and the driver agree. A commit with a
// context does not wait for budget: memory, not budget, is missing.
func TestExhaustDeviceMemory(t *testing.T) {
	const g = 64 << 10
	for _, tt := range []struct {
		name    string
		fn      string // the entry point that fails; "" when the device's memory runs out
		memory  int    // device memory in granules
		prefill int    // idle handles before the commit of 4
	}{
		// 4 kept + 2 idle of 7: the commit takes 2, makes 1 and finds no memory for
		// the last one.
		{"cuMemCreate", "", 7, 2},
		// 4 kept + 4 idle of 8: the commit only maps, and the driver runs out there.
		{"cuMemMap", "cuMemMap", 8, 4},
		{"cuMemSetAccess", "cuMemSetAccess", 8, 4},
	} {
		t.Run(tt.name, func(t *testing.T) {
			gov := accounting.NewGovernor()
			auth := gov.Authority("pool", accounting.GPU(0))
			x := fakeBacking(t, cuda.FakeDriverOptions{Granularity: g, Memory: int64(tt.memory * g)},
				cuda.Options{Authority: auth, Background: true, Low: 1})
			require.NoError(t, gov.SetLimit(accounting.GPU(0), 64*g), "the budget is not what runs out")
			kept := x.reserve(t, 4)
			require.NoError(t, x.b.Commit(kept, 0, 4*g))
			want := bytes.Repeat([]byte("device"), 4*g/6+1)[:4*g]
			require.NoError(t, x.b.CopyIn(kept, 0, want))
			x.b.Quiesce() // the refill may have made a handle for Low
			require.NoError(t, x.b.Prefill(tt.prefill))
			require.Equal(t, int64(tt.prefill*g), x.b.PoolStats().Idle)
			if tt.fn != "" {
				x.f.Fail(tt.fn, 1, cuda.CodeOutOfMemory)
			}

			r := x.reserve(t, 4)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			err := x.b.CommitCtx(ctx, r, 0, 4*g)
			require.Error(t, err)
			t.Logf("%v", err)
			assert.ErrorIs(t, err, backing.ErrOutOfMemory)
			assert.NotErrorIs(t, err, accounting.ErrBudgetExceeded, "memory is missing, not budget")
			var res *cuda.Result
			require.True(t, errors.As(err, &res))
			assert.Equal(t, cuda.CodeOutOfMemory, res.Code)
			if tt.fn != "" {
				assert.Equal(t, tt.fn, res.Func)
			}
			var op *backing.OpError
			require.ErrorAs(t, err, &op)
			assert.Zero(t, op.Offset)
			assert.Equal(t, 4*g, op.Size)

			x.b.Quiesce()
			x.checkBooks(t, "after the refused commit")
			assert.Equal(t, int64(4*g), x.b.PoolStats().Mapped, "only kept is mapped")
			for i := range 4 {
				assert.ErrorIs(t, x.b.Decommit(r, i*g, g), backing.ErrNotCommitted, "granule %d", i)
			}
			assert.Equal(t, int64((tt.memory-4)*g), x.b.PoolStats().Idle, "what was taken or made is pooled, not lost")
			got := make([]byte, 4*g)
			require.NoError(t, x.b.CopyOut(got, kept, 0))
			assert.True(t, bytes.Equal(want, got), "kept's contents")

			// What fits still commits: the pool's handles, and more once kept lets go.
			require.NoError(t, x.b.Commit(r, 0, 2*g))
			require.NoError(t, x.b.Decommit(kept, 0, 4*g))
			require.NoError(t, x.b.Commit(r, 2*g, 2*g))
			x.b.Quiesce()
			x.checkBooks(t, "after the retry")
			require.True(t, x.b.Unreserve(r).OK())
			require.True(t, x.b.Unreserve(kept).OK())
		})
	}
}

// Prefill on a full device fails with ErrOutOfMemory; the handles it made stay
// pooled and charged exactly once.
func TestExhaustPrefill(t *testing.T) {
	const g = 64 << 10
	x := fakeBacking(t, cuda.FakeDriverOptions{Granularity: g, Memory: 3 * g}, cuda.Options{})
	err := x.b.Prefill(5)
	require.Error(t, err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, accounting.ErrAllocationFailed)
	assert.Equal(t, int64(3*g), x.b.PoolStats().Idle)
	x.checkBooks(t, "after the refused prefill")
	n, err := x.b.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(3*g), n)
	x.checkBooks(t, "trimmed")
}
