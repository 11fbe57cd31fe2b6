package host_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/windows"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

var errInjected = errors.New("injected fault")

// winEnv is a Shared backing whose system calls fail on demand (host.SharedFaults).
type winEnv struct {
	t    *testing.T
	s    *host.Shared
	f    *host.SharedFaults
	auth *accounting.Authority
	g    int
	rs   []*host.SharedReservation
}

func newWinEnv(t *testing.T, opts host.SharedOptions) *winEnv {
	t.Helper()
	auth := accounting.NewGovernor().Authority("shared", accounting.HostKey)
	opts.Authority = auth
	opts.Granularity = kib64
	s, f, err := host.NewSharedFaulty(opts)
	if errors.Is(err, errors.ErrUnsupported) && host.WineVersion() != "" {
		host.EmulatePlaceholders(t) // see newWinShared
		s, f, err = host.NewSharedFaulty(opts)
	}
	require.NoError(t, err)
	e := &winEnv{t: t, s: s, f: f, auth: auth, g: s.Granularity()}
	t.Cleanup(func() {
		f.Reset()
		for _, r := range e.rs {
			if !host.SharedGone(r) {
				assert.Equal(t, accounting.Complete, s.Unreserve(r).Status)
			}
		}
		assert.NoError(t, host.CheckShared(s), "bookkeeping at cleanup")
		assert.NoError(t, host.SharedFileCheck(s), "sections at cleanup")
		if assert.NoError(t, s.Close()) {
			assert.Zero(t, auth.Stats().Owned, "owned bytes after Close")
			assert.Zero(t, auth.Stats().Mapped, "mapped bytes after Close")
		}
	})
	return e
}

func (e *winEnv) reserve(n int) *host.SharedReservation {
	r, err := e.s.Reserve(n * e.g)
	require.NoError(e.t, err)
	e.rs = append(e.rs, r)
	return r
}

// check verifies the bookkeeping, the sections and the address space of every live
// reservation against each other: a committed granule is a view, read-only where the
// bookkeeping says so (unless exact is false: a granule recorded read-only may then
// be read-write, as Protect says when it could not restore an access), and every
// other one reserved.
func (e *winEnv) check(what string, exact bool) {
	e.t.Helper()
	require.NoError(e.t, host.CheckShared(e.s), what)
	require.NoError(e.t, host.SharedFileCheck(e.s), what)
	for _, r := range e.rs {
		if host.SharedGone(r) {
			continue
		}
		slots, ro := host.SharedSlots(r)
		base := e.s.Base(r)
		for i, sl := range slots {
			var mbi windows.MemoryBasicInformation
			require.NoError(e.t, windows.VirtualQuery(base+uintptr(i*e.g), &mbi, 48))
			switch {
			case sl < 0:
				require.Equal(e.t, uint32(windows.MEM_RESERVE), mbi.State, "%s: granule %d is reserved", what, i)
			case ro[i] && !exact:
				require.Equal(e.t, uint32(windows.MEM_COMMIT), mbi.State, "%s: granule %d is a view", what, i)
			case ro[i]:
				require.Equal(e.t, uint32(windows.PAGE_READONLY), mbi.Protect, "%s: granule %d is a read-only view", what, i)
			default:
				require.Equal(e.t, uint32(windows.PAGE_READWRITE), mbi.Protect, "%s: granule %d is a read-write view", what, i)
			}
		}
	}
}

// snap is what a failed call must leave as it was.
func (e *winEnv) snap() string {
	st := e.auth.Stats()
	pool := e.s.PoolStats()
	// NB: Created and GivenBack are cumulative: a commit undone made and gave back
	// its granules, as it should.
	pool.Created, pool.GivenBack = 0, 0
	out := fmt.Sprintf("owned %d mapped %d pool %+v", st.Owned, st.Mapped, pool)
	for _, r := range e.rs {
		if !host.SharedGone(r) {
			slots, ro := host.SharedSlots(r)
			out += fmt.Sprintf(" %v%v", slots, ro)
		}
	}
	return out
}

