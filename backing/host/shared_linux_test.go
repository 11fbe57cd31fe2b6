package host_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

const kib64 = 64 << 10

var memfdSeq atomic.Int64

// memfdName returns a memfd name no other backing of this process uses, so that
// /proc/self/maps tells this test's mappings apart.
func memfdName() string { return fmt.Sprintf("vmt-%d-%d", os.Getpid(), memfdSeq.Add(1)) }

// sharedEnv is one Shared backing under test with its own governor and authority.
type sharedEnv struct {
	t    *testing.T
	gov  *accounting.Governor
	auth *accounting.Authority
	s    *host.Shared
	f    *host.SharedFaults // nil unless faulty
	name string
	g    int
	live map[*host.SharedReservation]bool

	closed bool // the test closed the backing itself

	mu    sync.Mutex
	clock time.Time // the backing's clock
}

// now is the backing's clock.
func (e *sharedEnv) now() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.clock
}

// advance moves the backing's clock on by d.
func (e *sharedEnv) advance(d time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.clock = e.clock.Add(d)
}

// newEnv returns a backing with opts (Authority and Name filled in). At cleanup it
// unreserves what the test left, checks the bookkeeping, closes the backing and
// checks that the authority owns and maps nothing.
func newEnv(t *testing.T, opts host.SharedOptions, faulty bool) *sharedEnv {
	t.Helper()
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	opts.Authority = auth
	if opts.Name == "" {
		opts.Name = memfdName()
	}
	e := &sharedEnv{t: t, gov: gov, auth: auth, name: opts.Name, live: map[*host.SharedReservation]bool{}}
	var err error
	if faulty {
		e.s, e.f, err = host.NewSharedFaulty(opts)
	} else {
		e.s, err = host.NewShared(opts)
	}
	require.NoError(t, err)
	e.g = e.s.Granularity()
	// NB: a clock that stands still, so that no idle granule decays while a slow
	// test (under -race, on a loaded machine) looks at the pool; the scavenger
	// still runs. TestSharedDecay moves its own clock.
	e.clock = time.Unix(1e9, 0)
	host.SetSharedClock(e.s, e.now)
	t.Cleanup(e.close)
	return e
}

// sharedMode is a way for a Shared backing to get its new granules, as options.
type sharedMode struct {
	name string
	opts func(host.SharedOptions) host.SharedOptions
	huge string // SharedStats.HugePages it gives; where the system gives another, the test skips
	priv bool   // SharedStats.PrivateGranules
}

// sharedModes are the ways a Shared backing gets new granules on Linux: memfd
// granules from the start (NoPrivateGranules: Windows' only way), private granules
// of small pages (the default where huge pages are not used, as on a guest that
// reports free memory to its host), and private huge pages (forced on such a guest;
// skipped where the system gives shmem huge pages or none).
var sharedModes = []sharedMode{
	{name: "memfd", opts: memfdOpts},
	{name: "private", priv: true, opts: func(o host.SharedOptions) host.SharedOptions {
		o.NoHugePages, o.AlwaysHugePages = true, false
		return o
	}},
	{name: "private-huge", huge: "private", priv: true, opts: func(o host.SharedOptions) host.SharedOptions {
		o.Granularity, o.NoHugePages, o.AlwaysHugePages = 2<<20, false, true
		return o
	}},
}

// forModes runs test in each of sharedModes (skipping those the system can not
// give).
func forModes(t *testing.T, test func(t *testing.T, m sharedMode)) {
	for _, m := range sharedModes {
		t.Run(m.name, func(t *testing.T) { test(t, m) })
	}
}

// modeNamed returns the mode of sharedModes named name.
func modeNamed(t *testing.T, name string) sharedMode {
	t.Helper()
	for _, m := range sharedModes {
		if m.name == name {
			return m
		}
	}
	t.Fatalf("no mode %q", name)
	return sharedMode{}
}

// memfdOpts makes opts give memfd granules of small pages, for tests of the memfd
// itself: its slots, its park, its file.
func memfdOpts(o host.SharedOptions) host.SharedOptions {
	o.NoPrivateGranules, o.NoHugePages, o.AlwaysHugePages = true, true, false
	return o
}

// env returns a backing with opts in mode m, or skips where the system can not give
// it.
func (m sharedMode) env(t *testing.T, opts host.SharedOptions, faulty bool) *sharedEnv {
	t.Helper()
	m.check(t, m.opts(opts))
	return newEnv(t, m.opts(opts), faulty)
}

// check skips the test where a backing with opts would not be in mode m.
func (m sharedMode) check(t *testing.T, opts host.SharedOptions) {
	t.Helper()
	gov := accounting.NewGovernor()
	opts.Authority = gov.Authority("probe", accounting.HostKey)
	opts.Name = memfdName()
	s, err := host.NewShared(opts)
	require.NoError(t, err)
	st := s.Stats()
	require.NoError(t, s.Close())
	require.Equal(t, st.PrivateGranules, st.NoPrivateGranules == "", "a fallback says why: %+v", st)
	if st.HugePages != m.huge || st.PrivateGranules != m.priv {
		t.Skipf("the system gives %q huge pages (%s), private granules %v (%s)",
			st.HugePages, st.NoHugePages, st.PrivateGranules, st.NoPrivateGranules)
	}
}

func (e *sharedEnv) close() {
	t := e.t
	if e.closed {
		return
	}
	if e.f != nil {
		e.f.Reset()
	}
	for r := range e.live {
		e.unreserve(r)
	}
	assert.NoError(t, host.CheckShared(e.s), "bookkeeping at cleanup")
	assert.NoError(t, host.SharedFileCheck(e.s), "memfd at cleanup")
	if !assert.NoError(t, e.s.Close()) {
		return
	}
	st := e.auth.Stats()
	assert.Zero(t, st.Owned, "owned bytes after Close")
	assert.Zero(t, st.Mapped, "mapped bytes after Close")
}

func (e *sharedEnv) reserve(granules int) *host.SharedReservation {
	e.t.Helper()
	r, err := e.s.Reserve(granules * e.g)
	require.NoError(e.t, err)
	e.live[r] = true
	return r
}

// unreserve unreserves r, which must be Complete.
func (e *sharedEnv) unreserve(r *host.SharedReservation) accounting.ReleaseOutcome {
	e.t.Helper()
	o := e.s.Unreserve(r)
	if o.Status != accounting.Failed {
		delete(e.live, r)
	}
	assert.Equal(e.t, accounting.Complete, o.Status, "Unreserve: %v", o)
	return o
}

func (e *sharedEnv) commit(r *host.SharedReservation, gi, n int) {
	e.t.Helper()
	require.NoError(e.t, e.s.Commit(r, gi*e.g, n*e.g))
}

func (e *sharedEnv) decommit(r *host.SharedReservation, gi, n int) {
	e.t.Helper()
	require.NoError(e.t, e.s.Decommit(r, gi*e.g, n*e.g))
}

func (e *sharedEnv) share(dst *host.SharedReservation, di int, src *host.SharedReservation, si, n int, prot backing.Protection) {
	e.t.Helper()
	require.NoError(e.t, e.s.Share(dst, di*e.g, src, si*e.g, n*e.g, prot))
}

func (e *sharedEnv) protect(r *host.SharedReservation, gi, n int, prot backing.Protection) {
	e.t.Helper()
	require.NoError(e.t, e.s.Protect(r, gi*e.g, n*e.g, prot))
}

