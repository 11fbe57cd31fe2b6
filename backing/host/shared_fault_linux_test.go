package host_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

var errInjected = errors.New("injected fault")

// faultFx is the reservations a fault scenario works on, with their ranges, which
// stay known after a quarantine.
type faultFx struct {
	rs    []*host.SharedReservation
	bases []uintptr
	sizes []int
}

func (e *sharedEnv) fx(rs ...*host.SharedReservation) *faultFx {
	x := &faultFx{}
	for _, r := range rs {
		x.add(e, r)
	}
	return x
}

func (x *faultFx) add(e *sharedEnv, r *host.SharedReservation) {
	x.rs = append(x.rs, r)
	x.bases = append(x.bases, e.s.Base(r))
	x.sizes = append(x.sizes, e.s.Size(r))
}

// faultSnap is everything a failed call must leave as it was.
type faultSnap struct {
	owned, mapped int64
	pool          backing.PoolStats
	slots         [][]int
	ro            [][]bool
	priv          [][]bool
	tags          [][]uint64
}

func (e *sharedEnv) snap(x *faultFx) faultSnap {
	e.t.Helper()
	st := e.auth.Stats()
	s := faultSnap{owned: st.Owned, mapped: st.Mapped, pool: e.pool()}
	// The cumulative counters move on a rolled-back step (a charge and its give-back);
	// their difference is in Owned.
	s.pool.Created, s.pool.GivenBack = 0, 0
	for _, r := range x.rs {
		slots, ro := host.SharedSlots(r)
		priv := host.SharedPrivate(r)
		tags := make([]uint64, len(slots))
		for i, sl := range slots {
			if sl >= 0 || priv[i] {
				tags[i] = e.tagOf(r, i)
			}
		}
		s.slots, s.ro, s.tags = append(s.slots, slots), append(s.ro, ro), append(s.tags, tags)
		s.priv = append(s.priv, priv)
	}
	return s
}

// check verifies the bookkeeping, the ledger and the kernel's mappings of every
// reservation of x (quarantined ones included) against each other.
func (e *sharedEnv) check(x *faultFx, what string) {
	e.t.Helper()
	require.NoError(e.t, host.CheckShared(e.s), what)
	require.NoError(e.t, host.SharedFileCheck(e.s), what)
	e.checkPark()
	for k, r := range x.rs {
		if host.SharedGone(r) {
			e.checkGone(x.bases[k], x.sizes[k])
		} else {
			e.checkMaps(r, x.bases[k], x.sizes[k])
		}
	}
}

// tagAll tags every committed granule of r with its slot (a private granule with
// its index), so that a snapshot sees contents.
func (e *sharedEnv) tagAll(r *host.SharedReservation) {
	e.t.Helper()
	slots, ro := host.SharedSlots(r)
	priv := host.SharedPrivate(r)
	for i, sl := range slots {
		switch {
		case ro[i]:
		case sl >= 0:
			e.tag(r, i, tag(sl))
		case priv[i]:
			e.tag(r, i, uint64(1<<32+i))
		}
	}
}

type faultCase struct {
	name   string
	opts   host.SharedOptions
	setup  func(e *sharedEnv) *faultFx
	op     func(e *sharedEnv, x *faultFx) error
	atomic bool // a failed op changes nothing (unless it says it could not undo)
	// once: inject single failures only. NB: Protect can not know the access of a
	// range whose mprotect and restore both failed; it records it read-only, which
	// an injected failure (that changed nothing) leaves read-write in the kernel.
	// TestSharedProtectRestoreFails covers that case.
	once bool
}

