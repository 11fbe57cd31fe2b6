package host_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

// faultAddr returns the address a fault reports.
func faultAddr(err error) uintptr {
	var a interface{ Addr() uintptr }
	if errors.As(err, &a) {
		return a.Addr()
	}
	return 0
}

func TestPrivateTouchFaults(t *testing.T) {
	p := newPrivate(t, host.PrivateOptions{})
	g := p.Granularity()
	r, err := p.Reserve(3 * g)
	require.NoError(t, err)
	defer p.Unreserve(r)
	base := p.Base(r)

	for _, write := range []bool{false, true} {
		err := testutil.Touch(base+uintptr(g)+7, write)
		if assert.Error(t, err, "touching a reserved granule (write=%v) must fault", write) {
			assert.Equal(t, base+uintptr(g)+7, faultAddr(err), "fault address")
		}
	}
	require.NoError(t, p.Commit(r, g, g))
	assert.NoError(t, testutil.Touch(base+uintptr(g)+7, true), "a committed granule is writable")
	assert.NoError(t, testutil.Touch(base+uintptr(2*g)-1, false), "to its last byte")
	assert.Error(t, testutil.Touch(base+uintptr(2*g), false), "the granule after it is still reserved")
	assert.Error(t, testutil.Touch(base+uintptr(g)-1, false), "the granule before it is still reserved")

	require.NoError(t, p.Decommit(r, g, g))
	for _, write := range []bool{false, true} {
		assert.Error(t, testutil.Touch(base+uintptr(g)+7, write), "touching a decommitted granule (write=%v) must fault", write)
	}
	// Recommitted, the old byte is gone.
	require.NoError(t, p.Commit(r, g, g))
	assert.Equal(t, byte(0), host.PrivateBytes(base+uintptr(g)+7, 1)[0])
}

// mapsLine returns the /proc/self/maps line of the mapping that contains addr.
func mapsLine(t *testing.T, addr uintptr) string {
	t.Helper()
	ms := testutil.Overlapping(testutil.Maps(t), addr, addr+1)
	require.Len(t, ms, 1, "the mappings that contain %#x", addr)
	return ms[0].Line
}

func TestPrivateNamesMappings(t *testing.T) {
	name := fmt.Sprintf("vmarena-test-%d", os.Getpid())
	p := newPrivate(t, host.PrivateOptions{Name: name})
	g := p.Granularity()
	r, err := p.Reserve(4 * g)
	require.NoError(t, err)
	defer p.Unreserve(r)
	if host.PrivateNaming() == 2 {
		t.Skip("the kernel answered EINVAL to PR_SET_VMA_ANON_NAME: built without CONFIG_ANON_VMA_NAME")
	}
	require.Equal(t, int32(1), host.PrivateNaming(), "Reserve named the mapping")
	// Committing the middle splits the mapping; every piece keeps the name.
	require.NoError(t, p.Commit(r, g, g))
	base := p.Base(r)
	for i := range 4 {
		line := mapsLine(t, base+uintptr(i*g))
		assert.True(t, strings.HasSuffix(line, "[anon:"+name+"]"), "granule %d: %s", i, line)
	}
	assert.Contains(t, mapsLine(t, base+uintptr(g)), " rw-p ", "the committed granule is read-write")
	assert.Contains(t, mapsLine(t, base), " ---p ", "a reserved granule has no access")
}

// resident returns how many pages of [addr, addr+n) are resident.
func resident(t *testing.T, addr uintptr, n int) int {
	t.Helper()
	page := os.Getpagesize()
	vec := make([]byte, (n+page-1)/page)
	// Safety: vec is a live Go slice; the conversion is in the syscall's arguments.
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, addr, uintptr(n), uintptr(unsafe.Pointer(&vec[0])))
	require.Zero(t, errno, "mincore: %v", errno)
	c := 0
	for _, v := range vec {
		c += int(v & 1)
	}
	return c
}