// tag writes v at the head and tail of granule gi of r.
func (e *sharedEnv) tag(r *host.SharedReservation, gi int, v uint64) {
	e.t.Helper()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	require.NoError(e.t, e.s.CopyIn(r, gi*e.g, b[:]))
	require.NoError(e.t, e.s.CopyIn(r, (gi+1)*e.g-8, b[:]))
}

// tagOf reads the tag of granule gi of r (head and tail must agree).
func (e *sharedEnv) tagOf(r *host.SharedReservation, gi int) uint64 {
	e.t.Helper()
	var h, l [8]byte
	require.NoError(e.t, e.s.CopyOut(h[:], r, gi*e.g))
	require.NoError(e.t, e.s.CopyOut(l[:], r, (gi+1)*e.g-8))
	require.Equal(e.t, h, l, "granule %d: head and tail tags differ", gi)
	return binary.LittleEndian.Uint64(h[:])
}

func (e *sharedEnv) pool() backing.PoolStats { return e.s.PoolStats() }

// checkMaps checks that the kernel's mappings of [base, base+size) are what the
// backing's bookkeeping of r says: each committed granule a MAP_SHARED mapping of
// its slot of this backing's memfd (read-only where shared so), each reserved one
// PROT_NONE private anonymous memory.
func (e *sharedEnv) checkMaps(r *host.SharedReservation, base uintptr, size int) {
	e.t.Helper()
	maps := testutil.Maps(e.t)
	slots, ro := host.SharedSlots(r)
	priv := host.SharedPrivate(r)
	require.Len(e.t, slots, size/e.g)
	memfd := "/memfd:" + e.name + " "
	for i, slot := range slots {
		a := base + uintptr(i*e.g)
		vs := testutil.Overlapping(maps, a, a+uintptr(e.g))
		if !assert.NotEmpty(e.t, vs, "granule %d at %#x is not mapped at all", i, a) {
			continue
		}
		assert.LessOrEqual(e.t, vs[0].Lo, a, "granule %d: a hole at its start", i)
		assert.GreaterOrEqual(e.t, vs[len(vs)-1].Hi, a+uintptr(e.g), "granule %d: a hole at its end", i)
		for k, v := range vs {
			if k > 0 {
				assert.Equal(e.t, vs[k-1].Hi, v.Lo, "granule %d: a hole inside", i)
			}
			if slot < 0 && priv[i] {
				want := "rw-p"
				if ro[i] {
					want = "r--p"
				}
				assert.Equal(e.t, want, v.Perms, "private granule %d", i)
				assert.Zero(e.t, v.Inode, "private granule %d is anonymous", i)
				assert.Empty(e.t, v.Path, "private granule %d is anonymous", i)
				continue
			}
			if slot < 0 {
				assert.Equal(e.t, "---p", v.Perms, "reserved granule %d", i)
				assert.Zero(e.t, v.Inode, "reserved granule %d is anonymous", i)
				assert.Empty(e.t, v.Path, "reserved granule %d is anonymous", i)
				continue
			}
			want := "rw-s"
			if ro[i] {
				want = "r--s"
			}
			assert.Equal(e.t, want, v.Perms, "committed granule %d", i)
			assert.True(e.t, strings.HasPrefix(v.Path+" ", memfd), "granule %d maps %q, not %s", i, v.Path, memfd)
			from := max(a, v.Lo)
			assert.Equal(e.t, uint64(slot*e.g)+uint64(from-a), v.Offset+uint64(from-v.Lo),
				"granule %d maps the wrong file offset", i)
		}
	}
}

// checkPark checks that each chunk of the park is one read-write shared mapping of
// its slots of the memfd: moving granules in and out of it never splits it, so it
// costs one of the process's vm.max_map_count mappings per chunk.
func (e *sharedEnv) checkPark() {
	e.t.Helper()
	maps := testutil.Maps(e.t)
	memfd := "/memfd:" + e.name + " "
	for k, c := range host.SharedPark(e.s) {
		size := c.Slots * e.g
		vs := testutil.Overlapping(maps, c.Base, c.Base+uintptr(size))
		if !assert.Len(e.t, vs, 1, "park chunk %d at %#x is one mapping", k, c.Base) {
			continue
		}
		v := vs[0]
		assert.LessOrEqual(e.t, v.Lo, c.Base, "park chunk %d", k)
		assert.GreaterOrEqual(e.t, v.Hi, c.Base+uintptr(size), "park chunk %d", k)
		assert.Equal(e.t, "rw-s", v.Perms, "park chunk %d", k)
		assert.True(e.t, strings.HasPrefix(v.Path+" ", memfd), "park chunk %d maps %q", k, v.Path)
		assert.Equal(e.t, uint64(c.First*e.g), v.Offset+uint64(c.Base-v.Lo), "park chunk %d maps the wrong offset", k)
	}
}

// checkGone checks that nothing of [base, base+size) maps this backing's memfd.
func (e *sharedEnv) checkGone(base uintptr, size int) {
	e.t.Helper()
	for _, v := range testutil.Overlapping(testutil.Maps(e.t), base, base+uintptr(size)) {
		assert.NotContains(e.t, v.Path, "/memfd:"+e.name+" ", "unreserved range still maps the memfd at %#x", v.Lo)
	}
}

// vmas returns how many kernel mappings cover [base, base+size).
func vmas(t *testing.T, base uintptr, size int) int {
	return len(testutil.Overlapping(testutil.Maps(t), base, base+uintptr(size)))
}

func TestSharedConformance(t *testing.T) {
	forModes(t, func(t *testing.T, m sharedMode) {
		for _, g := range []int{2 << 20, kib64} {
			if m.huge != "" && g != 2<<20 {
				continue
			}
			t.Run(fmt.Sprintf("granule=%dKiB", g>>10), func(t *testing.T) {
				m.check(t, m.opts(host.SharedOptions{Granularity: g}))
				backingtest.Run(t, func(t *testing.T) backing.Backing[*host.SharedReservation] {
					return m.env(t, host.SharedOptions{Granularity: g}, false).s
				})
			})
		}
	})
}

func TestShared64Reservations(t *testing.T) { forModes(t, testShared64Reservations) }