func faultCases() []faultCase {
	return []faultCase{
		{
			// Two scattered idle granules and two new ones: a file growth, three
			// mmaps and one populate.
			name: "commit",
			opts: host.SharedOptions{High: 8, Populate: true},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(5)
				e.commit(x, 0, 5)
				e.tagAll(x)
				e.decommit(x, 1, 1)
				e.decommit(x, 3, 1)
				return e.fx(x, e.reserve(4))
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Commit(x.rs[1], 0, 4*e.g) },
			atomic: true,
		},
		{
			// The first commit maps the park, grows the file and moves its
			// granule out of the park.
			name: "first commit",
			setup: func(e *sharedEnv) *faultFx {
				return e.fx(e.reserve(2))
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Commit(x.rs[0], 0, 2*e.g) },
			atomic: true,
		},
		{
			// Chunks of 2, 4, 8 slots: a run of slots 1-6 spans three, so the
			// commit maps a second chunk and moves three runs; the granules
			// parked by the setup come out with their page tables.
			name: "commit across park chunks",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				host.SetSharedParkChunk(e.s, 2)
				x := e.reserve(4)
				e.commit(x, 0, 2)
				e.tagAll(x)
				e.decommit(x, 1, 1) // slot 1 idle, parked
				return e.fx(x, e.reserve(6))
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Commit(x.rs[1], 0, 6*e.g) },
			atomic: true,
		},
		{
			// Slots 0-6 go idle: three parking moves (chunks of 2, 4 and 8
			// slots), one unmap; slot 7 stays shared.
			name: "decommit across park chunks",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				host.SetSharedParkChunk(e.s, 2)
				x := e.reserve(8)
				e.commit(x, 0, 8)
				e.tagAll(x)
				y := e.reserve(1)
				e.share(y, 0, x, 7, 1, backing.ReadWrite)
				return e.fx(x, y)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Decommit(x.rs[0], 0, 8*e.g) },
			atomic: true,
		},
		{
			// Two last mappings go: a read-only one, which goes idle without
			// its page tables, and a read-write one, which is parked.
			name: "decommit read-only",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(2)
				e.commit(x, 0, 2)
				e.tagAll(x)
				y := e.reserve(2)
				e.share(y, 0, x, 0, 1, backing.ReadOnly)
				e.share(y, 1, x, 1, 1, backing.ReadWrite)
				e.decommit(x, 0, 2)
				return e.fx(x, y)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Decommit(x.rs[1], 0, 2*e.g) },
			atomic: true,
		},
		{
			// A source whose slots form two runs: two mmaps.
			name: "share",
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(4)
				e.commit(x, 0, 2)
				z := e.reserve(1)
				e.commit(z, 0, 1)
				e.commit(x, 2, 2)
				e.tagAll(x)
				return e.fx(x, e.reserve(4), z)
			},
			op: func(e *sharedEnv, x *faultFx) error {
				return e.s.Share(x.rs[1], 0, x.rs[0], 0, 4*e.g, backing.ReadOnly)
			},
			atomic: true,
		},
		{
			// Two granules go idle (one kept, one over High punched), two stay
			// shared.
			name: "decommit",
			opts: host.SharedOptions{High: 1},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(4)
				e.commit(x, 0, 4)
				e.tagAll(x)
				y := e.reserve(2)
				e.share(y, 0, x, 2, 2, backing.ReadWrite)
				return e.fx(x, y)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Decommit(x.rs[0], 0, 4*e.g) },
			atomic: true,
		},
		{
			// Four private granules park with one move (memfd granules: one
			// parking move of their run); where it fails, granule by granule.
			name: "decommit a run",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(4)
				e.commit(x, 0, 4)
				e.tagAll(x)
				return e.fx(x)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Decommit(x.rs[0], 0, 4*e.g) },
			atomic: true,
		},
		{
			// Four parked granules in consecutive places come out with one move;
			// where it fails, granule by granule.
			name: "commit a run from the park",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(4)
				e.commit(x, 0, 4)
				e.tagAll(x)
				e.decommit(x, 0, 4)
				return e.fx(x, e.reserve(4))
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Commit(x.rs[1], 0, 4*e.g) },
			atomic: true,
		},
		{
			// A read-only and a read-write span: two populates.
			name: "populate",
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(3)
				e.commit(x, 0, 3)
				e.tagAll(x)
				y := e.reserve(3)
				e.share(y, 0, x, 0, 1, backing.ReadOnly)
				e.commit(y, 1, 2)
				e.tagAll(y)
				return e.fx(x, y)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Populate(x.rs[1], 0, 3*e.g) },
			atomic: true,
		},
		{
			// Granules 0 and 2 read-write, 1 already read-only: one mprotect, and
			// three restores when it fails.
			name: "protect",
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(3)
				e.commit(x, 0, 3)
				e.tagAll(x)
				e.protect(x, 1, 1, backing.ReadOnly)
				return e.fx(x)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Protect(x.rs[0], 0, 3*e.g, backing.ReadOnly) },
			atomic: true,
			once:   true,
		},
		{
			name: "protect read-write",
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(3)
				e.commit(x, 0, 3)
				e.tagAll(x)
				e.protect(x, 0, 2, backing.ReadOnly)
				return e.fx(x)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Protect(x.rs[0], 0, 3*e.g, backing.ReadWrite) },
			atomic: true,
			once:   true,
		},
		{
			// A protected origin goes: granule 0's last mapping is read-only, so it
			// goes idle unparked; granule 1 stays shared read-write in y.
			name: "decommit protected",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(2)
				e.commit(x, 0, 2)
				e.tagAll(x)
				y := e.reserve(1)
				e.share(y, 0, x, 1, 1, backing.ReadWrite)
				e.protect(x, 0, 2, backing.ReadOnly)
				return e.fx(x, y)
			},
			op:     func(e *sharedEnv, x *faultFx) error { return e.s.Decommit(x.rs[0], 0, 2*e.g) },
			atomic: true,
		},
		{
			// Sharing read-only from a protected range (read-write is refused).
			name: "share from protected",
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(2)
				e.commit(x, 0, 2)
				e.tagAll(x)
				e.protect(x, 0, 2, backing.ReadOnly)
				return e.fx(x, e.reserve(2))
			},
			op: func(e *sharedEnv, x *faultFx) error {
				return e.s.Share(x.rs[1], 0, x.rs[0], 0, 2*e.g, backing.ReadOnly)
			},
			atomic: true,
		},
		{
			name: "reserve",
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(1)
				e.commit(x, 0, 1)
				return e.fx(x)
			},
			op: func(e *sharedEnv, x *faultFx) error {
				r, err := e.s.Reserve(2 * e.g)
				if err == nil {
					e.live[r] = true
				}
				return err
			},
			atomic: true,
		},
		{
			// One idle granule to populate and two to create: file growth and
			// fallocate.
			name: "prefill",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(1)
				e.commit(x, 0, 1)
				e.decommit(x, 0, 1)
				return e.fx(x)
			},
			op: func(e *sharedEnv, x *faultFx) error { return e.s.Prefill(3) },
		},
		{
			// Idle granules in two runs: two punches.
			name: "trim",
			opts: host.SharedOptions{High: 8},
			setup: func(e *sharedEnv) *faultFx {
				x := e.reserve(5)
				e.commit(x, 0, 5)
				e.decommit(x, 0, 1)
				e.decommit(x, 2, 2)
				e.tagAll(x)
				return e.fx(x)
			},
			op: func(e *sharedEnv, x *faultFx) error {
				_, err := e.s.Trim(0)
				return err
			},
		},
	}
}