// TestSharedFaultsWindows injects a failure at every system call of each operation
// (protect's VirtualProtect included) in turn, once and from there on (so that undoing fails too), and checks after each
// that the bookkeeping, the sections, the authority and the address space agree,
// that a failed operation changed nothing (or says what it could not undo), and that
// it works once the fault is gone.
func TestSharedFaultsWindows(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   host.SharedOptions
		setup  func(e *winEnv)
		op     func(e *winEnv) error
		atomic bool
	}{
		{"commit", host.SharedOptions{High: 8, Populate: true}, func(e *winEnv) {
			x := e.reserve(5)
			require.NoError(t, e.s.Commit(x, 0, 5*e.g))
			require.NoError(t, e.s.Decommit(x, e.g, e.g))
			require.NoError(t, e.s.Decommit(x, 3*e.g, e.g))
			e.reserve(4)
		}, func(e *winEnv) error { return e.s.Commit(e.rs[1], 0, 4*e.g) }, true},
		{"commit new", host.SharedOptions{}, func(e *winEnv) {
			x := e.reserve(4)
			require.NoError(t, e.s.Commit(x, e.g, e.g))
		}, func(e *winEnv) error { return e.s.Commit(e.rs[0], 2*e.g, 2*e.g) }, true},
		{"commit new before idle", host.SharedOptions{High: 8}, func(e *winEnv) {
			// Slot 0 free, slot 2 idle, slot 3 live: the commit maps a new
			// slot 0, then the idle slot 2.
			x := e.reserve(4)
			require.NoError(t, e.s.Commit(x, 0, 4*e.g))
			require.NoError(t, e.s.Decommit(x, 0, e.g))
			_, err := e.s.Trim(0)
			require.NoError(t, err)
			require.NoError(t, e.s.Decommit(x, 2*e.g, e.g))
			e.reserve(2)
		}, func(e *winEnv) error { return e.s.Commit(e.rs[1], 0, 2*e.g) }, true},
		{"share", host.SharedOptions{}, func(e *winEnv) {
			x := e.reserve(4)
			require.NoError(t, e.s.Commit(x, 0, 2*e.g))
			z := e.reserve(1)
			require.NoError(t, e.s.Commit(z, 0, e.g))
			require.NoError(t, e.s.Commit(x, 2*e.g, 2*e.g))
			e.reserve(4)
		}, func(e *winEnv) error { return e.s.Share(e.rs[2], 0, e.rs[0], 0, 4*e.g, backing.ReadOnly) }, true},
		{"decommit", host.SharedOptions{High: 1}, func(e *winEnv) {
			x := e.reserve(4)
			require.NoError(t, e.s.Commit(x, 0, 4*e.g))
			y := e.reserve(2)
			require.NoError(t, e.s.Share(y, 0, x, 2*e.g, 2*e.g, backing.ReadWrite))
		}, func(e *winEnv) error { return e.s.Decommit(e.rs[0], 0, 4*e.g) }, true},
		{"populate", host.SharedOptions{}, func(e *winEnv) {
			x := e.reserve(2)
			require.NoError(t, e.s.Commit(x, 0, 2*e.g))
			y := e.reserve(2)
			require.NoError(t, e.s.Share(y, 0, x, 0, e.g, backing.ReadOnly))
			require.NoError(t, e.s.Commit(y, e.g, e.g))
		}, func(e *winEnv) error { return e.s.Populate(e.rs[1], 0, 2*e.g) }, true},
		{"protect", host.SharedOptions{}, func(e *winEnv) {
			x := e.reserve(3)
			require.NoError(t, e.s.Commit(x, 0, 3*e.g))
			require.NoError(t, e.s.Protect(x, e.g, e.g, backing.ReadOnly))
		}, func(e *winEnv) error { return e.s.Protect(e.rs[0], 0, 3*e.g, backing.ReadOnly) }, true},
		{"unreserve", host.SharedOptions{High: 8}, func(e *winEnv) {
			x := e.reserve(4)
			require.NoError(t, e.s.Commit(x, 0, 2*e.g))
			require.NoError(t, e.s.Commit(x, 3*e.g, e.g))
		}, func(e *winEnv) error {
			o := e.s.Unreserve(e.rs[0])
			if o.Status == accounting.Quarantined {
				return fmt.Errorf("%w (quarantined: is left)", o.Err)
			}
			return o.Err
		}, false},
		{"prefill", host.SharedOptions{High: 8}, func(e *winEnv) {
			x := e.reserve(1)
			require.NoError(t, e.s.Commit(x, 0, e.g))
			require.NoError(t, e.s.Decommit(x, 0, e.g))
		}, func(e *winEnv) error { return e.s.Prefill(3) }, false},
		{"trim", host.SharedOptions{High: 8}, func(e *winEnv) {
			x := e.reserve(5)
			require.NoError(t, e.s.Commit(x, 0, 5*e.g))
			require.NoError(t, e.s.Decommit(x, 0, e.g))
			require.NoError(t, e.s.Decommit(x, 2*e.g, 2*e.g))
		}, func(e *winEnv) error { _, err := e.s.Trim(0); return err }, false},
	} {
		for _, persistent := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/persistent=%v", tc.name, persistent), func(t *testing.T) {
				calls := -1
				for n := 1; calls < 0; n++ {
					require.Less(t, n, 64, "the operation never got through")
					t.Run(fmt.Sprintf("call=%d", n), func(t *testing.T) {
						e := newWinEnv(t, tc.opts)
						tc.setup(e)
						before := e.snap()
						if persistent {
							e.f.FailFrom(n, errInjected)
						} else {
							e.f.FailAt(n, errInjected)
						}
						err := tc.op(e)
						fired, log := e.f.Fired(), e.f.Log()
						e.f.Reset()
						recorded := err != nil && strings.Contains(err.Error(), "it is recorded read-only")
						e.check(fmt.Sprintf("after %v", log), !recorded)
						if !fired {
							require.NoError(t, err)
							calls = n - 1
							return
						}
						if err == nil {
							return // a failed give-back is no error of the call
						}
						require.ErrorIs(t, err, errInjected, "%v", log)
						if msg := err.Error(); recorded || strings.Contains(msg, " is left ") || strings.Contains(msg, " stay idle in the pool") {
							require.True(t, persistent, "only a failed undo leaves anything: %v", err)
							return
						}
						if tc.atomic {
							assert.Equal(t, before, e.snap(), "a failed %s changed something: %v", tc.name, log)
						}
						if tc.name != "unreserve" || !host.SharedGone(e.rs[0]) {
							require.NoError(t, tc.op(e), "the %s works after the fault", tc.name)
						}
						e.check("after the retry", true)
					})
				}
				require.Positive(t, calls, "no system call to fail")
			})
		}
	}
}