func testShared64Reservations(t *testing.T, m sharedMode) {
	const n = 64
	e := m.env(t, host.SharedOptions{}, false)
	g := e.g
	require.Equal(t, 2<<20, g, "the default granule")
	rs := make([]*host.SharedReservation, n)
	for i := range rs {
		rs[i] = e.reserve(1)
	}
	e.commit(rs[0], 0, 1)
	fill := bytes.Repeat([]byte{0xA5}, g)
	require.NoError(t, e.s.CopyIn(rs[0], 0, fill))
	for i := 1; i < n; i++ {
		// A chain: each shares its predecessor's mapping, read-write while that
		// is writable, then read-only.
		prot := backing.ReadWrite
		if i > n/2 {
			prot = backing.ReadOnly
		}
		e.share(rs[i], 0, rs[i-1], 0, 1, prot)
	}
	st := e.auth.Stats()
	assert.Equal(t, int64(g), st.Owned, "owned once")
	assert.Equal(t, int64(n*g), st.Mapped, "mapped 64 times")
	assert.Equal(t, int64(g), e.pool().Owned)
	assert.Equal(t, int64(n*g), e.pool().Mapped)

	// Touch every page through every mapping.
	buf := make([]byte, g)
	for i, r := range rs {
		require.NoError(t, e.s.CopyOut(buf, r, 0))
		require.True(t, bytes.Equal(fill, buf), "reservation %d reads the shared granule", i)
	}
	slots, _ := host.SharedSlots(rs[0])
	require.Equal(t, n, host.SharedRefs(e.s, slots[0]), "one reference per mapping")

	rss, pss := smaps(t, rs, e.s)
	t.Logf("64 mappings of one 2 MiB granule: Rss %d KiB, Pss %d KiB", rss>>10, pss>>10)
	assert.Equal(t, int64(n*g), rss, "every page is resident in every mapping")
	assert.GreaterOrEqual(t, pss, int64(g)*95/100, "Pss: the granule is resident once")
	assert.LessOrEqual(t, pss, int64(g)*110/100, "Pss: about one granule, not 64")

	for i, r := range rs {
		e.checkMaps(r, e.s.Base(r), g)
		if i > 0 {
			e.unreserve(r)
		}
	}
	st = e.auth.Stats()
	assert.Equal(t, int64(g), st.Owned, "the owner's mapping is left")
	assert.Equal(t, int64(g), st.Mapped)
	e.unreserve(rs[0])
	assert.Zero(t, e.auth.Stats().Mapped)
	assert.Equal(t, int64(g), e.pool().Idle, "the granule went idle with its last mapping")
}

// smaps sums Rss and Pss (bytes) of the mappings that cover the reservations.
func smaps(t *testing.T, rs []*host.SharedReservation, s *host.Shared) (rss, pss int64) {
	t.Helper()
	ms := testutil.Smaps(t)
	for _, r := range rs {
		lo := s.Base(r)
		hi := lo + uintptr(s.Size(r))
		for _, m := range testutil.Overlapping(ms, lo, hi) {
			require.True(t, m.Lo >= lo && m.Hi <= hi, "mapping %#x-%#x reaches outside the reservation", m.Lo, m.Hi)
			rss += m.Sizes["Rss"]
			pss += m.Sizes["Pss"]
		}
	}
	return rss, pss
}

func TestSharedPoolReuse(t *testing.T) {
	e := newEnv(t, host.SharedOptions{Granularity: kib64}, false)
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.tag(x, 0, 0x1111)
	e.tag(x, 1, 0x2222)
	slots, _ := host.SharedSlots(x)
	e.decommit(x, 0, 2)
	p := e.pool()
	assert.Equal(t, int64(2*e.g), p.Idle)
	assert.Equal(t, int64(2*e.g), p.Owned)
	assert.Zero(t, p.Mapped)

	y := e.reserve(2)
	e.commit(y, 0, 2)
	again, _ := host.SharedSlots(y)
	assert.Equal(t, slots, again, "the pooled granules are reused, in order")
	assert.False(t, e.s.CommitZeroes())
	assert.Equal(t, uint64(0x1111), e.tagOf(y, 0), "a pooled granule keeps its contents (CommitZeroes is false)")
	assert.Equal(t, uint64(0x2222), e.tagOf(y, 1))
	p = e.pool()
	assert.Zero(t, p.Idle)
	assert.Equal(t, int64(2*e.g), p.Owned, "no new granule")
	assert.Equal(t, int64(2*e.g), e.auth.Stats().OwnedPeak, "never more than two granules owned")
	e.checkMaps(y, e.s.Base(y), 2*e.g)
}

func TestSharedWaterMarks(t *testing.T) { forModes(t, testSharedWaterMarks) }

func testSharedWaterMarks(t *testing.T, m sharedMode) {
	for _, tt := range []struct {
		name     string
		high     int
		wantIdle int
		wantHigh int
	}{
		{"high=2", 2, 2, 2},
		{"default high", 0, 5, 64},
		{"no pool", host.SharedNoPool, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := m.env(t, host.SharedOptions{Granularity: kib64, High: tt.high}, false)
			x := e.reserve(5)
			e.commit(x, 0, 5)
			e.decommit(x, 0, 5)
			p := e.pool()
			assert.Equal(t, int64(tt.wantIdle*e.g), p.Idle)
			assert.Equal(t, int64(tt.wantIdle*e.g), p.Owned, "granules above High go back to the OS")
			assert.Equal(t, int64(tt.wantIdle*e.g), e.auth.Stats().Owned)
			assert.Equal(t, tt.wantHigh, p.High)
		})
	}
}

// TestSharedConsecutiveOffsets checks that the kernel merges what the backing places
// at consecutive file offsets: a commit of many granules, and growth one granule at
// a time, each end up as one mapping.
func TestSharedConsecutiveOffsets(t *testing.T) {
	e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64}), false)
	const n = 8
	x := e.reserve(n)
	e.commit(x, 0, n)
	assert.Equal(t, 1, vmas(t, e.s.Base(x), n*e.g), "one commit of %d granules is one mapping", n)

	y := e.reserve(n)
	for i := range n {
		e.commit(y, i, 1) // fresh granules, one at a time
	}
	assert.Equal(t, 1, vmas(t, e.s.Base(y), n*e.g), "growth one fresh granule at a time merges")

	e.decommit(x, 0, n) // n idle granules, consecutive
	z := e.reserve(n)
	for i := range n {
		e.commit(z, i, 1) // pooled granules, one at a time
	}
	assert.Equal(t, 1, vmas(t, e.s.Base(z), n*e.g), "growth one pooled granule at a time merges")
	e.checkMaps(z, e.s.Base(z), n*e.g)

	// Scattered idle granules: one mmap per run, and the pool is still used first.
	e.decommit(y, 1, 1)
	e.decommit(y, 3, 2)
	e.decommit(y, 6, 1)
	w := e.reserve(n)
	owned := e.auth.Stats().Owned
	e.commit(w, 0, 4)
	assert.Equal(t, owned, e.auth.Stats().Owned, "idle granules first")
	slots, _ := host.SharedSlots(w)
	ys, _ := host.SharedSlots(y)
	assert.Equal(t, []int{n + 1, n + 3, n + 4, n + 6}, slots[:4], "y's freed granules %v", ys)
	assert.Equal(t, 3, vmas(t, e.s.Base(w), 4*e.g), "three runs of slots, three mappings")
	e.checkMaps(w, e.s.Base(w), n*e.g)
	e.checkMaps(y, e.s.Base(y), n*e.g)
}

func TestSharedReadOnly(t *testing.T) { forModes(t, testSharedReadOnly) }

