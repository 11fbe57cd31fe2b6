package host_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

// forPrivate runs test in each mode that makes new granules private (2 MiB
// granules): small pages, and huge pages where the system gives them (the mode
// skips otherwise).
func forPrivate(t *testing.T, test func(t *testing.T, m sharedMode)) {
	for _, m := range sharedModes {
		if m.priv {
			t.Run(m.name, func(t *testing.T) { test(t, m) })
		}
	}
}

// privateEnv returns a backing in mode m that makes new granules private.
func privateEnv(t *testing.T, m sharedMode, opts host.SharedOptions) *sharedEnv {
	t.Helper()
	return m.env(t, opts, false)
}

// checkHuge checks what the kernel gave x: huge pages where m asks for them (some
// at least: a fragmented machine may give fewer), none where it asks for small
// pages, though THP be "always".
func checkHuge(t *testing.T, e *sharedEnv, m sharedMode, x *host.SharedReservation, committed int) {
	t.Helper()
	hb, err := e.s.HugePages(x)
	require.NoError(t, err)
	if m.huge == "" {
		assert.Zero(t, hb.Anon, "small pages, as the stats say")
		return
	}
	assert.Positive(t, hb.Anon, "no private granule got a huge page")
	assert.LessOrEqual(t, hb.Anon, int64(committed))
	t.Logf("%d of %d bytes in huge pages", hb.Anon, committed)
}

func TestSharedStats(t *testing.T) {
	e := newEnv(t, host.SharedOptions{NoHugePages: true}, false)
	st := e.s.Stats()
	assert.Empty(t, st.HugePages)
	assert.Contains(t, st.NoHugePages, "NoHugePages")
	assert.True(t, st.PrivateGranules, "small pages, private granules: %+v", st)
	assert.Empty(t, st.NoPrivateGranules)
	e = newEnv(t, host.SharedOptions{Granularity: kib64}, false)
	st = e.s.Stats()
	assert.Empty(t, st.HugePages, "a 64 KiB granule can not be a huge page")
	assert.NotEmpty(t, st.NoHugePages, "the fallback says why")
	assert.True(t, st.PrivateGranules, "private granules of any size")
	t.Logf("64 KiB granules: %s", st.NoHugePages)
	e = newEnv(t, host.SharedOptions{}, false)
	st = e.s.Stats()
	t.Logf("2 MiB granules: %q (%s), private %v (%s)", st.HugePages, st.NoHugePages, st.PrivateGranules, st.NoPrivateGranules)
	assert.Equal(t, st.HugePages == "", st.NoHugePages != "")
	assert.Equal(t, st.HugePages != "shmem", st.PrivateGranules, "private granules unless memfd huge pages")
	assert.Equal(t, st.PrivateGranules, st.NoPrivateGranules == "")
	always := newEnv(t, host.SharedOptions{AlwaysHugePages: true}, false).s.Stats()
	t.Logf("2 MiB granules, AlwaysHugePages: %q (%s)", always.HugePages, always.NoHugePages)
	if always.HugePages != "" && st.HugePages == "" {
		assert.Contains(t, st.NoHugePages, "reports free", "only a reporting guest turns them off by default")
	}

	// Memfd granules from the start: the option says so, and anonymous huge pages,
	// which only private granules have, are off with them.
	memfd := newEnv(t, host.SharedOptions{NoPrivateGranules: true, AlwaysHugePages: true}, false).s.Stats()
	t.Logf("2 MiB granules, NoPrivateGranules: %q (%s), private %v (%s)", memfd.HugePages, memfd.NoHugePages,
		memfd.PrivateGranules, memfd.NoPrivateGranules)
	assert.False(t, memfd.PrivateGranules)
	assert.Contains(t, memfd.NoPrivateGranules, "NoPrivateGranules")
	assert.NotEqual(t, "private", memfd.HugePages)
	if always.HugePages == "private" {
		assert.Empty(t, memfd.HugePages, "no shmem huge pages here")
		assert.Contains(t, memfd.NoHugePages, "need private granules")
	}
}

// TestSharedPrivatePark follows private granules through their life: new ones in
// huge pages, parked on decommit with their pages (so a commit elsewhere takes them
// with their contents and page tables, and no new bytes), moved into the memfd on
// Share with the source's base and contents kept, and owned once after.
func TestSharedPrivatePark(t *testing.T) { forPrivate(t, testSharedPrivatePark) }

