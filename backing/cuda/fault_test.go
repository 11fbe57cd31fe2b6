package cuda_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// faultCase is one operation run with a driver fault injected at each of its calls
// in turn.
type faultCase struct {
	name string
	o    cuda.Options
	// setup builds the state before the operation and returns the reservations.
	setup func(t *testing.T, x *fx) []*cuda.Reservation
	// op runs the operation.
	op func(x *fx, rs []*cuda.Reservation) error
}

func faultCases() []faultCase {
	commitAll := func(n int) func(t *testing.T, x *fx) []*cuda.Reservation {
		return func(t *testing.T, x *fx) []*cuda.Reservation {
			r := x.reserve(t, 4)
			require.NoError(t, x.b.Commit(r, 0, n*x.g))
			return []*cuda.Reservation{r}
		}
	}
	prefilled := func(n int) func(t *testing.T, x *fx) []*cuda.Reservation {
		return func(t *testing.T, x *fx) []*cuda.Reservation {
			require.NoError(t, x.b.Prefill(n))
			return []*cuda.Reservation{x.reserve(t, 4)}
		}
	}
	return []faultCase{
		{"commit new handles", cuda.Options{}, prefilled(0),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Commit(rs[0], 0, 4*x.g) }},
		{"commit pooled handles", cuda.Options{}, prefilled(4),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Commit(rs[0], 0, 4*x.g) }},
		{"commit pooled and new", cuda.Options{}, prefilled(2),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Commit(rs[0], 0, 4*x.g) }},
		{"commit ctx", cuda.Options{}, prefilled(1),
			func(x *fx, rs []*cuda.Reservation) error {
				return x.b.CommitCtx(context.Background(), rs[0], x.g, 2*x.g)
			}},
		{"commit with high mark", cuda.Options{High: 1}, prefilled(1),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Commit(rs[0], 0, 4*x.g) }},
		{"share read-only", cuda.Options{},
			func(t *testing.T, x *fx) []*cuda.Reservation {
				rs := commitAll(3)(t, x)
				return append(rs, x.reserve(t, 4))
			},
			func(x *fx, rs []*cuda.Reservation) error {
				return x.b.Share(rs[1], x.g, rs[0], 0, 3*x.g, backing.ReadOnly)
			}},
		{"protect", cuda.Options{},
			func(t *testing.T, x *fx) []*cuda.Reservation {
				rs := commitAll(3)(t, x)
				require.NoError(t, x.b.Protect(rs[0], x.g, x.g, backing.ReadOnly))
				return rs
			},
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Protect(rs[0], 0, 3*x.g, backing.ReadOnly) }},
		{"protect read-write", cuda.Options{},
			func(t *testing.T, x *fx) []*cuda.Reservation {
				rs := commitAll(3)(t, x)
				require.NoError(t, x.b.Protect(rs[0], 0, 2*x.g, backing.ReadOnly))
				return rs
			},
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Protect(rs[0], 0, 3*x.g, backing.ReadWrite) }},
		{"decommit", cuda.Options{}, commitAll(4),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Decommit(rs[0], x.g, 2*x.g) }},
		{"decommit above the high mark", cuda.Options{High: 1}, commitAll(4),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Decommit(rs[0], 0, 4*x.g) }},
		{"decommit a share", cuda.Options{},
			func(t *testing.T, x *fx) []*cuda.Reservation {
				rs := commitAll(2)(t, x)
				b := x.reserve(t, 2)
				require.NoError(t, x.b.Share(b, 0, rs[0], 0, 2*x.g, backing.ReadWrite))
				require.NoError(t, x.b.Decommit(rs[0], 0, 2*x.g))
				return append(rs, b)
			},
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Decommit(rs[1], 0, 2*x.g) }},
		{"prefill", cuda.Options{}, prefilled(1),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Prefill(4) }},
		{"trim", cuda.Options{}, prefilled(3),
			func(x *fx, rs []*cuda.Reservation) error { _, err := x.b.Trim(1); return err }},
		{"copy in", cuda.Options{}, commitAll(2),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.CopyIn(rs[0], x.g-1, []byte{1, 2}) }},
		{"memset", cuda.Options{}, commitAll(2),
			func(x *fx, rs []*cuda.Reservation) error { return x.b.Memset(rs[0], 0, 2*x.g, 7) }},
		{"reserve", cuda.Options{}, prefilled(0),
			func(x *fx, rs []*cuda.Reservation) error {
				r, err := x.b.Reserve(2 * x.g)
				if err != nil {
					return err
				}
				for {
					// Nothing is committed, so a failure is Failed and may be retried.
					if o := x.b.Unreserve(r); o.Status != accounting.Failed {
						return o.Err
					}
				}
			}},
	}
}