func testSharedReadOnly(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64}, false)
	a := e.reserve(2)
	b := e.reserve(2)
	e.commit(a, 0, 2)
	e.tag(a, 0, 7)
	e.share(b, 0, a, 0, 2, backing.ReadOnly)
	err := e.s.CopyIn(b, 10, []byte{1})
	assert.ErrorIs(t, err, host.ErrSharedReadOnly)
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	assert.Equal(t, uint64(7), e.tagOf(b, 0), "the refused write changed nothing")
	require.NoError(t, e.s.Populate(b, 0, 2*e.g), "Populate of a read-only mapping reads")
	assert.Equal(t, uint64(7), e.tagOf(b, 0))
	// A read-only mapping is never shared on read-write, which would let its holder
	// write what the owner and every sharer read; it is shared on read-only.
	c := e.reserve(2)
	err = e.s.Share(c, 0, b, 0, e.g, backing.ReadWrite)
	assert.ErrorIs(t, err, host.ErrSharedReadOnly)
	assert.ErrorIs(t, err, backing.ErrReadOnly)
	assert.ErrorIs(t, e.s.Decommit(c, 0, e.g), backing.ErrNotCommitted, "the refused share mapped nothing")
	e.share(c, 0, b, 0, 1, backing.ReadOnly)
	assert.ErrorIs(t, e.s.CopyIn(c, 0, []byte{1}), host.ErrSharedReadOnly)
	assert.Equal(t, uint64(7), e.tagOf(c, 0))
	// From the owner it is shared on read-write: the granule is the same.
	e.share(c, 1, a, 1, 1, backing.ReadWrite)
	e.tag(c, 1, 9)
	assert.Equal(t, uint64(9), e.tagOf(a, 1))
	assert.Equal(t, uint64(9), e.tagOf(b, 1))
	e.checkMaps(b, e.s.Base(b), 2*e.g)
	e.checkMaps(c, e.s.Base(c), 2*e.g)
}

func TestSharedPrefillPopulate(t *testing.T) {
	e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64, High: 8}), false)
	require.NoError(t, e.s.Prefill(0))
	assert.Zero(t, e.pool().Owned, "Prefill(0) creates nothing")
	require.NoError(t, e.s.Prefill(3))
	p := e.pool()
	assert.Equal(t, int64(3*e.g), p.Idle)
	assert.Equal(t, int64(3*e.g), p.Resident)
	assert.Equal(t, int64(3*e.g), e.auth.Stats().Owned)
	require.NoError(t, e.s.Prefill(2), "already there")
	assert.Equal(t, int64(3*e.g), e.pool().Owned)

	// A granule committed without Populate is not known resident when it goes idle;
	// Prefill populates it rather than create another.
	x := e.reserve(4)
	e.commit(x, 0, 4) // three pooled, one new
	assert.Equal(t, int64(4*e.g), e.auth.Stats().Owned)
	e.decommit(x, 0, 4)
	p = e.pool()
	assert.Equal(t, int64(4*e.g), p.Idle)
	assert.Equal(t, int64(3*e.g), p.Resident)
	require.NoError(t, e.s.Prefill(4))
	p = e.pool()
	assert.Equal(t, int64(4*e.g), p.Resident)
	assert.Equal(t, int64(4*e.g), p.Owned, "Prefill populated the idle granule, made none")

	// Trim gives back what is not resident first; here all is, so from the top.
	n, err := e.s.Trim(1)
	require.NoError(t, err)
	assert.Equal(t, int64(3*e.g), n)
	assert.Equal(t, int64(e.g), e.pool().Resident)

	// Populate of a committed range marks its granules resident once idle.
	e.commit(x, 0, 3)
	e.tag(x, 1, 5)
	require.NoError(t, e.s.Populate(x, 0, 3*e.g))
	assert.Equal(t, uint64(5), e.tagOf(x, 1), "Populate keeps the contents")
	e.decommit(x, 0, 3)
	assert.Equal(t, int64(3*e.g), e.pool().Resident)

	// Commit with SharedOptions.Populate populates what it creates.
	f := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64, Populate: true}), false)
	y := f.reserve(2)
	f.commit(y, 0, 2)
	f.decommit(y, 0, 2)
	assert.Equal(t, int64(2*f.g), f.pool().Resident)
}

func TestSharedLowRefill(t *testing.T) { forModes(t, testSharedLowRefill) }

func testSharedLowRefill(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64, Low: 2, High: 4}, false)
	host.SharedWaitRefill(e.s)
	p := e.pool()
	assert.Equal(t, int64(2*e.g), p.Resident, "filled to Low at start")
	assert.Equal(t, 2, p.Low)
	x := e.reserve(3)
	e.commit(x, 0, 1)
	host.SharedWaitRefill(e.s)
	p = e.pool()
	assert.Equal(t, int64(2*e.g), p.Resident, "refilled to Low after a commit took one")
	assert.Equal(t, int64(3*e.g), p.Owned)
	require.NoError(t, host.CheckShared(e.s))

	// A budget that refuses stops the refill quietly; commits still work from it.
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(4*e.g)))
	e.commit(x, 1, 2) // takes both idle granules
	host.SharedWaitRefill(e.s)
	p = e.pool()
	assert.Equal(t, int64(e.g), p.Resident, "refilled as far as the budget allows")
	assert.Equal(t, int64(4*e.g), p.Owned)
}

// TestSharedBudget: a refused commit changes nothing, whether or not it could have
// taken idle granules first.
func TestSharedBudget(t *testing.T) { forModes(t, testSharedBudget) }

func testSharedBudget(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64}, false)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(3*e.g)))
	x := e.reserve(4)
	e.commit(x, 0, 2)
	e.decommit(x, 1, 1) // one idle
	before := e.pool()
	err := e.s.Commit(x, e.g, 3*e.g) // one idle + two new > budget of one more
	require.Error(t, err)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	var be *accounting.BudgetError
	assert.ErrorAs(t, err, &be)
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	assert.Equal(t, before, e.pool(), "a refused commit changes nothing")
	assert.Equal(t, int64(2*e.g), e.auth.Stats().Owned)
	e.checkMaps(x, e.s.Base(x), 4*e.g)
	e.commit(x, 1, 2) // one idle + one new fits
	assert.Equal(t, int64(3*e.g), e.auth.Stats().Owned)
	// A request beyond the whole limit fails at once, also for CommitCtx.
	y := e.reserve(4)
	err = e.s.CommitCtx(context.Background(), y, 0, 4*e.g)
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)
}

// TestSharedCommitCtxFIFO: commits that wait for the budget are served in arrival
// order, as granules other commits give up go back to the OS at once.
func TestSharedCommitCtxFIFO(t *testing.T) { forModes(t, testSharedCommitCtxFIFO) }

func testSharedCommitCtxFIFO(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64}, false)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(2*e.g)))
	x := e.reserve(2)
	e.commit(x, 0, 2)
	waiters := func() int { return e.gov.Stats(accounting.HostKey).Waiters }

	served := make(chan string, 2)
	errs := make(chan error, 2)
	ys := []*host.SharedReservation{e.reserve(1), e.reserve(1)}
	for i, name := range []string{"first", "second"} {
		go func() {
			err := e.s.CommitCtx(context.Background(), ys[i], 0, e.g)
			errs <- err
			served <- name
		}()
		testutil.WaitFor(t, name+" to queue", func() bool { return waiters() == i+1 })
	}
	// Someone else's TryAcquire does not jump the queue.
	other := e.gov.Authority("other", accounting.HostKey)
	assert.ErrorIs(t, other.TryAcquire(1), accounting.ErrBudgetExceeded)

	e.decommit(x, 0, 1)
	require.NoError(t, <-errs)
	assert.Equal(t, "first", <-served)
	assert.Equal(t, 1, waiters(), "the second still waits")
	assert.Zero(t, e.pool().Idle, "with waiters queued, a freed granule goes back to the OS at once")

	e.decommit(x, 1, 1)
	require.NoError(t, <-errs)
	assert.Equal(t, "second", <-served)
	assert.Zero(t, waiters())
	assert.Equal(t, int64(2*e.g), e.auth.Stats().Owned, "owned stays within the limit")
	assert.Equal(t, int64(2*e.g), e.auth.Stats().OwnedPeak, "never charged twice")
	for _, y := range ys {
		e.tag(y, 0, 3)
		e.checkMaps(y, e.s.Base(y), e.g)
	}
	// Without waiters the pool keeps what goes idle again.
	e.decommit(ys[0], 0, 1)
	assert.Equal(t, int64(e.g), e.pool().Idle)
}