func testSharedPrivatePark(t *testing.T, m sharedMode) {
	e := privateEnv(t, m, host.SharedOptions{High: 4})
	g := e.g
	pages := g / os.Getpagesize()
	x := e.reserve(2)
	base := e.s.Base(x)
	e.commit(x, 0, 2)
	assert.Equal(t, int64(2*g), e.s.Stats().Private)
	slots, _ := host.SharedSlots(x)
	assert.Equal(t, []int{-1, -1}, slots, "new granules are private")
	require.NoError(t, e.s.CopyIn(x, 0, bytes.Repeat([]byte{7}, 2*g)))
	checkHuge(t, e, m, x, 2*g)
	e.tag(x, 1, 42)

	e.decommit(x, 0, 2)
	p := e.pool()
	assert.Equal(t, int64(2*g), p.Idle, "decommitted private granules wait in the pool")
	assert.Equal(t, int64(2*g), p.Owned)
	assert.Zero(t, p.Mapped)
	assert.Zero(t, e.s.Stats().Private)
	assert.Zero(t, present(t, base, 2*g), "nothing is left in the reservation")

	y := e.reserve(2)
	ybase := e.s.Base(y)
	e.commit(y, 0, 2)
	assert.Equal(t, int64(2*g), e.pool().Owned, "the commit took the parked granules: no new bytes")
	assert.Equal(t, 2*pages, present(t, ybase, 2*g), "with their page tables")
	tags := []uint64{e.tagOf(y, 0), e.tagOf(y, 1)}
	assert.Contains(t, tags, uint64(42), "and their contents")
	e.checkMaps(y, ybase, 2*g)

	// Share moves the source's granule into the memfd, in place.
	e.tag(y, 0, 99)
	z := e.reserve(1)
	e.share(z, 0, y, 0, 1, backing.ReadOnly)
	assert.Equal(t, ybase, e.s.Base(y), "the source keeps its base")
	assert.Equal(t, uint64(99), e.tagOf(y, 0), "and its contents")
	assert.Equal(t, uint64(99), e.tagOf(z, 0), "which the sharer reads")
	ys, _ := host.SharedSlots(y)
	zs, _ := host.SharedSlots(z)
	assert.GreaterOrEqual(t, ys[0], 0, "the shared granule is a memfd granule now")
	assert.Equal(t, ys[0], zs[0])
	assert.Equal(t, -1, ys[1], "the other stays private")
	st := e.s.Stats()
	assert.Equal(t, int64(1), st.Adopted)
	assert.Equal(t, int64(g), st.Private)
	assert.Equal(t, int64(2*g), e.pool().Owned, "owned once")
	assert.Equal(t, int64(3*g), e.pool().Mapped)
	e.tag(y, 0, 100)
	assert.Equal(t, uint64(100), e.tagOf(z, 0), "one physical granule")
	e.checkMaps(y, ybase, 2*g)
	e.checkMaps(z, e.s.Base(z), g)
	require.NoError(t, host.CheckShared(e.s))

	n, err := e.s.Trim(0)
	require.NoError(t, err)
	assert.Zero(t, n, "nothing idle")
	e.unreserve(z)
	e.unreserve(y)
	assert.Equal(t, int64(2*g), e.pool().Idle, "both went idle: one parked private, one memfd")
	n, err = e.s.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(2*g), n)
	assert.Zero(t, e.pool().Owned)
	e.unreserve(x)
}

// TestSharedPrivateShareBudget: while a private granule is copied into the memfd,
// both hold memory, so a full budget refuses the Share and nothing changes.
func TestSharedPrivateShareBudget(t *testing.T) { forPrivate(t, testSharedPrivateShareBudget) }

func testSharedPrivateShareBudget(t *testing.T, m sharedMode) {
	e := privateEnv(t, m, host.SharedOptions{High: host.SharedNoPool})
	g := e.g
	require.NoError(t, e.gov.SetLimit(e.auth.Device(), int64(g)))
	x := e.reserve(1)
	y := e.reserve(1)
	e.commit(x, 0, 1)
	e.tag(x, 0, 3)
	err := e.s.Share(y, 0, x, 0, g, backing.ReadOnly)
	require.Error(t, err)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Equal(t, uint64(3), e.tagOf(x, 0))
	assert.Equal(t, int64(g), e.s.Stats().Private)
	require.NoError(t, host.CheckShared(e.s))
	require.NoError(t, e.gov.SetLimit(e.auth.Device(), int64(2*g)))
	e.share(y, 0, x, 0, 1, backing.ReadWrite)
	assert.Equal(t, uint64(3), e.tagOf(y, 0))
	assert.Equal(t, int64(g), e.pool().Owned, "the private granule's bytes went with it")
}

// TestSharedPrivatePrefill: Prefill and the Low refill make private granules,
// populated in the private park, which a commit takes with their pages.
func TestSharedPrivatePrefill(t *testing.T) { forPrivate(t, testSharedPrivatePrefill) }

func testSharedPrivatePrefill(t *testing.T, m sharedMode) {
	e := privateEnv(t, m, host.SharedOptions{High: 4})
	g := e.g
	require.NoError(t, e.s.Prefill(3))
	p := e.pool()
	assert.Equal(t, int64(3*g), p.Idle)
	assert.Equal(t, int64(3*g), p.Resident)
	assert.Equal(t, int64(3*g), p.Owned)
	require.NoError(t, host.CheckShared(e.s))
	require.NoError(t, e.s.Prefill(6), "beyond the private park: memfd granules")
	assert.Equal(t, int64(6*g), e.pool().Idle)
	x := e.reserve(3)
	e.commit(x, 0, 3)
	assert.Equal(t, int64(6*g), e.pool().Owned, "no new bytes")
	assert.Equal(t, 3*g/os.Getpagesize(), present(t, e.s.Base(x), 3*g), "the pages came along")
	assert.Equal(t, []bool{true, true, true}, host.SharedPrivate(x), "private granules first")
	checkHuge(t, e, m, x, 3*g)
	e.unreserve(x)
	_, err := e.s.Trim(0)
	require.NoError(t, err)
	assert.Zero(t, e.pool().Owned)
}

// TestSharedPrivateProtected: a protected private granule stays protected when Share
// moves it into the memfd, and is not parked when decommitted (the park holds
// writable granules).
func TestSharedPrivateProtected(t *testing.T) { forPrivate(t, testSharedPrivateProtected) }