// TestSharedOutOfMemoryWindows: a commit the system refuses for want of commit
// charge (or handles) is backing.ErrOutOfMemory, unwrapping to the Windows error,
// and changes nothing; other failures are not classified.
func TestSharedOutOfMemoryWindows(t *testing.T) {
	for _, tt := range []struct {
		errno windows.Errno
		oom   bool
	}{
		{windows.ERROR_COMMITMENT_LIMIT, true},
		{windows.ERROR_NOT_ENOUGH_MEMORY, true},
		{windows.ERROR_NO_SYSTEM_RESOURCES, true},
		{windows.ERROR_INVALID_ADDRESS, false},
	} {
		t.Run(fmt.Sprintf("errno=%d", uint32(tt.errno)), func(t *testing.T) {
			e := newWinEnv(t, host.SharedOptions{})
			x := e.reserve(2)
			before := e.snap()
			e.f.Fail(func(_ int, name string) bool { return name == "mapFile" }, tt.errno)
			err := e.s.Commit(x, 0, 2*e.g)
			e.f.Reset()
			require.ErrorIs(t, err, tt.errno)
			assert.Equal(t, tt.oom, errors.Is(err, backing.ErrOutOfMemory))
			assert.NotErrorIs(t, err, backing.ErrMapLimit, "Windows has no mapping limit")
			assert.Equal(t, before, e.snap())
			e.check("after the refused commit", true)
		})
	}
}

// TestSharedPlaceholderFaults fails each placeholder call a commit, a decommit and
// an unreserve make, one at a time: a commit that fails midway unmaps the views it
// mapped and closes the sections it made, a failed merge is no error (the
// placeholders stay split, as the record says), an unreserve gets over it, and in
// every case the bookkeeping, the sections and the address space agree and the
// reservation still works.
func TestSharedPlaceholderFaults(t *testing.T) {
	steps := []struct {
		name string
		op   func(e *winEnv, x *host.SharedReservation) error
	}{
		{"commit", func(e *winEnv, x *host.SharedReservation) error { return e.s.Commit(x, e.g, 3*e.g) }},
		{"decommit", func(e *winEnv, x *host.SharedReservation) error { return e.s.Decommit(x, 2*e.g, e.g) }},
		{"unreserve", func(e *winEnv, x *host.SharedReservation) error { return e.s.Unreserve(x).Err }},
	}
	for k, step := range steps {
		for n := 1; ; n++ {
			var calls []string
			fired := false
			ok := t.Run(fmt.Sprintf("%s/call=%d", step.name, n), func(t *testing.T) {
				armed := false
				host.EmulatePlaceholdersUnderWine(t)
				host.FailPlaceholders(t, func(call string) error {
					if !armed {
						return nil
					}
					calls = append(calls, call)
					if len(calls) == n {
						fired = true
						return errInjected
					}
					return nil
				})
				e := newWinEnv(t, host.SharedOptions{})
				x := e.reserve(5)
				for _, prev := range steps[:k] {
					require.NoError(t, prev.op(e, x))
				}
				armed = true
				err := step.op(e, x)
				armed = false
				// NB: Unreserve gets over one failed call: it decommits run by run
				// and releases again.
				if fired && calls[n-1] != "coalesce" && step.name != "unreserve" {
					require.ErrorIs(t, err, errInjected, "%v", calls)
				} else {
					require.NoError(t, err, "%v", calls)
				}
				e.check(fmt.Sprintf("after %v", calls), true)
				if fired && err != nil {
					require.NoError(t, step.op(e, x), "the %s works after the fault", step.name)
					e.check("after the retry", true)
				}
			})
			if !ok || !fired {
				require.Greater(t, n, 1, "%s made no placeholder call", step.name)
				break
			}
		}
	}
}