// TestSharedCommitCtxIdleFIFO: on a full budget, waiting commits are served from the
// granules that go idle in their pool, in the order they queued, through the
// governor's queue alone: a small commit behind a large one does not take the first
// idle granule, nothing is charged anew, and no granule goes to the OS to be made
// again.
func TestSharedCommitCtxIdleFIFO(t *testing.T) { forModes(t, testSharedCommitCtxIdleFIFO) }

func testSharedCommitCtxIdleFIFO(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64, Decay: host.SharedNoDecay}, true)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(3*e.g)))
	x := e.reserve(3)
	e.commit(x, 0, 3) // the whole budget
	e.tag(x, 0, 1)
	e.tag(x, 1, 2)
	e.tag(x, 2, 3)
	created := e.pool().Created
	waiters := func() int { return e.gov.Stats(accounting.HostKey).Waiters }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	type result struct {
		name string
		err  error
	}
	served := make(chan result, 2)
	big, small := e.reserve(2), e.reserve(1)
	go func() { served <- result{"big", e.s.CommitCtx(ctx, big, 0, 2*e.g)} }()
	testutil.WaitFor(t, "the big commit to queue", func() bool { return waiters() == 1 })
	go func() { served <- result{"small", e.s.CommitCtx(ctx, small, 0, e.g)} }()
	testutil.WaitFor(t, "the small commit to queue", func() bool { return waiters() == 2 })
	e.f.Fail(func(int, string) bool { return false }, nil) // log the calls from here

	e.decommit(x, 0, 1)
	assert.Equal(t, 2, waiters(), "one idle granule serves neither: the small commit does not overtake")
	assert.Equal(t, int64(e.g), e.pool().Idle, "the pool keeps it for its waiters")
	e.decommit(x, 1, 1)
	first := <-served
	require.NoError(t, first.err)
	assert.Equal(t, "big", first.name, "served first, from the two idle granules")
	assert.Equal(t, 1, waiters())
	e.decommit(x, 2, 1)
	second := <-served
	require.NoError(t, second.err)
	assert.Equal(t, "small", second.name)

	assert.Zero(t, waiters())
	assert.NotContains(t, e.f.Log(), "punch", "an idle granule went to the OS while its pool's commits waited")
	p := e.pool()
	assert.Equal(t, created, p.Created, "no granule was made anew")
	assert.Zero(t, p.Idle)
	assert.Equal(t, int64(3*e.g), e.auth.Stats().OwnedPeak, "never charged twice")
	assert.ElementsMatch(t, []uint64{1, 2}, []uint64{e.tagOf(big, 0), e.tagOf(big, 1)}, "the big commit got x's first granules")
	assert.Equal(t, uint64(3), e.tagOf(small, 0))
	e.checkMaps(big, e.s.Base(big), 2*e.g)
	e.checkMaps(small, e.s.Base(small), e.g)
}

// TestSharedCommitCtxCancel: a commit that must wait holds nothing meanwhile (it puts
// the idle granules it could have used back in the pool, and waits for all it
// needs), so a cancelled wait leaks nothing; a served one commits all it asked
// for, and the granules that go idle while it waits are handed to it: none is
// first given back to the OS (no punch) to be made again.
func TestSharedCommitCtxCancel(t *testing.T) { forModes(t, testSharedCommitCtxCancel) }

func testSharedCommitCtxCancel(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64}, true)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(2*e.g)))
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.decommit(x, 1, 1) // one idle; budget full
	y := e.reserve(2)
	waiters := func() int { return e.gov.Stats(accounting.HostKey).Waiters }

	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, 1)
	go func() { errs <- e.s.CommitCtx(ctx, y, 0, 2*e.g) }()
	testutil.WaitFor(t, "the commit to queue", func() bool { return waiters() == 1 })
	p := e.pool()
	assert.Equal(t, int64(e.g), p.Idle, "the waiting commit put the idle granule back in the pool")
	assert.Equal(t, int64(2*e.g), p.Owned, "and holds nothing itself while it waits")
	cancel()
	err := <-errs
	assert.ErrorIs(t, err, context.Canceled)
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	assert.Zero(t, waiters())
	st := e.auth.Stats()
	assert.Equal(t, int64(2*e.g), st.Owned, "a cancelled wait leaks nothing: x's granule and the idle one")
	assert.Equal(t, int64(e.g), st.Mapped)
	assert.Equal(t, st.Owned, e.pool().Owned)
	assert.ErrorIs(t, e.s.Decommit(y, 0, e.g), backing.ErrNotCommitted)
	e.checkMaps(y, e.s.Base(y), 2*e.g)
	require.NoError(t, host.CheckShared(e.s))

	// Served: x's last granule goes idle, and the commit takes both idle granules.
	e.f.Fail(func(int, string) bool { return false }, nil) // log the calls from here
	go func() { errs <- e.s.CommitCtx(context.Background(), y, 0, 2*e.g) }()
	testutil.WaitFor(t, "the commit to queue", func() bool { return waiters() == 1 })
	e.tag(x, 0, 5)
	e.decommit(x, 0, 1)
	require.NoError(t, <-errs)
	assert.NotContains(t, e.f.Log(), "punch", "an idle granule went to the OS while its pool's commit waited")
	assert.Equal(t, int64(2*e.g), e.auth.Stats().Owned)
	assert.Equal(t, int64(2*e.g), e.auth.Stats().OwnedPeak, "never charged twice")
	assert.Contains(t, []uint64{e.tagOf(y, 0), e.tagOf(y, 1)}, uint64(5), "the waiter got x's granule itself")
	e.checkMaps(y, e.s.Base(y), 2*e.g)
}

// TestSharedCommitCtxIdlePlusReleased: a waiting commit that the pool's idle
// granules and bytes another owner gives back would serve together is served, though
// no granule of this pool goes idle meanwhile (the governor counts idle granules as
// used, so it can not see it).
func TestSharedCommitCtxIdlePlusReleased(t *testing.T) {
	forModes(t, testSharedCommitCtxIdlePlusReleased)
}

func testSharedCommitCtxIdlePlusReleased(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64, Decay: host.SharedNoDecay}, false)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(4*e.g)))
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.decommit(x, 0, 2) // two idle granules
	other := e.gov.Authority("other", accounting.HostKey)
	require.NoError(t, other.TryAcquire(int64(2*e.g)))
	y := e.reserve(3)
	errs := make(chan error, 1)
	go func() { errs <- e.s.CommitCtx(context.Background(), y, 0, 3*e.g) }()
	testutil.WaitFor(t, "the commit to queue", func() bool { return e.gov.Stats(accounting.HostKey).Waiters == 1 })
	other.Release(int64(e.g)) // two idle and one free granule now cover the commit
	require.NoError(t, <-errs)
	assert.Equal(t, int64(3*e.g), e.auth.Stats().Owned)
	assert.Zero(t, e.pool().Idle)
	e.checkMaps(y, e.s.Base(y), 3*e.g)
	other.Release(int64(e.g))
	e.unreserve(y)
	e.unreserve(x)
}