func testSharedPrivateProtected(t *testing.T, m sharedMode) {
	e := privateEnv(t, m, host.SharedOptions{High: 4})
	g := e.g
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.tag(x, 0, 8)
	require.NoError(t, e.s.Protect(x, 0, 2*g, backing.ReadOnly))
	y := e.reserve(1)
	e.share(y, 0, x, 0, 1, backing.ReadOnly)
	xs, ro := host.SharedSlots(x)
	assert.GreaterOrEqual(t, xs[0], 0, "moved into the memfd")
	assert.Equal(t, []bool{true, true}, ro, "and still read-only")
	assert.ErrorIs(t, e.s.CopyIn(x, 0, []byte{1}), backing.ErrReadOnly)
	assert.Equal(t, uint64(8), e.tagOf(y, 0))
	e.checkMaps(x, e.s.Base(x), 2*g)
	e.decommit(x, 1, 1)
	assert.Zero(t, e.pool().Idle, "a protected private granule is not parked")
	require.NoError(t, host.CheckShared(e.s))
}

func TestSharedHugePagesBadInput(t *testing.T) {
	e := newEnv(t, host.SharedOptions{}, false)
	other := newEnv(t, host.SharedOptions{}, false)
	r := other.reserve(1)
	_, err := e.s.HugePages(r)
	assert.ErrorIs(t, err, backing.ErrForeignReservation)
	_, err = e.s.HugePages(nil)
	assert.ErrorIs(t, err, backing.ErrForeignReservation)
	other.unreserve(r)
	assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { _, _ = other.s.HugePages(r) })
	empty, err := e.s.Reserve(0)
	require.NoError(t, err)
	hb, err := e.s.HugePages(empty)
	require.NoError(t, err)
	assert.Zero(t, hb)
	require.True(t, e.s.Unreserve(empty).OK())
}

// TestSharedPrivateOwnedOnceByPss: a private granule shared into 16 reservations is
// resident once: the kernel's proportional set size of all 17 mappings is one
// granule.
func TestSharedPrivateOwnedOnceByPss(t *testing.T) { forPrivate(t, testSharedPrivateOwnedOnceByPss) }

func testSharedPrivateOwnedOnceByPss(t *testing.T, m sharedMode) {
	const n = 16
	e := privateEnv(t, m, host.SharedOptions{})
	g := e.g
	rs := []*host.SharedReservation{e.reserve(1)}
	e.commit(rs[0], 0, 1)
	fill := bytes.Repeat([]byte{0x5A}, g)
	require.NoError(t, e.s.CopyIn(rs[0], 0, fill))
	for range n {
		r := e.reserve(1)
		e.share(r, 0, rs[0], 0, 1, backing.ReadOnly)
		rs = append(rs, r)
	}
	buf := make([]byte, g)
	for i, r := range rs {
		require.NoError(t, e.s.CopyOut(buf, r, 0))
		require.True(t, bytes.Equal(fill, buf), "reservation %d reads the granule", i)
	}
	assert.Equal(t, int64(g), e.auth.Stats().Owned, "owned once")
	assert.Equal(t, int64((n+1)*g), e.auth.Stats().Mapped)
	rss, pss := smaps(t, rs, e.s)
	t.Logf("%d mappings of one adopted granule: Rss %d KiB, Pss %d KiB", n+1, rss>>10, pss>>10)
	assert.GreaterOrEqual(t, pss, int64(g)*95/100, "Pss: the granule is resident once")
	assert.LessOrEqual(t, pss, int64(g)*110/100, "Pss: about one granule, not %d", n+1)
}

// TestSharedPrivateFaults: a decommit whose unmap fails after the private granules
// were parked moves them back, contents and all; a commit that fails after taking
// parked granules parks them again: either way the pool and the reservation are as
// they were.
func TestSharedPrivateFaults(t *testing.T) { forPrivate(t, testSharedPrivateFaults) }

func testSharedPrivateFaults(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{High: 8}, true)
	g := e.g
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.tag(x, 0, 11)
	e.tag(x, 1, 12)
	injected := errors.New("injected")
	e.f.Fail(func(_ int, name string) bool { return name == "discard" }, injected)
	require.ErrorIs(t, e.s.Decommit(x, 0, 2*g), injected)
	e.f.Reset()
	assert.Equal(t, []bool{true, true}, host.SharedPrivate(x), "moved back")
	assert.Equal(t, uint64(11), e.tagOf(x, 0), "with their contents")
	assert.Equal(t, uint64(12), e.tagOf(x, 1))
	assert.Zero(t, e.pool().Idle)
	require.NoError(t, host.CheckShared(e.s))
	e.checkMaps(x, e.s.Base(x), 2*g)

	e.decommit(x, 0, 2) // both parked
	require.Equal(t, int64(2*g), e.pool().Idle)
	y := e.reserve(3) // two parked granules and a new one: the new one's protect fails
	e.f.Fail(func(_ int, name string) bool { return name == "protect" }, injected)
	require.ErrorIs(t, e.s.Commit(y, 0, 3*g), injected)
	e.f.Reset()
	p := e.pool()
	assert.Equal(t, int64(2*g), p.Idle, "the parked granules are parked again")
	assert.Equal(t, int64(2*g), p.Owned)
	assert.Zero(t, p.Mapped)
	require.NoError(t, host.CheckShared(e.s))
	e.checkMaps(y, e.s.Base(y), 3*g)
	e.commit(y, 0, 3)
	assert.Equal(t, int64(3*g), e.pool().Owned)
}