// TestSharedFaults injects a failure at every system call of each operation in turn,
// once (FailAt) and from there on (FailFrom, so that undoing fails too), and checks
// after each that the bookkeeping, the authority and the kernel's mappings agree, that
// an operation that failed changed nothing (or says what it could not undo), and that
// the reservations still work. It runs in each of sharedModes: 64 KiB memfd granules,
// 64 KiB private granules of small pages, and 2 MiB private huge pages.
func TestSharedFaults(t *testing.T) {
	forModes(t, func(t *testing.T, m sharedMode) {
		opts := func(o host.SharedOptions) host.SharedOptions {
			if m.huge == "" {
				o.Granularity = kib64
			}
			return m.opts(o)
		}
		m.check(t, opts(host.SharedOptions{}))
		testSharedFaults(t, opts)
	})
}

func testSharedFaults(t *testing.T, modeOpts func(host.SharedOptions) host.SharedOptions) {
	for _, tc := range faultCases() {
		for _, persistent := range []bool{false, true} {
			mode := "once"
			if persistent {
				mode = "from"
			}
			if persistent && tc.once {
				continue
			}
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				calls := -1
				for n := 1; calls < 0; n++ {
					// NB: a 2 MiB granule's prefill alone populates in 32 pieces.
					require.Less(t, n, 256, "the operation never got through")
					t.Run(fmt.Sprintf("call=%d", n), func(t *testing.T) {
						e := newEnv(t, modeOpts(tc.opts), true)
						x := tc.setup(e)
						before := e.snap(x)
						if persistent {
							e.f.FailFrom(n, errInjected)
						} else {
							e.f.FailAt(n, errInjected)
						}
						err := tc.op(e, x)
						fired, log := e.f.Fired(), e.f.Log()
						e.f.Reset()
						e.check(x, fmt.Sprintf("after %v", log))
						if !fired {
							require.NoError(t, err)
							calls = n - 1
							t.Logf("%s: %v", tc.name, log)
							return
						}
						if err == nil {
							return // a failed give-back is no error of the call; check() covered it
						}
						require.ErrorIs(t, err, errInjected, "%v", log)
						if msg := err.Error(); strings.Contains(msg, " is left ") || strings.Contains(msg, " stay idle in the pool") {
							require.True(t, persistent, "only a failed undo leaves anything: %v", err)
							return
						}
						if tc.atomic {
							assert.Equal(t, before, e.snap(x), "a failed %s changed something: %v", tc.name, log)
						}
						require.NoError(t, tc.op(e, x), "the %s works after the fault", tc.name)
						e.check(x, "after the retry")
					})
				}
				require.Positive(t, calls, "no system call to fail")
			})
		}
	}
}

