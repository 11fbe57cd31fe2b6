package host_test

import (
	"bytes"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

// Exhaustion: the OS refuses memory (a resource limit) or mappings (vm.max_map_count)
// for real. Each test runs in a child process, since at the limit the runtime itself
// could fail to map, and a limit once lowered stays with the process.

const exhaustEnv = "VMARENA_HOST_EXHAUST_CHILD"

// inChild reports whether this process is the child that runs t's body. In the
// parent it re-executes the test binary to run t alone with exhaustEnv set, checks
// that the child passed, and returns false.
func inChild(t *testing.T) bool {
	t.Helper()
	if os.Getenv(exhaustEnv) == t.Name() {
		return true
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), exhaustEnv+"="+t.Name())
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "child:\n%s", out)
	require.Contains(t, string(out), "--- PASS: "+t.Name(), "child:\n%s", out)
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, ".go:") && !strings.HasPrefix(strings.TrimSpace(line), "---") {
			t.Log(strings.TrimSpace(line)) // the child's t.Log lines
		}
	}
	return false
}

// lowerLimit sets the soft limit of resource to cur, keeping the hard limit, and
// returns a function that restores it.
func lowerLimit(t *testing.T, resource int, cur uint64) (restore func()) {
	t.Helper()
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(resource, &old))
	require.Less(t, cur, old.Cur, "the limit must go down")
	require.NoError(t, unix.Setrlimit(resource, &unix.Rlimit{Cur: cur, Max: old.Max}))
	return func() { require.NoError(t, unix.Setrlimit(resource, &old)) }
}

// exhaustSlack is what the runtime (and, under -race, its shadow memory) may still
// map while a limit is lowered: a few heap arenas.
const exhaustSlack = 512 << 20

// A commit that the kernel refuses for lack of memory fails with ErrOutOfMemory and
// ENOMEM, commits nothing and loses nothing: on Private, commit makes pages writable,
// which RLIMIT_DATA bounds; its reserve maps address space, which RLIMIT_AS bounds.
func TestPrivateOutOfMemoryRlimit(t *testing.T) {
	if !inChild(t) {
		return
	}
	const mib = 1 << 20
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: mib})
	require.NoError(t, err)
	r, err := p.Reserve(4 << 30)
	require.NoError(t, err)
	require.NoError(t, p.Commit(r, 0, 16*mib))
	mark := bytes.Repeat([]byte("kept"), 1024)
	require.NoError(t, p.CopyIn(r, 16*mib-len(mark), mark))

	restore := lowerLimit(t, unix.RLIMIT_DATA, testutil.Status(t, "VmData")+exhaustSlack)
	err = p.Commit(r, 16*mib, 2<<30)
	restore()
	require.Error(t, err, "2 GiB more writable memory than RLIMIT_DATA allows")
	t.Logf("commit under RLIMIT_DATA: %v", err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, unix.ENOMEM)
	assert.NotErrorIs(t, err, backing.ErrMapLimit, "far from vm.max_map_count")
	var op *backing.OpError
	require.ErrorAs(t, err, &op)
	assert.Equal(t, "commit", op.Op)
	assert.Equal(t, 16*mib, op.Offset)
	for _, off := range []int{16 * mib, 1 << 30, 16*mib + 2<<30 - mib} {
		assert.ErrorIs(t, p.Decommit(r, off, mib), backing.ErrNotCommitted, "nothing committed at %#x", off)
	}
	got := make([]byte, len(mark))
	require.NoError(t, p.CopyOut(got, r, 16*mib-len(mark)))
	assert.Equal(t, mark, got, "what was committed before is intact")
	require.NoError(t, p.Commit(r, 16*mib, 2<<30), "the same commit within the limit")

	restore = lowerLimit(t, unix.RLIMIT_AS, testutil.Status(t, "VmSize")+exhaustSlack)
	r2, err := p.Reserve(4 << 30)
	restore()
	if !assert.Error(t, err, "4 GiB more address space than RLIMIT_AS allows") {
		p.Unreserve(r2)
	}
	t.Logf("reserve under RLIMIT_AS: %v", err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, unix.ENOMEM)
	require.ErrorAs(t, err, &op)
	assert.Equal(t, "reserve", op.Op)

	o := p.Unreserve(r)
	assert.True(t, o.OK(), "%v", o)
	assert.Equal(t, int64(16*mib+2<<30), o.Unmapped)
}