// TestSharedPrivateShareUndo: a Share whose mapping fails after the source's private
// granules moved into the memfd moves them back, private, with their contents and
// their access; where moving one back fails too, it stays in the memfd, recorded
// as it is, and the error says so.
func TestSharedPrivateShareUndo(t *testing.T) { forPrivate(t, testSharedPrivateShareUndo) }

func testSharedPrivateShareUndo(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{High: 8}, true)
	g := e.g
	x := e.reserve(2)
	y := e.reserve(2)
	e.commit(x, 0, 2)
	e.tag(x, 0, 21)
	e.tag(x, 1, 22)
	e.protect(x, 1, 1, backing.ReadOnly)
	owned := e.pool().Owned
	injected := errors.New("injected")

	// The sharer's mmap fails: both granules come back.
	e.f.Fail(nthCall("mapFile", 1), injected)
	err := e.s.Share(y, 0, x, 0, 2*g, backing.ReadOnly)
	log := e.f.Log()
	e.f.Reset()
	require.ErrorIs(t, err, injected, "%v", log)
	assert.NotContains(t, err.Error(), "is left", "everything was undone: %v", log)
	assert.Equal(t, []bool{true, true}, host.SharedPrivate(x), "private again: %v", log)
	_, ro := host.SharedSlots(x)
	assert.Equal(t, []bool{false, true}, ro, "with their access")
	assert.Equal(t, uint64(21), e.tagOf(x, 0))
	assert.Equal(t, uint64(22), e.tagOf(x, 1))
	assert.Zero(t, e.s.Stats().Adopted)
	assert.Equal(t, owned, e.pool().Owned)
	assert.Zero(t, e.pool().Idle, "the new memfd granules went back to the OS")
	require.NoError(t, host.CheckShared(e.s))
	e.checkMaps(x, e.s.Base(x), 2*g)

	// And the move back of the first fails as well: it stays in the memfd. (The
	// calls: the park's mapping, each granule's move into the memfd, one at a
	// time, the sharer's mmap, the first's move back.)
	e.f.Fail(nthCall("mapFile|move", 4, 5), injected)
	err = e.s.Share(y, 0, x, 0, 2*g, backing.ReadOnly)
	log = e.f.Log()
	e.f.Reset()
	require.ErrorIs(t, err, injected, "%v", log)
	assert.Contains(t, err.Error(), "granule at 0x0 is left in the memfd", "%v", log)
	assert.Equal(t, []bool{false, true}, host.SharedPrivate(x), "%v", log)
	assert.Equal(t, uint64(21), e.tagOf(x, 0))
	assert.Equal(t, uint64(22), e.tagOf(x, 1))
	require.NoError(t, host.CheckShared(e.s))
	e.checkMaps(x, e.s.Base(x), 2*g)
	e.checkMaps(y, e.s.Base(y), 2*g)

	e.share(y, 0, x, 0, 2, backing.ReadOnly)
	assert.Equal(t, uint64(22), e.tagOf(y, 1), "it works after")
}

// nthCall fails the calls named in names ("a|b") that come n-th among them.
func nthCall(names string, n ...int) func(int, string) bool { return nth(names, n...)() }

// TestSharedShareWaitsForAdoption: two Shares of one private granule at once. The
// second starts while the first copies the granule into the memfd outside the lock
// (the hook runs it just before the first allocates the memfd granule); it waits
// for the first, then maps the memfd granule: moved once, owned once, three
// mappings of one physical granule.
func TestSharedShareWaitsForAdoption(t *testing.T) { forPrivate(t, testSharedShareWaitsForAdoption) }

func testSharedShareWaitsForAdoption(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{High: host.SharedNoPool}, true) // no idle memfd granule: the move allocates one
	g := e.g
	x := e.reserve(1)
	e.commit(x, 0, 1)
	e.tag(x, 0, 42)
	y, z := e.reserve(1), e.reserve(1)
	waiting := make(chan struct{}, 1)
	host.SetSharedAdoptWait(e.s, func() {
		select {
		case waiting <- struct{}{}:
		default:
		}
	})
	second := make(chan error, 1)
	var once sync.Once
	e.f.Before(func(name string) {
		if name != "allocate" {
			return
		}
		once.Do(func() {
			go func() { second <- e.s.Share(z, 0, x, 0, g, backing.ReadOnly) }()
			select {
			case <-waiting:
			case <-time.After(10 * time.Second):
				t.Error("the second Share did not wait for the first's move into the memfd")
			}
		})
	})
	require.NoError(t, e.s.Share(y, 0, x, 0, g, backing.ReadOnly))
	require.NoError(t, <-second)
	e.f.Reset()
	assert.Equal(t, int64(1), e.s.Stats().Adopted, "moved once")
	assert.Zero(t, e.s.Stats().Private)
	xs, _ := host.SharedSlots(x)
	ys, _ := host.SharedSlots(y)
	zs, _ := host.SharedSlots(z)
	require.GreaterOrEqual(t, xs[0], 0)
	assert.Equal(t, xs, ys)
	assert.Equal(t, xs, zs)
	assert.Equal(t, 3, host.SharedRefs(e.s, xs[0]))
	assert.Equal(t, int64(g), e.pool().Owned, "owned once")
	assert.Equal(t, int64(3*g), e.pool().Mapped)
	for _, r := range []*host.SharedReservation{x, y, z} {
		assert.Equal(t, uint64(42), e.tagOf(r, 0))
	}
	require.NoError(t, host.CheckShared(e.s))
}