// mapped returns which granules of r are committed, probing through CopyOut (which
// changes nothing).
func (x *fx) mapped(r *cuda.Reservation) []bool {
	out := make([]bool, x.b.Size(r)/x.g)
	for i := range out {
		out[i] = x.b.CopyOut(make([]byte, 1), r, i*x.g) == nil
	}
	return out
}

func TestFaultAtEveryDriverCall(t *testing.T) {
	for _, tc := range faultCases() {
		t.Run(tc.name, func(t *testing.T) {
			for n := 1; ; n++ {
				done := false
				t.Run(fmt.Sprintf("call=%d", n), func(t *testing.T) {
					x := fakeBacking(t, cudatest.FakeDriverOptions{}, tc.o)
					rs := tc.setup(t, x)
					before := make([][]bool, len(rs))
					for i, r := range rs {
						before[i] = x.mapped(r)
					}
					stats := x.b.PoolStats()
					x.f.Fail("", n, cuda.CodeUnknown)
					err := tc.op(x, rs)
					if x.f.Pending() == 1 {
						// The operation made fewer than n calls: every call was covered.
						x.f.ClearFaults()
						require.NoError(t, err)
						done = true
					} else if err != nil {
						// A failed operation changed nothing that is visible.
						for i, r := range rs {
							assert.Equal(t, before[i], x.mapped(r), "reservation %d after a failed call", i)
						}
						assert.Equal(t, stats.Mapped, x.b.PoolStats().Mapped, "mapped bytes after a failed call")
					}
					x.checkBooks(t, fmt.Sprintf("fault at call %d: %v", n, err))
					for _, r := range rs {
						o := x.b.Unreserve(r)
						require.True(t, o.OK(), "cleanup: %v", o)
					}
					x.checkBooks(t, "after unreserve")
				})
				if done || t.Failed() {
					require.Greater(t, n, 1, "the operation calls the driver")
					return
				}
			}
		})
	}
}

// withContext runs fn on a locked thread with device 0's primary context current,
// for tests that clean up behind a quarantined reservation by hand.
func withContext(t *testing.T, d *cuda.Driver, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var ctx uintptr
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRetain(&ctx, 0))
	require.Equal(t, cuda.Success, d.CtxSetCurrent(ctx))
	fn()
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
}