// TestSharedReclaimForOthers: when another owner's request waits for host memory,
// the pool gives its idle granules back to the OS so that the budget can serve it.
func TestSharedReclaimForOthers(t *testing.T) { forModes(t, testSharedReclaimForOthers) }

func testSharedReclaimForOthers(t *testing.T, m sharedMode) {
	e := m.env(t, host.SharedOptions{Granularity: kib64}, false)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(2*e.g)))
	x := e.reserve(2)
	e.commit(x, 0, 2)
	e.decommit(x, 0, 2)
	require.Equal(t, int64(2*e.g), e.pool().Idle)
	other := e.gov.Authority("other", accounting.HostKey)
	require.NoError(t, other.Acquire(context.Background(), int64(e.g)))
	assert.Zero(t, e.pool().Owned, "the idle granules went back for the other owner")
	other.Release(int64(e.g))
	e.unreserve(x)
}

func TestSharedMapLimit(t *testing.T) {
	for _, tt := range []struct {
		name         string
		count, limit int
		mapLimit     bool
	}{
		{"at the limit", 65500, 65530, true},
		{"far below", 100, 65530, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64}), true)
			host.SetSharedMapCount(e.s, func() (int, int, error) { return tt.count, tt.limit, nil })
			x := e.reserve(2)
			// The first commit maps the park; the second moves a granule out of it
			// and, when that fails, maps it afresh.
			e.f.Fail(func(_ int, name string) bool { return name == "mapFile" }, unix.ENOMEM)
			err := e.s.Commit(x, 0, e.g)
			e.f.Reset()
			require.Error(t, err)
			assert.ErrorIs(t, err, unix.ENOMEM)
			assert.Equal(t, tt.mapLimit, errors.Is(err, backing.ErrMapLimit), "growing the park: %v", err)
			require.NoError(t, e.s.Prefill(1))
			e.f.Fail(func(_ int, name string) bool { return name == "mapFile" || name == "move" }, unix.ENOMEM)
			err = e.s.Commit(x, 0, e.g)
			e.f.Reset()
			require.Error(t, err)
			assert.ErrorIs(t, err, unix.ENOMEM)
			var op *backing.OpError
			assert.ErrorAs(t, err, &op)
			if !tt.mapLimit {
				assert.ErrorIs(t, err, backing.ErrOutOfMemory)
				assert.NotErrorIs(t, err, backing.ErrMapLimit)
				return
			}
			assert.ErrorIs(t, err, backing.ErrMapLimit)
			msg := err.Error()
			for _, want := range []string{"vm.max_map_count", strconv.Itoa(tt.count), strconv.Itoa(tt.limit),
				"sysctl -w vm.max_map_count=N"} {
				assert.Contains(t, msg, want)
			}
			t.Log(msg)
			// Reserve says the same.
			e.f.Fail(func(_ int, name string) bool { return name == "reserve" }, unix.ENOMEM)
			_, err = e.s.Reserve(e.g)
			e.f.Reset()
			assert.ErrorIs(t, err, backing.ErrMapLimit)
			assert.Equal(t, int64(e.g), e.auth.Stats().Owned, "nothing charged but the prefilled granule")
			assert.Equal(t, int64(e.g), e.pool().Idle, "which is still idle")
			e.checkMaps(x, e.s.Base(x), 2*e.g)
		})
	}
	count, limit, err := host.SharedMapCount()
	require.NoError(t, err)
	assert.Positive(t, count)
	raw, err := os.ReadFile("/proc/sys/vm/max_map_count")
	require.NoError(t, err)
	assert.Equal(t, strings.TrimSpace(string(raw)), strconv.Itoa(limit))
}

func TestSharedClose(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	name := memfdName()
	s, err := host.NewShared(host.SharedOptions{Granularity: kib64, Authority: auth, Name: name})
	require.NoError(t, err)
	fd := host.SharedFd(s)
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	require.NoError(t, err)
	assert.Equal(t, "/memfd:"+name+" (deleted)", link)

	x, err := s.Reserve(4 * kib64)
	require.NoError(t, err)
	require.NoError(t, s.Commit(x, 0, 4*kib64))
	require.NoError(t, s.Decommit(x, 0, 2*kib64))
	err = s.Close()
	assert.ErrorIs(t, err, host.ErrSharedInUse, "Close with a live reservation")
	require.NoError(t, s.Commit(x, 0, kib64), "a refused Close changed nothing")
	assert.True(t, s.Unreserve(x).OK())
	assert.Equal(t, int64(4*kib64), auth.Stats().Owned, "idle granules until Close")
	require.NoError(t, s.Close())
	assert.Zero(t, auth.Stats().Owned)
	assert.Zero(t, s.PoolStats().Owned, "PoolStats works after Close")
	assert.Equal(t, -1, host.SharedFd(s))
	if l, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd)); err == nil {
		assert.NotEqual(t, link, l, "the memfd is closed")
	}
	for _, c := range []struct {
		name string
		fn   func()
	}{
		{"Reserve", func() { _, _ = s.Reserve(kib64) }},
		{"Prefill", func() { _ = s.Prefill(1) }},
		{"Trim", func() { _, _ = s.Trim(0) }},
	} {
		t.Run(c.name, func(t *testing.T) { assert.PanicsWithValue(t, host.PanicSharedClosed, c.fn) })
	}
	assert.ErrorIs(t, s.Close(), host.ErrSharedClosed, "a second Close changes nothing")
}

func TestSharedBadOptions(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	gpu := gov.Authority("gpu", accounting.GPU(0))
	page := os.Getpagesize()
	for _, tt := range []struct {
		name string
		opts host.SharedOptions
	}{
		{"not a power of two", host.SharedOptions{Granularity: 3 * page}},
		{"below the page", host.SharedOptions{Granularity: page / 2}},
		{"negative granularity", host.SharedOptions{Granularity: -page}},
		{"above 1 GiB", host.SharedOptions{Granularity: 2 << 30}},
		{"no authority", host.SharedOptions{Authority: nil}},
		{"device authority", host.SharedOptions{Authority: gpu}},
		{"negative low", host.SharedOptions{Low: -1}},
		{"low above high", host.SharedOptions{Low: 5, High: 4}},
		{"low without a pool", host.SharedOptions{Low: 1, High: host.SharedNoPool}},
		{"long name", host.SharedOptions{Name: strings.Repeat("n", 250)}},
		{"NUL in the name", host.SharedOptions{Name: "a\x00b"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.name != "no authority" && tt.opts.Authority == nil {
				tt.opts.Authority = auth
			}
			s, err := host.NewShared(tt.opts)
			assert.ErrorIs(t, err, host.ErrSharedOptions)
			assert.Nil(t, s)
		})
	}
	assert.Zero(t, auth.Stats().Owned)
}