// TestSharedPrivateSmallRefusesHuge: where THP is "always" (forced here, whatever
// the system's mode), private granules of small pages refuse huge pages on every
// new anonymous memory they map: a commit's new granules and a prefill's; where it
// is not, they advise nothing. Either way the kernel gives them no huge page.
func TestSharedPrivateSmallRefusesHuge(t *testing.T) {
	for _, always := range []bool{false, true} {
		t.Run(fmt.Sprintf("always=%v", always), func(t *testing.T) {
			m := modeNamed(t, "private")
			e := m.env(t, host.SharedOptions{High: 4}, true)
			host.SetSharedSmallTHP(e.s, always)
			e.f.Fail(func(int, string) bool { return false }, nil) // log the calls
			x := e.reserve(2)
			e.commit(x, 0, 2)
			require.NoError(t, e.s.CopyIn(x, 0, make([]byte, 2*e.g)))
			commit := e.f.Log()
			e.f.Fail(func(int, string) bool { return false }, nil)
			require.NoError(t, e.s.Prefill(1))
			prefill := e.f.Log()
			e.f.Reset()
			if always {
				assert.Contains(t, commit, "advise", "the commit refuses huge pages")
				assert.Contains(t, prefill, "advise", "the prefill refuses huge pages")
			} else {
				assert.NotContains(t, commit, "advise")
				assert.NotContains(t, prefill, "advise")
			}
			assert.Zero(t, e.s.Stats().HugeRefused)
			if always || host.HugeAnonMode() == "always" {
				assert.Contains(t, vmFlags(t, e.s.Base(x)), "nh", "the kernel has the refusal")
			} else {
				assert.NotContains(t, vmFlags(t, e.s.Base(x)), "nh")
			}
			checkHuge(t, e, m, x, 2*e.g)
		})
	}
}

// TestSharedPrivatePrefillNoPool: a pool that keeps no idle granule (SharedNoPool)
// has no private park, so Prefill makes memfd granules, whatever the granule size:
// the private park of High = 0 granules is no address space at all (an mmap of no
// bytes fails), not an error of Prefill.
func TestSharedPrivatePrefillNoPool(t *testing.T) {
	for _, g := range []int{kib64, 2 << 20} {
		t.Run(fmt.Sprintf("granule=%dKiB", g>>10), func(t *testing.T) {
			e := modeNamed(t, "private").env(t, host.SharedOptions{Granularity: g, High: host.SharedNoPool}, false)
			require.NoError(t, e.s.Prefill(2))
			p := e.pool()
			assert.Equal(t, int64(2*g), p.Idle)
			assert.Equal(t, int64(2*g), p.Resident)
			assert.Equal(t, int64(2*g), p.Owned)
			require.NoError(t, host.CheckShared(e.s))
			x := e.reserve(3)
			e.commit(x, 0, 3)
			assert.Equal(t, int64(3*g), e.pool().Owned, "the prefilled granules, and one new")
			assert.Zero(t, e.pool().Idle)
			require.NoError(t, host.CheckShared(e.s))
			e.unreserve(x)
			assert.Zero(t, e.pool().Owned, "no pool: every granule goes back")
		})
	}
}

// TestSharedProtectDuringAdoption: a Protect of a private granule while a Share
// moves it into the memfd (outside the lock: the hook runs it just before the move
// allocates the memfd granule) is not undone by the move, either way: the granule
// ends with the access the last Protect gave it, in the bookkeeping and in the
// kernel's mapping. (kv protects an origin's granules under a lock that a ForkAt's
// Share of them does not take.)
func TestSharedProtectDuringAdoption(t *testing.T) { forPrivate(t, testSharedProtectDuringAdoption) }

func testSharedProtectDuringAdoption(t *testing.T, m sharedMode) {
	for _, prot := range []backing.Protection{backing.ReadOnly, backing.ReadWrite} {
		t.Run(fmt.Sprintf("to=%v", prot), func(t *testing.T) {
			e := m.env(t, host.SharedOptions{High: host.SharedNoPool}, true) // the move allocates a new memfd granule
			g := e.g
			x := e.reserve(1)
			e.commit(x, 0, 1)
			e.tag(x, 0, 7)
			if prot == backing.ReadWrite {
				e.protect(x, 0, 1, backing.ReadOnly)
			}
			y := e.reserve(1)
			var once sync.Once
			e.f.Before(func(name string) {
				if name == "allocate" {
					once.Do(func() { assert.NoError(t, e.s.Protect(x, 0, g, prot)) })
				}
			})
			e.share(y, 0, x, 0, 1, backing.ReadOnly)
			e.f.Reset()
			xs, ro := host.SharedSlots(x)
			require.GreaterOrEqual(t, xs[0], 0, "moved into the memfd")
			assert.Equal(t, []bool{prot == backing.ReadOnly}, ro, "the Protect made during the move holds")
			err := e.s.CopyIn(x, 8, []byte{1})
			if prot == backing.ReadOnly {
				assert.ErrorIs(t, err, backing.ErrReadOnly)
			} else {
				assert.NoError(t, err)
			}
			assert.Equal(t, uint64(7), e.tagOf(y, 0))
			e.checkMaps(x, e.s.Base(x), g)
			require.NoError(t, host.CheckShared(e.s))
		})
	}
}