func TestUnreserveOutcomes(t *testing.T) {
	t.Run("complete, nothing committed", func(t *testing.T) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 2)
		assert.Equal(t, accounting.Released(0), x.b.Unreserve(r))
		assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { x.b.Unreserve(r) })
		assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { x.b.Base(r) })
	})
	t.Run("complete, empty reservation", func(t *testing.T) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 0)
		assert.Zero(t, x.b.Base(r))
		assert.Zero(t, x.f.LiveReservations(), "an empty reservation calls no driver")
		assert.Equal(t, accounting.Released(0), x.b.Unreserve(r))
	})
	t.Run("complete, run unmap fails, granules retried", func(t *testing.T) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 3)
		require.NoError(t, x.b.Commit(r, 0, 3*x.g))
		x.f.Fail("cuMemUnmap", 1, cuda.CodeUnknown)
		o := x.b.Unreserve(r)
		assert.Equal(t, accounting.Released(int64(3*x.g)), o)
	})
	t.Run("failed, nothing changed", func(t *testing.T) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 3)
		require.NoError(t, x.b.Commit(r, 0, 2*x.g))
		x.f.Fail("cuCtxSetCurrent", 1, cuda.CodeUnknown)
		o := x.b.Unreserve(r)
		assert.Equal(t, accounting.Failed, o.Status)
		assert.Equal(t, int64(2*x.g), o.Residual, "held bytes stay owned")
		assert.Zero(t, o.Unmapped)
		require.Error(t, o.Err)
		var op *backing.OpError
		assert.ErrorAs(t, o.Err, &op)
		require.NoError(t, x.b.CopyIn(r, 0, []byte{1}), "a Failed Unreserve leaves r valid")
		assert.Equal(t, accounting.Released(int64(2*x.g)), x.b.Unreserve(r), "and Unreserve may be called again")
	})
	t.Run("failed, address free refused", func(t *testing.T) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 2)
		x.f.Fail("cuMemAddressFree", 1, cuda.CodeUnknown)
		o := x.b.Unreserve(r)
		assert.Equal(t, accounting.Failed, o.Status)
		assert.Equal(t, accounting.Released(0), x.b.Unreserve(r))
	})
	t.Run("quarantined, address range lost", func(t *testing.T) {
		x := newFx(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 3)
		require.NoError(t, x.b.Commit(r, 0, 2*x.g))
		base, size := uint64(x.b.Base(r)), uintptr(x.b.Size(r))
		x.f.Fail("cuMemAddressFree", 1, cuda.CodeUnknown)
		o := x.b.Unreserve(r)
		assert.Equal(t, accounting.Quarantined, o.Status)
		assert.Equal(t, int64(2*x.g), o.Unmapped)
		assert.Zero(t, o.Residual, "no physical byte is lost, only the address range")
		assert.Error(t, o.Err)
		assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { x.b.Base(r) }, "r is unusable")
		x.checkBooks(t, "quarantined")
		require.NoError(t, x.b.Close(), "a quarantined reservation does not block Close")
		assert.Equal(t, 1, x.f.LiveReservations(), "the range the driver kept")
		withContext(t, x.f.Driver(), func() {
			require.Equal(t, cuda.Success, x.f.Driver().MemAddressFree(base, size))
		})
		x.checkClosed(t)
	})
	t.Run("quarantined, a mapping left", func(t *testing.T) {
		x := newFx(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := x.reserve(t, 3)
		require.NoError(t, x.b.Commit(r, 0, 3*x.g))
		// The run fails, then the retry of its middle granule.
		x.f.Fail("cuMemUnmap", 1, cuda.CodeUnknown)
		x.f.Fail("cuMemUnmap", 3, cuda.CodeUnknown)
		o := x.b.Unreserve(r)
		assert.Equal(t, accounting.Quarantined, o.Status)
		assert.Equal(t, int64(2*x.g), o.Unmapped)
		assert.Equal(t, int64(x.g), o.Residual)
		x.checkBooks(t, "quarantined with residual")
		assert.Equal(t, int64(x.g), x.b.PoolStats().Mapped, "the residual mapping is still attributed")
		err := x.b.Close()
		require.Error(t, err, "Close reports the handle it can not give back")
		assert.Contains(t, err.Error(), "1 handles still mapped")
		assert.Equal(t, int64(x.g), x.auth.Stats().Owned, "the residual stays charged: the ledger never lies")
		assert.Equal(t, 1, x.f.LiveMappings())
		assert.Equal(t, 1, x.f.LiveReservations())
		assert.Zero(t, x.f.RetainedContexts(0))
	})
	t.Run("failed, foreign reservation", func(t *testing.T) {
		x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		y := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
		r := y.reserve(t, 1)
		o := x.b.Unreserve(r)
		assert.Equal(t, accounting.Failed, o.Status)
		assert.ErrorIs(t, o.Err, backing.ErrForeignReservation)
		assert.Equal(t, accounting.Failed, x.b.Unreserve(nil).Status)
		require.True(t, y.b.Unreserve(r).OK())
	})
}