// The same on Shared, whose granules live in a memfd mapped in the park (address
// space of its own, doubling with the file): a commit that needs more of it than
// RLIMIT_AS allows fails with ErrOutOfMemory, charges nothing and loses nothing.
func TestSharedOutOfMemoryRlimit(t *testing.T) {
	if !inChild(t) {
		return
	}
	const g = 2 << 20
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	name := memfdName()
	s, err := host.NewShared(memfdOpts(host.SharedOptions{Granularity: g, Authority: auth, Name: name}))
	require.NoError(t, err)
	a, err := s.Reserve(8 * g)
	require.NoError(t, err)
	require.NoError(t, s.Commit(a, 0, 8*g))
	mark := bytes.Repeat([]byte("kept"), 1024)
	require.NoError(t, s.CopyIn(a, 5*g-10, mark))
	// Commits that need more address space than the slack: the file, and with it the
	// park, must grow well past what exists.
	const big = 4 << 30
	b, err := s.Reserve(big)
	require.NoError(t, err)
	books := func(what string, owned, mapped int64) {
		t.Helper()
		ps := s.PoolStats()
		as := auth.Stats()
		assert.Equal(t, owned, as.Owned, "%s: ledger owned", what)
		assert.Equal(t, mapped, as.Mapped, "%s: ledger mapped", what)
		assert.Equal(t, ps.Owned, as.Owned, "%s: pool owned vs ledger", what)
		assert.Equal(t, ps.Mapped, as.Mapped, "%s: pool mapped vs ledger", what)
		assert.Equal(t, as.Owned, gov.Stats(accounting.HostKey).Used, "%s: governor", what)
	}
	books("before", 8*g, 8*g)

	restore := lowerLimit(t, unix.RLIMIT_AS, testutil.Status(t, "VmSize")+exhaustSlack)
	err = s.Commit(b, 0, big)
	restore()
	require.Error(t, err, "a 4 GiB commit needs more address space than RLIMIT_AS leaves")
	t.Logf("commit under RLIMIT_AS: %v", err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, unix.ENOMEM)
	assert.NotErrorIs(t, err, backing.ErrMapLimit, "far from vm.max_map_count")
	var op *backing.OpError
	require.ErrorAs(t, err, &op)
	assert.Equal(t, "commit", op.Op)
	books("after the refused commit", 8*g, 8*g)
	for _, off := range []int{0, big / 2, big - g} {
		assert.ErrorIs(t, s.Decommit(b, off, g), backing.ErrNotCommitted, "nothing committed at %#x", off)
	}
	got := make([]byte, len(mark))
	require.NoError(t, s.CopyOut(got, a, 5*g-10))
	assert.Equal(t, mark, got, "what was committed before is intact")
	require.NoError(t, s.Share(b, 0, a, 0, 8*g, backing.ReadOnly), "the backing still works")
	require.NoError(t, s.CopyOut(got, b, 5*g-10))
	assert.Equal(t, mark, got)
	books("shared", 8*g, 16*g)

	assert.True(t, s.Unreserve(b).OK())
	assert.True(t, s.Unreserve(a).OK())
	require.NoError(t, s.Close())
	books("closed", 0, 0)
	assert.Empty(t, testutil.MapsWith(t, "memfd:"+name+" "), "no mapping left")
}

