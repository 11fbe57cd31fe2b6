package backingtest_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
)

type fakeR = *backingtest.FakeReservation

var errInjected = errors.New("injected")

// bare hides every capability of a Fake but Copier, so that a Faulty over it must
// answer ErrUnsupported for the rest.
type bare struct {
	backing.Backing[fakeR]
	backing.Copier[fakeR]
}

func newBare(f *backingtest.Fake) bare { return bare{f, f} }

func TestRunFaultyOverBare(t *testing.T) {
	mk := newFake(backingtest.FakeOptions{}, true)
	backingtest.Run(t, func(t *testing.T) backing.Backing[fakeR] {
		return backingtest.NewFaulty[fakeR](newBare(mk(t)))
	})
}

// opCall performs one op on f against a reservation r with granule 0 committed and
// granule 1 reserved, and returns its error.
func opCall(f *backingtest.Faulty[fakeR], op backingtest.Op, r, other fakeR, g int) error {
	switch op {
	case backingtest.OpReserve:
		x, err := f.Reserve(g)
		if err == nil && !f.Inner().Unreserve(x).OK() {
			panic("unreserve failed")
		}
		return err
	case backingtest.OpCommit:
		return f.Commit(r, g, g)
	case backingtest.OpDecommit:
		return f.Decommit(r, 0, g)
	case backingtest.OpUnreserve:
		return f.Unreserve(r).Err
	case backingtest.OpShare:
		return f.Share(other, 0, r, 0, g, backing.ReadWrite)
	case backingtest.OpCommitCtx:
		return f.CommitCtx(context.Background(), r, g, g)
	case backingtest.OpCopyIn:
		return f.CopyIn(r, 0, []byte{1})
	case backingtest.OpCopyOut:
		return f.CopyOut(make([]byte, 1), r, 0)
	case backingtest.OpPopulate:
		return f.Populate(r, 0, g)
	case backingtest.OpProtect:
		return f.Protect(r, 0, g, backing.ReadOnly)
	}
	panic("unknown op")
}

func TestFaultyFailOp(t *testing.T) {
	ops := []backingtest.Op{
		backingtest.OpReserve, backingtest.OpCommit, backingtest.OpDecommit, backingtest.OpUnreserve,
		backingtest.OpShare, backingtest.OpCommitCtx, backingtest.OpCopyIn, backingtest.OpCopyOut,
		backingtest.OpPopulate, backingtest.OpProtect,
	}
	for _, op := range ops {
		t.Run(op.String(), func(t *testing.T) {
			auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
			fake := backingtest.NewFake(backingtest.FakeOptions{Authority: auth})
			f := backingtest.NewFaulty[fakeR](fake)
			g := f.Granularity()
			r, err := f.Reserve(2 * g)
			require.NoError(t, err)
			other, err := f.Reserve(g)
			require.NoError(t, err)
			require.NoError(t, f.CopyIn(r, 0, nil)) // a counted call before arming
			require.NoError(t, f.Commit(r, 0, g))
			require.NoError(t, f.CopyIn(r, 0, []byte{42}))
			calls := f.Calls()
			require.Equal(t, 5, calls)

			f.FailOp(op, 2, errInjected)
			// The first call of op goes through, unless it is one that changes
			// what the second call would see: then do it on a scratch reservation.
			if op == backingtest.OpUnreserve {
				s, err := fake.Reserve(g)
				require.NoError(t, err)
				assert.True(t, f.Unreserve(s).OK())
			} else if op != backingtest.OpCommitCtx {
				err := opCall(f, op, r, other, g)
				undo(t, fake, op, r, other, g, err)
			} else {
				assert.ErrorIs(t, opCall(f, op, r, other, g), backing.ErrUnsupported, "a Fake is not a Waiter")
			}
			granules, reservations := fake.LiveGranules(), fake.LiveReservations()
			owned := auth.Stats().Owned

			err = opCall(f, op, r, other, g)
			require.ErrorIs(t, err, errInjected)
			var opErr *backing.OpError
			assert.True(t, errors.As(err, &opErr), "%v is an *OpError", err)
			assert.Equal(t, calls+2, f.Calls(), "failed calls count")
			// The failed call did not reach the Fake.
			assert.Equal(t, granules, fake.LiveGranules())
			assert.Equal(t, reservations, fake.LiveReservations())
			assert.Equal(t, owned, auth.Stats().Owned)
			got := make([]byte, 1)
			require.NoError(t, fake.CopyOut(got, r, 0))
			assert.Equal(t, byte(42), got[0], "contents")
			assert.ErrorIs(t, fake.Decommit(r, g, g), backing.ErrNotCommitted, "granule 1 is still reserved")
			assert.ErrorIs(t, fake.Decommit(other, 0, g), backing.ErrNotCommitted, "other is still reserved")

			// A fault fires once.
			if op != backingtest.OpCommitCtx {
				err = opCall(f, op, r, other, g)
				assert.NoError(t, err, "the third call goes through")
				undo(t, fake, op, r, other, g, err)
			}
			if op != backingtest.OpUnreserve {
				assert.True(t, fake.Unreserve(r).OK())
			}
			assert.True(t, fake.Unreserve(other).OK())
			assert.Zero(t, fake.LiveReservations(), "reservations left")
			assert.Zero(t, fake.LiveGranules(), "granules left")
		})
	}
}

