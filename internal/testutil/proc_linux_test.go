package testutil_test

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/internal/testutil"
)

// mapped maps three pages of anonymous memory, the first written, the second
// read-only, between two inaccessible guard pages (so that no neighbour merges with
// them), and unmaps them at cleanup.
func mapped(t *testing.T) (base uintptr, page int) {
	page = os.Getpagesize()
	b, err := unix.Mmap(-1, 0, 5*page, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Munmap(b)) })
	require.NoError(t, unix.Mprotect(b[page:4*page], unix.PROT_READ|unix.PROT_WRITE))
	require.NoError(t, unix.Mprotect(b[2*page:3*page], unix.PROT_READ))
	b[page] = 1 // resident
	return uintptr(unsafe.Pointer(&b[page])), page
}

func TestMaps(t *testing.T) {
	base, page := mapped(t)
	ms := testutil.Overlapping(testutil.Maps(t), base, base+uintptr(3*page))
	require.Len(t, ms, 3, "the read-only page splits the mapping in three")
	assert.Equal(t, base, ms[0].Lo)
	assert.Equal(t, base+uintptr(page), ms[0].Hi)
	assert.Equal(t, []string{"rw-p", "r--p", "rw-p"}, []string{ms[0].Perms, ms[1].Perms, ms[2].Perms})
	assert.Zero(t, ms[1].Inode, "anonymous")
	assert.Empty(t, ms[1].Path, "anonymous")
	assert.Contains(t, ms[1].Line, "r--p")
	assert.True(t, ms[1].Overlaps(base+uintptr(page), base+uintptr(page)+1))
	assert.False(t, ms[1].Overlaps(base, base+uintptr(page)), "[Lo, Hi) is half open")

	name := fmt.Sprintf("testutil-%d", os.Getpid())
	fd, err := unix.MemfdCreate(name, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, int64(page)))
	assert.Empty(t, testutil.MapsWith(t, "/memfd:"+name+" "))
	b, err := unix.Mmap(fd, 0, page, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	lines := testutil.MapsWith(t, "/memfd:"+name+" ")
	require.NoError(t, unix.Munmap(b))
	require.Len(t, lines, 1, "the memfd's one mapping")
	assert.Contains(t, lines[0], " r--s ")

	exe, err := os.Executable()
	require.NoError(t, err)
	assert.True(t, slices.ContainsFunc(testutil.Maps(t), func(m testutil.Mapping) bool {
		return m.Path == exe && m.Inode != 0 && m.Perms == "r-xp"
	}), "the test binary's text is mapped from its file")
}

func TestSmaps(t *testing.T) {
	base, page := mapped(t)
	ms := testutil.Overlapping(testutil.Smaps(t), base, base+uintptr(3*page))
	require.Len(t, ms, 3)
	assert.Equal(t, int64(page), ms[0].Sizes["Rss"], "the written page is resident")
	assert.Equal(t, int64(page), ms[0].Sizes["Size"])
	assert.Zero(t, ms[2].Sizes["Rss"], "the last page was never touched")
	assert.Contains(t, ms[0].VmFlags, "wr")
	assert.NotContains(t, ms[1].VmFlags, "wr", "the read-only page")
}

func TestTouch(t *testing.T) {
	base, page := mapped(t)
	assert.NoError(t, testutil.Touch(base, true))
	assert.NoError(t, testutil.Touch(base+uintptr(page), false), "a read-only page reads")
	err := testutil.Touch(base+uintptr(page)+5, true)
	require.Error(t, err, "and faults on a write")
	var a interface{ Addr() uintptr }
	require.True(t, errors.As(err, &a))
	assert.Equal(t, base+uintptr(page)+5, a.Addr(), "the fault names the address")
}

func TestStatus(t *testing.T) {
	assert.NotZero(t, testutil.Status(t, "VmData"))
	assert.NotZero(t, testutil.Status(t, "VmRSS"))
	r := &recorder{TB: t}
	assert.Zero(t, testutil.Status(r, "VmNoSuchField"))
	assert.Equal(t, []string{"Fatalf: no VmNoSuchField in /proc/self/status"}, r.calls)
}

// ThreadCPU counts this thread's work, and not its sleep.
func TestThreadCPU(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const work = 20 * time.Millisecond
	t0 := testutil.ThreadCPU(t)
	time.Sleep(50 * time.Millisecond)
	assert.Less(t, testutil.ThreadCPU(t)-t0, work.Nanoseconds(), "a sleep takes (almost) no CPU time")
	t1 := testutil.ThreadCPU(t)
	for start := time.Now(); testutil.ThreadCPU(t)-t1 < work.Nanoseconds(); {
		require.Less(t, time.Since(start), testutil.Timeout, "spinning never took %v of CPU time", work)
	}
}