// TestSharedUnreservePrivateOutcomes: Unreserve first parks the private granules
// the pool keeps; when the munmap then fails, the outcome is as honest as with
// memfd granules alone. Failed (every unmap fails; the moves work) changed nothing:
// the private granules are back in the reservation, contents and all. Quarantined
// with everything decommitted counts every granule as unmapped and none as
// residual. The reservation has three private granules (0, 2, 3) and one memfd
// granule shared elsewhere (1).
func TestSharedUnreservePrivateOutcomes(t *testing.T) {
	for _, failed := range []bool{true, false} {
		name := "quarantined"
		fail := func(_ int, name string) bool { return name == "release" }
		if failed {
			name = "failed"
			fail = func(_ int, name string) bool { return name == "release" || name == "unmapTo" }
		}
		t.Run(name, func(t *testing.T) {
			e := modeNamed(t, "private").env(t, host.SharedOptions{Granularity: kib64, High: 4}, true)
			g := int64(e.g)
			x := e.reserve(4)
			e.commit(x, 0, 4)
			y := e.reserve(1)
			e.share(y, 0, x, 1, 1, backing.ReadOnly)
			e.tagAll(x)
			require.Equal(t, []bool{true, false, true, true}, host.SharedPrivate(x))
			fx := e.fx(x, y)
			before := e.snap(fx)

			e.f.Fail(fail, errInjected)
			o := e.s.Unreserve(x)
			log := e.f.Log()
			e.f.Reset()
			t.Logf("%v: %v", o, log)
			require.Contains(t, log, "move", "the private granules were parked first")
			e.check(fx, "after Unreserve")
			require.ErrorIs(t, o.Err, errInjected)
			if failed {
				require.Equal(t, accounting.Failed, o.Status)
				assert.Equal(t, before, e.snap(fx), "a Failed unreserve changed nothing")
				e.decommit(x, 3, 1) // still usable
				e.commit(x, 3, 1)
				o = e.unreserve(x)
				assert.Equal(t, 4*g, o.Unmapped)
				return
			}
			require.Equal(t, accounting.Quarantined, o.Status)
			assert.Equal(t, 4*g, o.Unmapped, "every granule decommitted")
			assert.Zero(t, o.Residual, "nothing left mapped")
			c := e.gov.Stats(accounting.HostKey).Counters
			assert.Zero(t, c.QuarantinedBytes, "no bytes reported quarantined")
			delete(e.live, x)
			e.unreserve(y)
			require.NoError(t, host.CheckShared(e.s))
			_, err := e.s.Trim(0)
			require.NoError(t, err)
			require.NoError(t, e.s.Close())
			st := e.auth.Stats()
			assert.Zero(t, st.Owned, "nothing stays owned")
			e.closed = true
		})
	}
}

// TestSharedPrivateParkOnlyWritable: a failure that leaves a granule idle in the
// private park leaves it writable, so that the commit that takes it gets a
// writable granule, as the bookkeeping says. A prefill whose mprotect failed
// changed nothing at its place (still reserved): it gives the granule up rather than
// keep it idle when the cleanup unmap fails too. An undone Share whose move back of
// a protected granule failed, and the cleanup after it, leaves its copy idle
// writable, not read-only.
func TestSharedPrivateParkOnlyWritable(t *testing.T) {
	forPrivate(t, func(t *testing.T, m sharedMode) {
		t.Run("prefill", func(t *testing.T) {
			e := m.env(t, host.SharedOptions{High: 4}, true)
			e.f.Fail(func(_ int, name string) bool { return name == "protect" || name == "unmapTo" }, errInjected)
			require.ErrorIs(t, e.s.Prefill(1), errInjected)
			e.f.Reset()
			assert.Zero(t, e.pool().Owned, "nothing was made")
			require.NoError(t, host.CheckShared(e.s))
			x := e.reserve(1)
			e.commit(x, 0, 1)
			e.checkMaps(x, e.s.Base(x), e.g)
			require.False(t, t.Failed(), "the granule is not writable: a store would fault")
			e.tag(x, 0, 5)
			assert.Equal(t, uint64(5), e.tagOf(x, 0))
		})
		t.Run("undone share", func(t *testing.T) {
			e := m.env(t, host.SharedOptions{High: 4}, true)
			x := e.reserve(2)
			e.commit(x, 0, 2)
			e.tagAll(x)
			y := e.reserve(1)
			e.share(y, 0, x, 1, 1, backing.ReadOnly) // the park exists now
			e.protect(x, 0, 1, backing.ReadOnly)
			z := e.reserve(1)
			seen := map[string]int{}
			e.f.Fail(func(_ int, name string) bool {
				seen[name]++
				switch name {
				case "mapFile": // z's mapping: the Share fails after the move into the memfd
					return seen[name] == 1
				case "move": // the move back (the first is the move into the memfd)
					return seen[name] == 2
				case "unmapTo": // and giving the copy's place back
					return true
				}
				return false
			}, errInjected)
			err := e.s.Share(z, 0, x, 0, e.g, backing.ReadOnly)
			log := e.f.Log()
			e.f.Reset()
			t.Logf("%v: %v", err, log)
			require.ErrorIs(t, err, errInjected)
			require.NoError(t, host.CheckShared(e.s))
			e.checkMaps(x, e.s.Base(x), 2*e.g)
			assert.Equal(t, uint64(1<<32), e.tagOf(x, 0), "the source keeps its contents")
			_, ro := host.SharedSlots(x)
			assert.True(t, ro[0], "and its access")
			w := e.reserve(1)
			e.commit(w, 0, 1)
			e.checkMaps(w, e.s.Base(w), e.g)
			require.False(t, t.Failed(), "the granule is not writable: a store would fault")
			e.tag(w, 0, 6)
			assert.Equal(t, uint64(6), e.tagOf(w, 0))
		})
	})
}