// undo reverts a successful opCall so that the next one sees the same state.
func undo(t *testing.T, fake *backingtest.Fake, op backingtest.Op, r, other fakeR, g int, err error) {
	t.Helper()
	require.NoError(t, err)
	switch op {
	case backingtest.OpCommit:
		require.NoError(t, fake.Decommit(r, g, g))
	case backingtest.OpDecommit:
		require.NoError(t, fake.Commit(r, 0, g))
		require.NoError(t, fake.CopyIn(r, 0, []byte{42}))
	case backingtest.OpShare:
		require.NoError(t, fake.Decommit(other, 0, g))
	case backingtest.OpCopyIn:
		require.NoError(t, fake.CopyIn(r, 0, []byte{42}))
	case backingtest.OpProtect:
		require.NoError(t, fake.Protect(r, 0, g, backing.ReadWrite))
	}
}

func TestFaultyFailAtCountsEveryOp(t *testing.T) {
	fake := backingtest.NewFake(backingtest.FakeOptions{})
	f := backingtest.NewFaulty[fakeR](fake)
	g := f.Granularity()
	f.FailAt(3, errInjected)
	f.FailAt(5, errInjected)
	r, err := f.Reserve(2 * g) // 1
	require.NoError(t, err)
	require.NoError(t, f.Commit(r, 0, g))                     // 2
	assert.ErrorIs(t, f.CopyIn(r, 0, []byte{1}), errInjected) // 3
	assert.NoError(t, f.CopyOut(make([]byte, 1), r, 0))       // 4
	o := f.Unreserve(r)                                       // 5
	assert.Equal(t, accounting.Failed, o.Status)
	assert.ErrorIs(t, o.Err, errInjected)
	assert.Equal(t, 1, fake.LiveReservations(), "a failed Unreserve changed nothing")
	assert.Equal(t, 5, f.Calls())
	// Base, Size and the other plain methods are not counted.
	f.Base(r)
	f.Size(r)
	f.Granularity()
	f.HostAccessible()
	f.PoolStats()
	assert.Equal(t, 5, f.Calls())
	assert.True(t, f.Unreserve(r).OK()) // 6
	assert.Zero(t, fake.LiveReservations())
}

func TestFaultyReset(t *testing.T) {
	fake := backingtest.NewFake(backingtest.FakeOptions{})
	f := backingtest.NewFaulty[fakeR](fake)
	f.FailAt(1, errInjected)
	f.FailOp(backingtest.OpCommit, 1, errInjected)
	f.Reset()
	assert.Zero(t, f.Calls())
	r, err := f.Reserve(f.Granularity())
	require.NoError(t, err, "Reset disarmed FailAt")
	require.NoError(t, f.Commit(r, 0, f.Granularity()), "Reset disarmed FailOp")
	assert.Equal(t, 2, f.Calls())
	f.FailOp(backingtest.OpDecommit, 1, errInjected)
	f.Reset()
	f.FailAt(2, errInjected) // counted from Reset
	assert.NoError(t, f.Decommit(r, 0, f.Granularity()))
	assert.ErrorIs(t, f.Unreserve(r).Err, errInjected)
	assert.True(t, f.Unreserve(r).OK())
}

func TestFaultyBadArguments(t *testing.T) {
	f := backingtest.NewFaulty[fakeR](backingtest.NewFake(backingtest.FakeOptions{}))
	assert.Panics(t, func() { f.FailAt(0, errInjected) })
	assert.Panics(t, func() { f.FailOp(backingtest.OpCommit, 0, errInjected) })
	assert.Panics(t, func() { f.FailOp(backingtest.Op(200), 1, errInjected) })
	assert.Equal(t, "Op(200)", backingtest.Op(200).String())
}