func TestSharedBadArguments(t *testing.T) {
	e := newEnv(t, host.SharedOptions{Granularity: kib64}, false)
	x := e.reserve(2)
	y := e.reserve(2)
	e.commit(x, 0, 1)
	err := e.s.Share(y, 0, x, 0, e.g, backing.Protection(7))
	assert.ErrorIs(t, err, host.ErrSharedArgument, "unknown protection")
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	for _, tt := range []struct {
		name string
		err  error
	}{
		{"Commit nil", e.s.Commit(nil, 0, e.g)},
		{"CommitCtx nil", e.s.CommitCtx(context.Background(), nil, 0, e.g)},
		{"Decommit nil", e.s.Decommit(nil, 0, e.g)},
		{"Populate nil", e.s.Populate(nil, 0, e.g)},
		{"Share into nil", e.s.Share(nil, 0, x, 0, e.g, backing.ReadOnly)},
		{"Share from nil", e.s.Share(y, 0, nil, 0, e.g, backing.ReadOnly)},
		{"CopyIn nil", e.s.CopyIn(nil, 0, []byte{1})},
		{"CopyOut nil", e.s.CopyOut([]byte{1}, nil, 0)},
		{"Unreserve nil", e.s.Unreserve(nil).Err},
	} {
		assert.ErrorIs(t, tt.err, backing.ErrForeignReservation, tt.name)
	}
	assert.Equal(t, accounting.Failed, e.s.Unreserve(nil).Status)
	assert.Panics(t, func() { e.s.Base(nil) })
	_, err = e.s.Reserve(math.MaxInt &^ (e.g - 1))
	assert.ErrorIs(t, err, backing.ErrOutOfMemory, "more granules than a reservation can count")
	_, err = e.s.Trim(-1)
	assert.ErrorIs(t, err, backing.ErrInvalidRange)
	assert.ErrorIs(t, e.s.Prefill(-1), backing.ErrInvalidRange)
	assert.ErrorIs(t, e.s.CopyIn(x, -1, []byte{1}), backing.ErrInvalidRange)
	assert.ErrorIs(t, e.s.CopyOut(make([]byte, 2), x, e.g-1), backing.ErrNotCommitted)
	assert.ErrorIs(t, e.s.CopyOut(make([]byte, 1), x, 2*e.g), backing.ErrOutOfRange)
	e.checkMaps(x, e.s.Base(x), 2*e.g)
	e.checkMaps(y, e.s.Base(y), 2*e.g)
}

// TestSharedFaulty runs the backing under backingtest.Faulty: an injected failure
// reaches no system call, so nothing changes, and the next call works.
func TestSharedFaulty(t *testing.T) {
	e := newEnv(t, host.SharedOptions{Granularity: kib64}, false)
	f := backingtest.NewFaulty[*host.SharedReservation](e.s)
	boom := errors.New("injected")
	x, err := f.Reserve(2 * e.g)
	require.NoError(t, err)
	require.NoError(t, f.Commit(x, 0, e.g))
	e.tag(x, 0, 42)
	before, beforeAuth := e.pool(), e.auth.Stats()

	f.FailOp(backingtest.OpUnreserve, 1, boom)
	o := f.Unreserve(x)
	assert.Equal(t, accounting.Failed, o.Status)
	assert.ErrorIs(t, o.Err, boom)
	f.FailOp(backingtest.OpCommit, 1, boom)
	assert.ErrorIs(t, f.Commit(x, e.g, e.g), boom)
	f.FailOp(backingtest.OpShare, 1, boom)
	assert.ErrorIs(t, f.Share(x, e.g, x, 0, e.g, backing.ReadOnly), boom)
	assert.Equal(t, before, e.pool())
	assert.Equal(t, beforeAuth.Owned, e.auth.Stats().Owned)
	assert.Equal(t, uint64(42), e.tagOf(x, 0), "a Failed unreserve leaves the reservation as it was")
	e.checkMaps(x, e.s.Base(x), 2*e.g)

	o = f.Unreserve(x)
	assert.Equal(t, accounting.Complete, o.Status)
	assert.Equal(t, int64(e.g), o.Unmapped)
	assert.Zero(t, e.auth.Stats().Mapped)
}

// TestSharedPopulateByTouch runs population the way kernels without
// MADV_POPULATE_WRITE get it: a touch per page, which must keep contents (also
// through a read-only mapping, which it only reads) and make the granules resident.
func TestSharedPopulateByTouch(t *testing.T) {
	old := host.SetSharedNoPopulate(true)
	t.Cleanup(func() { host.SetSharedNoPopulate(old) })
	e := newEnv(t, host.SharedOptions{Granularity: kib64}, false)
	x := e.reserve(2)
	e.commit(x, 0, 2) // no pages yet: only the touches below make them
	e.tag(x, 1, 77)
	y := e.reserve(2)
	e.share(y, 0, x, 1, 1, backing.ReadOnly)
	require.NoError(t, e.s.Populate(y, 0, e.g), "a read-only mapping is populated by reading")
	require.NoError(t, e.s.Populate(x, 0, 2*e.g))
	assert.Equal(t, uint64(77), e.tagOf(y, 0), "touching keeps the contents")
	e.unreserve(y)
	e.decommit(x, 0, 2)
	assert.Equal(t, int64(2*e.g), e.pool().Resident)
	require.NoError(t, host.SharedFileCheck(e.s), "every page of the resident granules exists")
}

// TestSharedConcurrentPool runs commits, shares, decommits, waiting commits, Trim and
// Prefill from several goroutines at once on one pool under a tight budget, then
// checks that the bookkeeping, the ledger and the memfd agree.
func TestSharedConcurrentPool(t *testing.T) { forModes(t, testSharedConcurrentPool) }

func testSharedConcurrentPool(t *testing.T, m sharedMode) {
	const workers, rounds, granules = 4, 40, 4
	e := m.env(t, host.SharedOptions{Granularity: kib64, High: 3}, false)
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, int64(12*e.g)))
	prefix := e.reserve(1)
	e.commit(prefix, 0, 1)
	e.tag(prefix, 0, 99)
	rs := make([]*host.SharedReservation, workers)
	for w := range rs {
		rs[w] = e.reserve(granules)
	}
	g := e.g
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make(chan error, workers+1)
	stop := make(chan struct{})
	for w, r := range rs {
		go func() {
			for i := range rounds {
				err := e.s.Share(r, 0, prefix, 0, g, backing.ReadOnly)
				if err == nil {
					err = e.s.CommitCtx(ctx, r, g, (granules-1)*g)
				}
				if err == nil {
					var b [8]byte
					b[0] = byte(w*rounds + i)
					err = e.s.CopyIn(r, 2*g, b[:])
					if err == nil {
						var c [8]byte
						err = e.s.CopyOut(c[:], r, 2*g)
						if err == nil && c != b {
							err = fmt.Errorf("worker %d round %d read %v, wrote %v", w, i, c, b)
						}
					}
				}
				if err == nil {
					err = e.s.Decommit(r, 0, granules*g)
				}
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				errs <- nil
				return
			default:
			}
			var err error
			if i%2 == 0 {
				_, err = e.s.Trim(i % 3)
			} else if err = e.s.Prefill(i % 4); errors.Is(err, accounting.ErrBudgetExceeded) {
				err = nil
			}
			if err != nil {
				errs <- err
				return
			}
		}
	}()
	for range workers {
		require.NoError(t, <-errs)
	}
	close(stop)
	require.NoError(t, <-errs)
	require.NoError(t, host.CheckShared(e.s))
	require.NoError(t, host.SharedFileCheck(e.s))
	assert.Equal(t, uint64(99), e.tagOf(prefix, 0))
	assert.LessOrEqual(t, e.auth.Stats().OwnedPeak, int64(12*g), "never over the budget")
	assert.Equal(t, int64(g), e.pool().Mapped, "only the prefix is mapped")
}