func TestPrivatePopulate(t *testing.T) {
	page := os.Getpagesize()
	const g = 256 << 10
	pages := g / page
	for _, tt := range []struct {
		name  string
		touch bool // force the fallback for kernels without MADV_POPULATE_WRITE
	}{
		{"populate_write", false},
		{"touch", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.touch {
				defer host.PrivateForceTouch()()
			}
			lazy := newPrivate(t, host.PrivateOptions{Granularity: g})
			eager := newPrivate(t, host.PrivateOptions{Granularity: g, Populate: true})

			r, err := lazy.Reserve(2 * g)
			require.NoError(t, err)
			defer lazy.Unreserve(r)
			require.NoError(t, lazy.Commit(r, 0, 2*g))
			assert.Zero(t, resident(t, lazy.Base(r), 2*g), "a plain commit makes nothing resident")
			// Populate keeps what is there.
			require.NoError(t, lazy.CopyIn(r, g+page+3, []byte("kept")))
			require.NoError(t, lazy.Populate(r, g, g))
			assert.Equal(t, pages, resident(t, lazy.Base(r)+g, g), "Populate makes every page resident")
			assert.Zero(t, resident(t, lazy.Base(r), g), "and no other")
			got := make([]byte, 4)
			require.NoError(t, lazy.CopyOut(got, r, g+page+3))
			assert.Equal(t, "kept", string(got))

			e, err := eager.Reserve(2 * g)
			require.NoError(t, err)
			defer eager.Unreserve(e)
			require.NoError(t, eager.Commit(e, g, g))
			assert.Equal(t, pages, resident(t, eager.Base(e)+g, g), "a populating commit makes every page resident")
			require.NoError(t, eager.Decommit(e, g, g))
			require.NoError(t, eager.Commit(e, 0, g))
			assert.Equal(t, pages, resident(t, eager.Base(e), g))
			assert.Zero(t, host.PrivateBytes(eager.Base(e), g)[g-1], "populated pages read as zero")
		})
	}
}

func TestPrivateOutOfMemory(t *testing.T) {
	p := newPrivate(t, host.PrivateOptions{})
	// More than a 47-bit (or 56-bit) user address space holds.
	r, err := p.Reserve(1 << 62)
	if !assert.Error(t, err) {
		p.Unreserve(r)
		return
	}
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, unix.ENOMEM)
	var op *backing.OpError
	require.True(t, errors.As(err, &op))
	assert.Equal(t, "reserve", op.Op)
}

const mapLimitEnv = "VMARENA_PRIVATE_MAP_LIMIT_CHILD"