// TestSharedUnreserveOutcomes proves each outcome of Unreserve through the syscall
// seam. The reservation has two committed runs (granules 0-1 and 3) and a granule
// shared elsewhere.
func TestSharedUnreserveOutcomes(t *testing.T) {
	for _, tt := range []struct {
		name               string
		fail               func() func(i int, name string) bool
		status             accounting.ReleaseStatus
		unmapped, residual int // granules
	}{
		{"complete", nth(""), accounting.Complete, 3, 0},
		// Parking the granule that goes idle fails: it goes idle without its page
		// tables.
		{"park fails", nth("move", 1), accounting.Complete, 3, 0},
		// munmap fails once: decommitting run by run and munmap again succeed.
		{"recovered", nth("release", 1), accounting.Complete, 3, 0},
		// A punch fails after the unmap: the granule stays idle; still Complete.
		{"punch fails", nth("punch", 1), accounting.Complete, 3, 0},
		// munmap and the first decommit fail: nothing changed.
		{"failed", func() func(int, string) bool { return func(int, string) bool { return true } }, accounting.Failed, 0, 3},
		// The first run decommits, the second does not.
		{"quarantined, residual", nth("release|unmapTo", 1, 3, 4, 5), accounting.Quarantined, 2, 1},
		// Everything decommits but the range can not be unmapped.
		{"quarantined, no residual", nth("release", 1, 2), accounting.Quarantined, 3, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64, High: 1}), true)
			g := int64(e.g)
			x := e.reserve(4)
			e.commit(x, 0, 2)
			e.commit(x, 3, 1)
			e.tagAll(x)
			y := e.reserve(1)
			e.share(y, 0, x, 1, 1, backing.ReadOnly)
			fx := e.fx(x, y)
			before := e.snap(fx)

			e.f.Fail(tt.fail(), errInjected)
			o := e.s.Unreserve(x)
			log := e.f.Log()
			e.f.Reset()
			t.Logf("%v: %v", o, log)
			e.check(fx, "after Unreserve")
			assert.Equal(t, tt.status, o.Status, "%v", log)
			assert.Equal(t, int64(tt.unmapped)*g, o.Unmapped, "unmapped")
			assert.Equal(t, int64(tt.residual)*g, o.Residual, "residual")
			assert.Equal(t, tag(1), e.tagOf(y, 0), "the shared granule lives on in y")
			if c := e.gov.Stats(accounting.HostKey).Counters; tt.status == accounting.Quarantined {
				assert.Equal(t, [2]int64{1, o.Residual}, [2]int64{c.Quarantines, c.QuarantinedBytes}, "the quarantine reported to the governor")
			} else {
				assert.Zero(t, c.Quarantines, "no quarantine reported")
			}
			switch tt.status {
			case accounting.Complete:
				assert.NoError(t, o.Err)
				delete(e.live, x)
				e.checkGone(fx.bases[0], fx.sizes[0])
				assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { _ = e.s.Commit(x, 0, e.g) })
			case accounting.Failed:
				assert.ErrorIs(t, o.Err, errInjected)
				assert.Equal(t, before, e.snap(fx), "a Failed unreserve changed nothing")
				e.commit(x, 2, 1) // still usable
				o = e.unreserve(x)
				assert.Equal(t, 4*g, o.Unmapped)
			case accounting.Quarantined:
				assert.ErrorIs(t, o.Err, errInjected)
				delete(e.live, x)
				assert.True(t, host.SharedQuarantined(x))
				assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { _ = e.s.Commit(x, 0, e.g) })
				// The residual stays owned and mapped: it is still there.
				st := e.auth.Stats()
				assert.Equal(t, o.Residual+g, st.Mapped, "residual and y's mapping")
				e.unreserve(y)
				require.NoError(t, host.CheckShared(e.s))
				require.NoError(t, e.s.Close(), "Close works with a quarantined reservation")
				st = e.auth.Stats()
				assert.Equal(t, o.Residual, st.Owned, "only the residual is still owned after Close")
				assert.Equal(t, o.Residual, st.Mapped)
				e.closed = true
			}
		})
	}
}