// present counts the pages of [a, a+n) that have a page table entry (bit 63 of
// /proc/self/pagemap): pages a touch reaches without a fault.
func present(t *testing.T, a uintptr, n int) int {
	t.Helper()
	f, err := os.Open("/proc/self/pagemap")
	require.NoError(t, err)
	defer f.Close()
	page := os.Getpagesize()
	buf := make([]byte, 8*(n/page))
	_, err = f.ReadAt(buf, int64(a/uintptr(page))*8)
	require.NoError(t, err)
	c := 0
	for i := 0; i < len(buf); i += 8 {
		if binary.LittleEndian.Uint64(buf[i:])>>63 != 0 {
			c++
		}
	}
	return c
}

// TestSharedParkKeepsPageTables follows the page table entries of pooled granules
// through /proc/self/pagemap: Prefill builds them in the park, a commit moves them
// into the reservation (so the first touch takes no fault), and a decommit moves
// them back. A granule written through a fresh mapping keeps what its writes built.
// Without moves (kernels before 5.13) a pooled commit maps afresh and has none.
func TestSharedParkKeepsPageTables(t *testing.T) {
	for _, tt := range []struct {
		name string
		g    int
	}{{"granule=2MiB", 2 << 20}, {"granule=64KiB", kib64}} {
		t.Run(tt.name, func(t *testing.T) {
			// NB: memfd granules throughout (new ones included): private granules
			// have their own park, tested in TestSharedPrivatePark.
			e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: tt.g, High: 4, NoHugePages: true}), false)
			g := e.g
			pages := g / os.Getpagesize()
			park := func(slot int) int { return present(t, host.SharedParkAt(e.s, slot), g) }
			require.NoError(t, e.s.Prefill(2))
			assert.Equal(t, pages, park(0), "Prefill builds the page tables in the park")
			assert.Equal(t, pages, park(1))

			x := e.reserve(3)
			base := e.s.Base(x)
			if g >= 2<<20 {
				assert.Zero(t, base%(2<<20), "a reservation of 2 MiB granules is aligned for whole page-table moves")
				assert.Zero(t, host.SharedPark(e.s)[0].Base%(2<<20), "so is the park")
			}
			e.commit(x, 0, 2)
			assert.Equal(t, 2*pages, present(t, base, 2*g), "the commit moved the page tables in")
			assert.Zero(t, park(0), "and out of the park")
			assert.Zero(t, park(1))

			// A new granule, written through its reservation, parks what the
			// writes built.
			e.commit(x, 2, 1)
			slots, _ := host.SharedSlots(x)
			require.Equal(t, []int{0, 1, 2}, slots)
			assert.Zero(t, present(t, base+uintptr(2*g), g), "a new granule has no pages yet")
			require.NoError(t, e.s.CopyIn(x, 2*g, bytes.Repeat([]byte{1}, g)))
			e.tag(x, 0, 5)
			e.decommit(x, 0, 3)
			for i := range 3 {
				assert.Equal(t, pages, park(i), "the decommit moved slot %d's page tables to the park", i)
			}
			assert.Zero(t, present(t, base, 3*g))
			e.commit(x, 0, 3)
			assert.Equal(t, 3*pages, present(t, base, 3*g))
			assert.Equal(t, uint64(5), e.tagOf(x, 0), "contents move along")
			e.checkMaps(x, base, 3*g)
			e.checkPark()
			e.decommit(x, 0, 3)

			old := host.SetSharedNoMove(true)
			defer host.SetSharedNoMove(old)
			e.commit(x, 0, 3)
			assert.Zero(t, present(t, base, 3*g), "a fresh mapping has no page tables")
			assert.Equal(t, uint64(5), e.tagOf(x, 0))
			e.checkMaps(x, base, 3*g)
			e.decommit(x, 0, 3)
			e.checkPark()
		})
	}
}

// panicOf runs f and returns what it panicked with (nil if it returned).
func panicOf(f func()) (v any) {
	defer func() { v = recover() }()
	f()
	return nil
}

// TestSharedUnreservedWhileCommitting: a reservation unreserved while a commit on
// it waits for the budget (CommitCtx) makes the commit panic with
// backing.PanicUseAfterUnreserve once it wakes, whether granules going idle or the
// budget served it, having taken nothing: the bytes it waited for go back, it leaves
// the line, and the books agree.
func TestSharedUnreservedWhileCommitting(t *testing.T) {
	forModes(t, func(t *testing.T, m sharedMode) {
		for _, wake := range []string{"idle granule", "budget"} {
			t.Run(wake, func(t *testing.T) {
				e := m.env(t, host.SharedOptions{Granularity: kib64, Decay: host.SharedNoDecay}, false)
				g := int64(e.g)
				require.NoError(t, e.gov.SetLimit(accounting.HostKey, 2*g))
				x := e.reserve(2)
				e.commit(x, 0, 2)
				y := e.reserve(2)
				panicked := make(chan any, 1)
				go func() {
					panicked <- panicOf(func() { _ = e.s.CommitCtx(context.Background(), y, 0, 2*e.g) })
				}()
				testutil.WaitFor(t, "the commit to queue", func() bool { return e.gov.Stats(accounting.HostKey).Waiters == 1 })
				e.unreserve(y)
				peak := 2 * g
				if wake == "budget" {
					require.NoError(t, e.gov.SetLimit(accounting.HostKey, 4*g)) // the commit gets its bytes
					peak = 4 * g
				} else {
					e.decommit(x, 0, 2) // it is handed the idle granules
				}
				assert.Equal(t, backing.PanicUseAfterUnreserve, <-panicked)
				assert.Zero(t, e.gov.Stats(accounting.HostKey).Waiters, "it left the line")
				assert.Equal(t, 2*g, e.auth.Stats().Owned, "the bytes it waited for went back: x's alone are owned")
				assert.Equal(t, peak, e.auth.Stats().OwnedPeak, "it held no more than it waited for")
				require.NoError(t, host.CheckShared(e.s))
				assert.True(t, host.SharedGone(y))
			})
		}
	})
	// A commit that creates memfd granules and allocates their pages outside the
	// lock: the reservation is unreserved meanwhile (the hook runs Unreserve just
	// before the fallocate), and the new granules go back to the OS.
	t.Run("memfd/allocating", func(t *testing.T) {
		e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64, Populate: true}), true)
		y := e.reserve(2)
		var once sync.Once
		e.f.Before(func(name string) {
			if name == "allocate" {
				once.Do(func() { e.unreserve(y) })
			}
		})
		v := panicOf(func() { _ = e.s.Commit(y, 0, 2*e.g) })
		log := e.f.Log()
		e.f.Reset()
		assert.Equal(t, backing.PanicUseAfterUnreserve, v, "%v", log)
		assert.Contains(t, log, "punch", "the new granules went back to the OS")
		assert.Zero(t, e.auth.Stats().Owned)
		assert.Zero(t, e.pool().Owned)
		require.NoError(t, host.CheckShared(e.s))
		require.NoError(t, host.SharedFileCheck(e.s), "no page of the new granules is left in the file")
	})
}