// TestPrivateMapLimit commits every other page until the process runs out of
// mappings, in a child process: at the limit the runtime itself could fail to map.
func TestPrivateMapLimit(t *testing.T) {
	if os.Getenv(mapLimitEnv) != "" {
		return
	}
	b, err := os.ReadFile("/proc/sys/vm/max_map_count")
	require.NoError(t, err)
	limit, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	if limit > 1<<20 {
		t.Skipf("vm.max_map_count is %d: reaching it would take %d syscalls", limit, limit)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPrivateMapLimitChild$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", mapLimitEnv, limit))
	out, err := cmd.CombinedOutput()
	assert.NoError(t, err, "child:\n%s", out)
	assert.Contains(t, string(out), "--- PASS: TestPrivateMapLimitChild", "child:\n%s", out)
}

func TestPrivateMapLimitChild(t *testing.T) {
	limit, _ := strconv.Atoi(os.Getenv(mapLimitEnv))
	if limit == 0 {
		return
	}
	// NB: at the limit any new mapping of the runtime's own fails fatally; a
	// memory-profile sample of an allocation on the error path allocates a bucket
	// off the heap (persistentalloc), which may need one. Nothing here profiles.
	runtime.MemProfileRate = 0
	page := os.Getpagesize()
	p := newPrivate(t, host.PrivateOptions{Granularity: page})
	n := 2*limit + 16
	r, err := p.Reserve(n * page)
	require.NoError(t, err)
	defer quietRuntime()() // at the limit a mapping the runtime makes is fatal
	committed := 0
	var cerr error
	for i := 1; i < n; i += 2 {
		if cerr = p.Commit(r, i*page, page); cerr != nil {
			assert.ErrorIs(t, p.Decommit(r, i*page, page), backing.ErrNotCommitted, "the failed commit changed nothing")
			break
		}
		committed++
	}
	o := p.Unreserve(r)
	require.Error(t, cerr, "%d scattered commits never hit vm.max_map_count=%d", committed, limit)
	assert.ErrorIs(t, cerr, backing.ErrMapLimit)
	assert.ErrorIs(t, cerr, unix.ENOMEM)
	assert.NotErrorIs(t, cerr, backing.ErrOutOfMemory)
	assert.Contains(t, cerr.Error(), "vm.max_map_count")
	// Each commit in the middle of the reservation splits a mapping in three.
	assert.Greater(t, committed, limit/4, "the limit came early")
	assert.True(t, o.OK(), "%v", o)
	assert.Equal(t, int64(committed*page), o.Unmapped)
	t.Logf("%d commits, then: %v", committed, cerr)
}

// TestPrivateHugePages checks that 2 MiB granules ask for transparent huge pages where
// the system allows them and that HugePages reports what the kernel gave: some
// huge pages for touched granules (the kernel may fall back to small pages for a few
// on a fragmented machine, never for all), none after decommit, none with the
// option off.
func TestPrivateHugePages(t *testing.T) {
	const g = 2 << 20
	mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	thp := err == nil && !strings.Contains(string(mode), "[never]")
	for _, tt := range []struct {
		name string
		opts host.PrivateOptions
		huge bool
	}{
		{"always", host.PrivateOptions{Granularity: g, AlwaysHugePages: true}, thp},
		{"populate", host.PrivateOptions{Granularity: g, Populate: true, AlwaysHugePages: true}, thp},
		{"off", host.PrivateOptions{Granularity: g, NoHugePages: true}, false},
		{"small granule", host.PrivateOptions{Granularity: 64 << 10}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := newPrivate(t, tt.opts)
			st := p.Stats()
			assert.Equal(t, tt.opts.Granularity, st.Granule)
			require.Equal(t, tt.huge, st.HugePages, "why not: %s", st.NoHugePages)
			assert.Equal(t, tt.huge, st.NoHugePages == "", "a fallback says why: %q", st.NoHugePages)
			assert.Zero(t, st.HugeRefused)
			const n = 4
			size := n * p.Granularity()
			r, err := p.Reserve(size + p.Granularity())
			require.NoError(t, err)
			defer p.Unreserve(r)
			require.NoError(t, p.Commit(r, 0, size))
			if !tt.opts.Populate {
				mem := host.PrivateBytes(p.Base(r), size)
				for i := 0; i < size; i += 4096 {
					mem[i] = 1
				}
			}
			hb, err := p.HugePages(r)
			require.NoError(t, err)
			assert.Zero(t, hb.Shmem)
			assert.LessOrEqual(t, hb.Anon, int64(size))
			assert.Zero(t, hb.Anon%g, "whole huge pages only")
			if tt.huge {
				assert.Positive(t, hb.Anon, "no granule got a huge page")
				t.Logf("%d of %d committed bytes in huge pages", hb.Anon, size)
			} else {
				assert.Zero(t, hb.Anon)
			}
			require.NoError(t, p.Decommit(r, 0, size))
			hb, err = p.HugePages(r)
			require.NoError(t, err)
			assert.Zero(t, hb.Anon, "decommitted memory holds no huge page")
		})
	}
}

// TestPrivateHugePagesAuto: by default a 2 MiB granule asks for huge pages unless the
// system says no, and then the stats say why (the mode, or a guest that reports its
// free memory to the host).
func TestPrivateHugePagesAuto(t *testing.T) {
	p := newPrivate(t, host.PrivateOptions{Granularity: 2 << 20})
	st := p.Stats()
	t.Logf("huge pages %v (%s)", st.HugePages, st.NoHugePages)
	assert.Equal(t, st.HugePages, st.NoHugePages == "")
	if always := newPrivate(t, host.PrivateOptions{Granularity: 2 << 20, AlwaysHugePages: true}); always.Stats().HugePages {
		assert.True(t, st.HugePages || strings.Contains(st.NoHugePages, "reports free"),
			"only a reporting guest turns them off by default: %s", st.NoHugePages)
	}
}