// TestSharedPrivateResident: an idle private granule is resident only where its
// pages are known to exist (a prefill, SharedOptions.Populate, Populate), as an idle
// memfd granule is: one a commit made without populating it and nobody populated
// may have no page at all, so Prefill populates it (no new bytes), and the commit
// that takes it then takes no fault.
func TestSharedPrivateResident(t *testing.T) { forPrivate(t, testSharedPrivateResident) }

func testSharedPrivateResident(t *testing.T, m sharedMode) {
	for _, how := range []string{"untouched", "option", "populate"} {
		t.Run(how, func(t *testing.T) {
			e := privateEnv(t, m, host.SharedOptions{High: 4, Populate: how == "option"})
			g := e.g
			pages := g / os.Getpagesize()
			x := e.reserve(2)
			e.commit(x, 0, 2)
			if how == "populate" {
				require.NoError(t, e.s.Populate(x, 0, 2*g))
			}
			known := how != "untouched"
			e.decommit(x, 0, 2)
			p := e.pool()
			assert.Equal(t, int64(2*g), p.Idle)
			if known {
				assert.Equal(t, int64(2*g), p.Resident, "populated, then parked with their pages")
			} else {
				assert.Zero(t, p.Resident, "never populated: no page known to exist")
			}
			require.NoError(t, e.s.Prefill(2))
			p = e.pool()
			assert.Equal(t, int64(2*g), p.Resident, "Prefill populated the idle granules")
			assert.Equal(t, int64(2*g), p.Owned, "and made none")
			require.NoError(t, host.CheckShared(e.s))
			y := e.reserve(2)
			e.commit(y, 0, 2)
			assert.Equal(t, 2*pages, present(t, e.s.Base(y), 2*g), "the commit takes no fault")
			assert.Equal(t, []bool{true, true}, host.SharedPrivate(y))
			e.decommit(y, 0, 2)
			assert.Equal(t, int64(2*g), e.pool().Resident, "what came out resident goes back resident")
			require.NoError(t, host.CheckShared(e.s))
		})
	}
}

// TestSharedPrivateShareIdleBudget: idle private granules can not become memfd
// granules, so where they hold the budget a Share's move into the memfd needs,
// they go back to the OS for it rather than the Share be refused while the pool
// holds idle memory.
func TestSharedPrivateShareIdleBudget(t *testing.T) { forPrivate(t, testSharedPrivateShareIdleBudget) }

func testSharedPrivateShareIdleBudget(t *testing.T, m sharedMode) {
	e := privateEnv(t, m, host.SharedOptions{High: 4})
	g := e.g
	require.NoError(t, e.gov.SetLimit(e.auth.Device(), int64(2*g)))
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.tag(x, 0, 3)
	e.decommit(x, 1, 1)
	require.Equal(t, int64(g), e.pool().Idle, "an idle private granule")
	require.Equal(t, int64(2*g), e.pool().Owned, "the budget is full")
	y := e.reserve(1)
	e.share(y, 0, x, 0, 1, backing.ReadOnly)
	assert.Equal(t, uint64(3), e.tagOf(y, 0))
	assert.Zero(t, e.pool().Idle, "the idle granule made room for the move")
	assert.Equal(t, int64(g), e.pool().Owned, "owned once")
	assert.LessOrEqual(t, e.auth.Stats().OwnedPeak, int64(2*g), "never over the budget")
	require.NoError(t, host.CheckShared(e.s))
}

// TestSharedPrivateRuns: consecutive private granules move into and out of the
// private park as runs, one call per run of consecutive places, and a fragmented
// park splits them into fewer, shorter runs, each granule keeping its contents
// (a pattern on every page).
func TestSharedPrivateRuns(t *testing.T) { forPrivate(t, testSharedPrivateRuns) }