func TestFaultyCapabilities(t *testing.T) {
	auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
	fake := backingtest.NewFake(backingtest.FakeOptions{Authority: auth})
	for _, tt := range []struct {
		name      string
		inner     backing.Backing[fakeR]
		zeroes    bool
		sharer    bool
		populator bool
	}{
		{"fake", fake, true, true, true},
		{"bare", newBare(fake), false, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := backingtest.NewFaulty(tt.inner)
			assert.Equal(t, tt.inner, f.Inner())
			assert.Equal(t, fake.Granularity(), f.Granularity())
			assert.Equal(t, fake.Device(), f.Device())
			assert.Equal(t, fake.Accounting(), f.Accounting())
			assert.Equal(t, tt.zeroes, f.CommitZeroes())
			assert.False(t, f.HostAccessible(), "a Fake is not HostAccessible")
			g := f.Granularity()
			r, err := f.Reserve(2 * g)
			require.NoError(t, err)
			o, err := f.Reserve(g)
			require.NoError(t, err)
			require.NoError(t, f.Commit(r, 0, g))
			// Copier is forwarded in both.
			require.NoError(t, f.CopyIn(r, 0, []byte{7}))
			got := make([]byte, 1)
			require.NoError(t, f.CopyOut(got, r, 0))
			assert.Equal(t, byte(7), got[0])
			check := func(has bool, err error, what string) {
				if has {
					assert.NoError(t, err, what)
				} else {
					assert.ErrorIs(t, err, backing.ErrUnsupported, what)
				}
			}
			check(tt.sharer, f.Share(o, 0, r, 0, g, backing.ReadOnly), "Share")
			check(tt.populator, f.Populate(r, 0, g), "Populate")
			check(tt.populator, f.Protect(r, 0, g, backing.ReadWrite), "Protect")
			assert.ErrorIs(t, f.CommitCtx(context.Background(), r, g, g), backing.ErrUnsupported, "CommitCtx")
			assert.ErrorIs(t, fake.Decommit(r, g, g), backing.ErrNotCommitted, "an unsupported CommitCtx changed nothing")
			assert.ErrorIs(t, f.Prefill(1), backing.ErrUnsupported)
			_, err = f.Trim(0)
			assert.ErrorIs(t, err, backing.ErrUnsupported)
			assert.Zero(t, f.PoolStats())
			assert.True(t, f.Unreserve(o).OK())
			assert.True(t, f.Unreserve(r).OK())
			assert.Zero(t, auth.Stats().Owned)
		})
	}
}

func TestFaultyConcurrent(t *testing.T) {
	fake := backingtest.NewFake(backingtest.FakeOptions{})
	f := backingtest.NewFaulty[fakeR](fake)
	g := f.Granularity()
	r, err := f.Reserve(8 * g)
	require.NoError(t, err)
	f.FailOp(backingtest.OpCommit, 10, errInjected)
	var wg sync.WaitGroup
	var mu sync.Mutex
	failed := 0
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				if err := f.Commit(r, w*g, g); err != nil {
					assert.ErrorIs(t, err, errInjected)
					mu.Lock()
					failed++
					mu.Unlock()
					continue
				}
				assert.NoError(t, f.Decommit(r, w*g, g))
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, 1, failed, "exactly one armed fault fires")
	assert.Equal(t, 1+40+39, f.Calls(), "reserve, commits, decommits")
	assert.True(t, f.Unreserve(r).OK())
}

// TestFaultInjectionAtEveryCall shows the pattern later packages use: count the calls
// of a clean run, then fail each in turn and check that nothing leaks.
func TestFaultInjectionAtEveryCall(t *testing.T) {
	scenario := func(f *backingtest.Faulty[fakeR]) {
		g := f.Granularity()
		a, err := f.Reserve(4 * g)
		if err != nil {
			return
		}
		defer func() {
			for !f.Unreserve(a).OK() {
			}
		}()
		if f.Commit(a, 0, 2*g) != nil {
			return
		}
		b, err := f.Reserve(2 * g)
		if err != nil {
			return
		}
		defer func() {
			for !f.Unreserve(b).OK() {
			}
		}()
		if f.Share(b, 0, a, 0, 2*g, backing.ReadOnly) != nil {
			return
		}
		_ = f.Decommit(a, 0, g)
	}
	auth := accounting.NewGovernor().Authority("fake", accounting.HostKey)
	clean := backingtest.NewFaulty[fakeR](backingtest.NewFake(backingtest.FakeOptions{Authority: auth}))
	scenario(clean)
	n := clean.Calls()
	require.Equal(t, 7, n)
	for i := 1; i <= n; i++ {
		t.Run(fmt.Sprint("call=", i), func(t *testing.T) {
			fake := backingtest.NewFake(backingtest.FakeOptions{Authority: auth})
			f := backingtest.NewFaulty[fakeR](fake)
			f.FailAt(i, errInjected)
			scenario(f)
			assert.Zero(t, fake.LiveReservations())
			assert.Zero(t, fake.LiveGranules())
			assert.Zero(t, auth.Stats().Owned)
		})
	}
}

func ExampleFaulty() {
	fake := backingtest.NewFake(backingtest.FakeOptions{})
	f := backingtest.NewFaulty[*backingtest.FakeReservation](fake)
	r, _ := f.Reserve(4 * f.Granularity())

	f.FailOp(backingtest.OpCommit, 2, errors.New("no memory today"))
	fmt.Println(f.Commit(r, 0, f.Granularity()))
	fmt.Println(f.Commit(r, f.Granularity(), f.Granularity()))
	fmt.Println(fake.LiveGranules(), "granule committed,", f.Calls(), "calls")
	fmt.Println(f.Unreserve(r))
	// Output:
	// <nil>
	// backing: commit [0x10000, +0x10000): no memory today
	// 1 granule committed, 3 calls
	// complete (unmapped 65536, residual 0)
}