// TestHugeShare: the part of a mapping's huge pages inside a reservation is in
// proportion, also for mappings of many GiB, where n*in overflows 64 bits.
func TestHugeShare(t *testing.T) {
	const gib = 1 << 30
	for _, tt := range []struct {
		n         int64
		in, total uint64
		want      int64
	}{
		{2 << 20, 1 << 20, 4 << 20, 512 << 10},
		{0, 1 << 20, 4 << 20, 0},
		{8 * gib, 4 * gib, 8 * gib, 4 * gib},       // n*in = 2^66
		{6 * gib, 3 * gib, 12 * gib, 3 * gib / 2},  // n*in = 1.6e19
		{16 * gib, 2 * gib, 8 * gib, 2 * gib},      // more than the mapping: clamped
		{-1, 1 << 20, 4 << 20, 0},                  // never negative
		{1 << 62, 1 << 62, 3 << 62, (1 << 62) / 3}, // near the top of uint64
	} {
		got := host.HugeShare(tt.n, tt.in, tt.total)
		assert.Equal(t, tt.want, got, "hugeShare(%d, %d, %d)", tt.n, tt.in, tt.total)
	}
}

func TestPrivateHugePagesBadInput(t *testing.T) {
	p := newPrivate(t, host.PrivateOptions{})
	q := newPrivate(t, host.PrivateOptions{})
	r, err := q.Reserve(q.Granularity())
	require.NoError(t, err)
	_, err = p.HugePages(r)
	assert.ErrorIs(t, err, backing.ErrForeignReservation)
	_, err = p.HugePages(nil)
	assert.ErrorIs(t, err, backing.ErrForeignReservation)
	require.True(t, q.Unreserve(r).OK())
	assert.PanicsWithValue(t, backing.PanicUseAfterUnreserve, func() { _, _ = q.HugePages(r) })
	empty, err := p.Reserve(0)
	require.NoError(t, err)
	hb, err := p.HugePages(empty)
	require.NoError(t, err)
	assert.Zero(t, hb)
}

// vmFlags returns the VmFlags of the mapping at addr in /proc/self/smaps ("nh":
// MADV_NOHUGEPAGE, "hg": MADV_HUGEPAGE).
func vmFlags(t *testing.T, addr uintptr) []string {
	t.Helper()
	ms := testutil.Overlapping(testutil.Smaps(t), addr, addr+1)
	require.Len(t, ms, 1, "the mappings that contain %#x", addr)
	require.NotEmpty(t, ms[0].VmFlags, "VmFlags of the mapping at %#x", addr)
	return ms[0].VmFlags
}

// TestPrivateSmallRefusesHuge: a Private backing that does not ask for huge pages
// (the option, a granule that is no multiple of the huge page) refuses them on its
// reservations (MADV_NOHUGEPAGE) where THP is "always" (forced here, whatever the
// system's mode), so that what PrivateStats says is what the kernel does; where it
// is not, it advises nothing. Either way its committed memory holds no huge page.
func TestPrivateSmallRefusesHuge(t *testing.T) {
	sysAlways := host.HugeAnonMode() == "always"
	for _, tt := range []struct {
		name string
		opts host.PrivateOptions
	}{
		{"off", host.PrivateOptions{Granularity: 2 << 20, NoHugePages: true}},
		{"small granule", host.PrivateOptions{Granularity: 64 << 10}},
	} {
		for _, always := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/always=%v", tt.name, always), func(t *testing.T) {
				p := newPrivate(t, tt.opts)
				require.False(t, p.Stats().HugePages)
				host.SetPrivateSmallTHP(p, always)
				const size = 4 << 20
				r, err := p.Reserve(size)
				require.NoError(t, err)
				defer p.Unreserve(r)
				base := p.Base(r)
				flags := vmFlags(t, base)
				if always || sysAlways {
					assert.Contains(t, flags, "nh", "the reservation refuses huge pages")
				} else {
					assert.NotContains(t, flags, "nh", "nothing advised")
				}
				assert.NotContains(t, flags, "hg")
				assert.Equal(t, flags, vmFlags(t, base+size-1), "one mapping")
				require.NoError(t, p.Commit(r, 0, size))
				mem := host.PrivateBytes(base, size)
				for i := 0; i < size; i += 4096 {
					mem[i] = 1
				}
				hb, err := p.HugePages(r)
				require.NoError(t, err)
				assert.Zero(t, hb.Anon, "small pages, as the stats say")
				assert.Zero(t, p.Stats().HugeRefused)
			})
		}
	}
}