func testSharedPrivateRuns(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{High: 10, Decay: host.SharedNoDecay}, true)
	g := e.g
	// moves runs op and returns how many moves (mremap) it made.
	moves := func(op func()) int {
		e.f.Fail(func(int, string) bool { return false }, nil) // log from here
		op()
		n := 0
		for _, c := range e.f.Log() {
			if c == "move" {
				n++
			}
		}
		e.f.Reset()
		require.NoError(t, host.CheckShared(e.s))
		e.checkPark()
		return n
	}
	// fill writes a pattern of v on every page of granule gi of r; check reads it.
	page := os.Getpagesize()
	fill := func(r *host.SharedReservation, gi int, v uint64) {
		b := make([]byte, g)
		for p := 0; p < g; p += page {
			binary.LittleEndian.PutUint64(b[p:], v<<32|uint64(p/page))
		}
		require.NoError(t, e.s.CopyIn(r, gi*g, b))
	}
	check := func(r *host.SharedReservation, gi int, v uint64) {
		t.Helper()
		b := make([]byte, g)
		require.NoError(t, e.s.CopyOut(b, r, gi*g))
		for p := 0; p < g; p += page {
			if got := binary.LittleEndian.Uint64(b[p:]); got != v<<32|uint64(p/page) {
				require.Failf(t, "contents lost", "granule %d page %d: %#x, want pattern %d", gi, p/page, got, v)
			}
		}
	}

	x := e.reserve(10)
	e.commit(x, 0, 10)
	for i := range 10 {
		fill(x, i, uint64(100+i))
	}
	assert.Equal(t, 1, moves(func() { e.decommit(x, 0, 10) }), "ten granules park with one move")
	assert.Equal(t, int64(10*g), e.pool().Idle)

	// Out as runs: places 0-2, then 3-5.
	y, z := e.reserve(3), e.reserve(3)
	assert.Equal(t, 1, moves(func() { e.commit(y, 0, 3) }), "three parked granules come out with one move")
	assert.Equal(t, 1, moves(func() { e.commit(z, 0, 3) }))
	assert.Equal(t, int64(10*g), e.pool().Owned, "no new granule")
	for i := range 3 {
		check(y, i, uint64(100+i))
		check(z, i, uint64(103+i))
		fill(y, i, uint64(200+i))
		fill(z, i, uint64(300+i))
	}
	e.checkMaps(y, e.s.Base(y), 3*g)
	assert.Equal(t, 1, moves(func() { e.decommit(y, 0, 3) }), "into places 0-2")
	// Idle: 0-2 (y), 6-9 (x's last four); free: 3-5.
	w := e.reserve(6)
	assert.Equal(t, 2, moves(func() { e.commit(w, 0, 6) }), "no six idle places in a row: the longest run, then the next")
	for i := range 4 {
		check(w, i, uint64(106+i))
	}
	check(w, 4, 200)
	check(w, 5, 201)
	for i := range 6 {
		fill(w, i, uint64(400+i))
	}
	// Idle: 2 (y's last); free: 0-1, 3-9. z parks in 3-5, leaving 0-1 and 6-9.
	assert.Equal(t, 1, moves(func() { e.decommit(z, 0, 3) }))
	assert.Equal(t, 2, moves(func() { e.decommit(w, 0, 6) }), "no six free places in a row: the longest run, then the next")
	assert.Equal(t, int64(10*g), e.pool().Idle)

	// Every place is idle again, in one run: 0-1 w's last two, 2 y's last, 3-5 z,
	// 6-9 w's first four.
	v := e.reserve(10)
	assert.Equal(t, 1, moves(func() { e.commit(v, 0, 10) }))
	for i, want := range []uint64{404, 405, 202, 300, 301, 302, 400, 401, 402, 403} {
		check(v, i, want)
	}
	e.checkMaps(v, e.s.Base(v), 10*g)
	assert.Equal(t, int64(10*g), e.pool().Owned)
	for _, r := range []*host.SharedReservation{x, y, z, w, v} {
		e.unreserve(r)
	}
	// Back to the OS as runs too: one remap of the ten places.
	e.f.Fail(func(int, string) bool { return false }, nil)
	n, err := e.s.Trim(0)
	log := e.f.Log()
	e.f.Reset()
	require.NoError(t, err)
	assert.Equal(t, int64(10*g), n)
	assert.Equal(t, []string{"unmapTo"}, log, "ten idle granules in a row go back with one call")
	assert.Zero(t, e.pool().Owned)
	require.NoError(t, host.CheckShared(e.s))
	e.checkPark()
}

// TestSharedPrivateRunRefused: a run whose move fails is moved granule by granule,
// contents and all. Where the kernel refused the range whole (several mappings,
// before Linux 6.17) the granules stay known resident; after any other failure,
// which since Linux 6.17 may have moved part of the run, they are not.
func TestSharedPrivateRunRefused(t *testing.T) { forPrivate(t, testSharedPrivateRunRefused) }

func testSharedPrivateRunRefused(t *testing.T, m sharedMode) {
	for _, tt := range []struct {
		name     string
		err      error
		resident bool
	}{
		{"span", host.ErrSharedSpan, true},
		{"other", errInjected, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := m.env(t, host.SharedOptions{High: 8, Populate: true, Decay: host.SharedNoDecay}, true)
			g := e.g
			refuseRun := func(op func()) []string {
				first := true
				e.f.Fail(func(_ int, name string) bool {
					if name == "move" && first {
						first = false
						return true
					}
					return false
				}, tt.err)
				op()
				log := e.f.Log()
				e.f.Reset()
				require.NoError(t, host.CheckShared(e.s))
				e.checkPark()
				return log
			}
			x := e.reserve(4)
			e.commit(x, 0, 4)
			for i := range 4 {
				e.tag(x, i, uint64(50+i))
			}
			log := refuseRun(func() { e.decommit(x, 0, 4) })
			assert.Equal(t, []string{"reserve", "!move", "move", "move", "move", "move", "discard"}, log,
				"the private park is reserved, the run's move fails, each granule moves")
			p := e.pool()
			assert.Equal(t, int64(4*g), p.Idle, "every granule parked")
			if tt.resident {
				assert.Equal(t, int64(4*g), p.Resident, "nothing moved: still resident")
			} else {
				assert.Zero(t, p.Resident, "maybe moved in part: not known resident")
			}
			y := e.reserve(4)
			log = refuseRun(func() { e.commit(y, 0, 4) })
			assert.Equal(t, []string{"!move", "move", "move", "move", "move"}, log)
			assert.Equal(t, int64(4*g), e.pool().Owned, "no new granule")
			for i := range 4 {
				assert.Equal(t, uint64(50+i), e.tagOf(y, i), "granule %d keeps its contents", i)
			}
			e.checkMaps(y, e.s.Base(y), 4*g)
			e.unreserve(y)
			if tt.resident {
				assert.Equal(t, int64(4*g), e.pool().Resident, "parked again, known resident all along")
			}
			e.unreserve(x)
		})
	}
}