func tag(slot int) uint64 { return uint64(1000 + slot) }

// nth returns a fault predicate maker that fails the given calls (counted from 1)
// among those named in names ("a|b"); with no calls, none.
func nth(names string, calls ...int) func() func(i int, name string) bool {
	return func() func(int, string) bool {
		seen := 0
		return func(_ int, name string) bool {
			if !slices.Contains(strings.Split(names, "|"), name) {
				return false
			}
			seen++
			return slices.Contains(calls, seen)
		}
	}
}

// TestSharedCloseParkFails: when the park can not be unmapped at Close, it would keep
// the file's pages alive, so Close punches the idle granules out itself: the
// authority still ends with nothing owned, and Close says what failed.
func TestSharedCloseParkFails(t *testing.T) {
	e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64, High: 4}), true)
	x := e.reserve(3)
	e.commit(x, 0, 3)
	e.tagAll(x)
	e.unreserve(x)
	require.Equal(t, int64(3*e.g), e.pool().Idle)
	e.f.Fail(func(_ int, name string) bool { return name == "release" }, errInjected)
	err := e.s.Close()
	log := e.f.Log()
	e.f.Reset()
	e.closed = true
	require.ErrorIs(t, err, errInjected, "%v", log)
	assert.Contains(t, log, "punch", "the idle granules were punched out")
	st := e.auth.Stats()
	assert.Zero(t, st.Owned, "nothing stays owned")
	assert.Zero(t, st.Mapped)
	assert.Zero(t, e.pool().Idle)
}