// quietRuntime readies the process for its mapping limit, where any mapping the
// runtime makes is fatal ("runtime: out of memory"): it grows the heap well beyond
// what the caller will allocate and frees it, so that allocations reuse mapped pages;
// turns the GC off, so that nothing is scavenged or shrunk and needed again; turns
// heap profiling off, whose records are mapped apart; and grows the calling
// goroutine's stack, which would otherwise grow into new heap pages. Under -race the
// sanitizer also records the blocks made and freed. restore undoes the settings.
func quietRuntime() (restore func()) {
	rate := runtime.MemProfileRate
	runtime.MemProfileRate = 0
	junk := make([][]byte, 1<<19)
	for i := range junk {
		junk[i] = make([]byte, 64)
	}
	runtime.KeepAlive(junk)
	junk = nil
	runtime.GC()
	runtime.GC()
	gc := debug.SetGCPercent(-1)
	growStack(8)
	return func() {
		debug.SetGCPercent(gc)
		runtime.MemProfileRate = rate
	}
}

// growStack uses some 512 KiB of stack.
//
//go:noinline
func growStack(n int) byte {
	var frame [64 << 10]byte
	frame[n] = byte(n)
	if n > 0 {
		return growStack(n-1) + frame[n]
	}
	return frame[0]
}

// Shared at the real vm.max_map_count: committing every other granule splits the
// reservation's mapping each time until the kernel refuses one more. That commit
// fails with ErrMapLimit (and ENOMEM) naming the limit, charges nothing and commits
// nothing; everything committed before reads back and is given back exactly.
//
// Not under -race: the race detector's runtime maps memory of its own at any time
// and aborts the process when the kernel refuses (.ci/run runs this test without it).
func TestSharedMapLimitReal(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector aborts the process at the mapping limit; run without -race")
	}
	if !inChild(t) {
		return
	}
	raw, err := os.ReadFile("/proc/sys/vm/max_map_count")
	require.NoError(t, err)
	limit, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	require.NoError(t, err)
	if limit > 1<<20 {
		t.Skipf("vm.max_map_count is %d: reaching it would take %d commits", limit, limit/2)
	}
	g := os.Getpagesize()
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	name := memfdName()
	s, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: auth, Name: name, High: host.SharedNoPool})
	require.NoError(t, err)
	n := 2*limit + 16
	r, err := s.Reserve(n * g)
	require.NoError(t, err)
	defer quietRuntime()()
	committed := 0
	var cerr error
	for i := 1; i < n; i += 2 {
		if cerr = s.Commit(r, i*g, g); cerr != nil {
			assert.ErrorIs(t, s.Decommit(r, i*g, g), backing.ErrNotCommitted, "the failed commit changed nothing")
			break
		}
		// Each granule says where it is, to check nothing was lost at the end.
		require.NoError(t, s.CopyIn(r, i*g, []byte(strconv.Itoa(i))))
		committed++
	}
	require.Error(t, cerr, "%d scattered commits never hit vm.max_map_count=%d", committed, limit)
	t.Logf("%d commits, then: %v", committed, cerr)
	assert.ErrorIs(t, cerr, backing.ErrMapLimit)
	assert.ErrorIs(t, cerr, unix.ENOMEM)
	assert.NotErrorIs(t, cerr, backing.ErrOutOfMemory, "the limit is on mappings, not memory")
	assert.Contains(t, cerr.Error(), "vm.max_map_count")
	assert.Greater(t, committed, limit/4, "the limit came early")
	as := auth.Stats()
	assert.Equal(t, int64(committed*g), as.Owned, "the ledger owns exactly the committed granules")
	assert.Equal(t, int64(committed*g), as.Mapped)
	assert.Equal(t, as.Owned, s.PoolStats().Owned)
	buf := make([]byte, 8)
	for i := 1; i < 2*committed; i += 2 {
		want := strconv.Itoa(i)
		require.NoError(t, s.CopyOut(buf[:len(want)], r, i*g))
		if string(buf[:len(want)]) != want {
			assert.Failf(t, "a granule lost its contents", "granule %d reads %q", i, buf[:len(want)])
			break
		}
	}
	o := s.Unreserve(r)
	assert.True(t, o.OK(), "%v", o)
	assert.Equal(t, int64(committed*g), o.Unmapped)
	require.NoError(t, s.Close())
	assert.Zero(t, auth.Stats().Owned)
	assert.Empty(t, testutil.MapsWith(t, "memfd:"+name+" "), "no mapping left")
}
