package host_test

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/windows"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
)

const kib64 = 64 << 10

// newWinShared returns a Shared backing with opts (Authority filled in) and its
// authority. Under a Wine that does not implement placeholders (8.0; 10.0 does), the
// backing runs on emulated ones (see host.EmulatePlaceholders); anywhere else a refusal fails the
// test. At cleanup it checks the
// bookkeeping, closes the backing and checks that the authority holds nothing.
func newWinShared(t *testing.T, opts host.SharedOptions) (*host.Shared, *accounting.Authority) {
	t.Helper()
	auth := accounting.NewGovernor().Authority("shared", accounting.HostKey)
	opts.Authority = auth
	s, err := host.NewShared(opts)
	if errors.Is(err, errors.ErrUnsupported) {
		s, err = underWine(t, err, opts)
	}
	require.NoError(t, err)
	t.Cleanup(func() {
		host.SharedWaitRefill(s)
		assert.NoError(t, host.CheckShared(s), "bookkeeping at cleanup")
		assert.NoError(t, host.SharedFileCheck(s), "sections at cleanup")
		if assert.NoError(t, s.Close()) {
			st := auth.Stats()
			assert.Zero(t, st.Owned, "owned bytes after Close")
			assert.Zero(t, st.Mapped, "mapped bytes after Close")
		}
	})
	return s, auth
}

// TestSharedConformanceWindows runs the conformance suite on the Windows shared
// backing.
func TestSharedConformanceWindows(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts host.SharedOptions
	}{
		{"granule=2MiB", host.SharedOptions{}},
		{"granule=64KiB", host.SharedOptions{Granularity: kib64}},
		{"populate", host.SharedOptions{Granularity: kib64, Populate: true}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			backingtest.Run(t, func(t *testing.T) backing.Backing[*host.SharedReservation] {
				s, _ := newWinShared(t, tt.opts)
				return s
			})
		})
	}
}

// FuzzSharedOpsWindows runs the random-op driver every backing shares
// (backingtest.RunOps) on a 64 KiB-granule Shared backing with a small pool: the
// seed corpus, and 64 pseudo-random sequences (fixed seeds), since fuzzing itself
// is not run under Wine.
func FuzzSharedOpsWindows(f *testing.F) {
	for _, s := range backingtest.SeedOps() {
		f.Add(s)
	}
	rng := rand.New(rand.NewPCG(15, 64))
	for range 64 {
		ops := make([]byte, 16+rng.IntN(112))
		for i := range ops {
			ops[i] = byte(rng.Uint32())
		}
		f.Add(ops)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		s, _ := newWinShared(t, host.SharedOptions{Granularity: kib64, High: 2})
		backingtest.RunOps(t, s, ops)
	})
}

// region is one region of the address space as VirtualQuery reports it.
type region struct {
	size  int
	state uint32 // MEM_RESERVE: a placeholder; MEM_COMMIT: a view
	prot  uint32
}

// regions returns the regions of [base, base+size).
func regions(t *testing.T, base uintptr, size int) []region {
	t.Helper()
	var out []region
	for at := base; at < base+uintptr(size); {
		var mbi windows.MemoryBasicInformation
		require.NoError(t, windows.VirtualQuery(at, &mbi, 48))
		n := min(int(mbi.BaseAddress+mbi.RegionSize-at), int(base+uintptr(size)-at))
		out = append(out, region{size: n, state: mbi.State, prot: mbi.Protect})
		at += uintptr(n)
	}
	return out
}

// TestSharedPlaceholders: a commit cuts each granule's view out of the
// reservation's placeholder, and a decommit merges the freed placeholder with its
// free neighbours again, so that the reservation is one placeholder once nothing is
// committed. VirtualQuery shows each placeholder and view as a region of its own.
func TestSharedPlaceholders(t *testing.T) {
	s, _ := newWinShared(t, host.SharedOptions{Granularity: kib64})
	g := s.Granularity()
	r, err := s.Reserve(5 * g)
	require.NoError(t, err)
	defer s.Unreserve(r)
	base := s.Base(r)
	ph := func(n int) region { return region{n * g, windows.MEM_RESERVE, 0} } // reserved: no protection
	view := func(prot uint32) region { return region{g, windows.MEM_COMMIT, prot} }
	rw, ro := uint32(windows.PAGE_READWRITE), uint32(windows.PAGE_READONLY)
	assert.Equal(t, []region{ph(5)}, regions(t, base, 5*g))

	require.NoError(t, s.Commit(r, g, g))
	require.NoError(t, s.Commit(r, 3*g, g))
	assert.Equal(t, []region{ph(1), view(rw), ph(1), view(rw), ph(1)}, regions(t, base, 5*g))
	require.NoError(t, s.Commit(r, 2*g, g))
	assert.Equal(t, []region{ph(1), view(rw), view(rw), view(rw), ph(1)}, regions(t, base, 5*g))

	require.NoError(t, s.Decommit(r, 2*g, g))
	assert.Equal(t, []region{ph(1), view(rw), ph(1), view(rw), ph(1)}, regions(t, base, 5*g))
	require.NoError(t, s.Decommit(r, g, g))
	assert.Equal(t, []region{ph(3), view(rw), ph(1)}, regions(t, base, 5*g), "merged with both neighbours")

	x, err := s.Reserve(2 * g)
	require.NoError(t, err)
	require.NoError(t, s.Share(x, g, r, 3*g, g, backing.ReadOnly))
	assert.Equal(t, []region{ph(1), view(ro)}, regions(t, s.Base(x), 2*g), "a read-only sharer maps PAGE_READONLY")
	o := s.Unreserve(x)
	require.Equal(t, accounting.Complete, o.Status, "%v", o)

	require.NoError(t, s.Decommit(r, 3*g, g))
	assert.Equal(t, []region{ph(5)}, regions(t, base, 5*g), "one placeholder again")
}

// TestSharedWindowsPool: a granule shared between two reservations is one section:
// a write through one shows through the other; decommitted, it waits in the pool
// with its contents and the next commit takes it; Trim closes it.
func TestSharedWindowsPool(t *testing.T) {
	s, auth := newWinShared(t, host.SharedOptions{Granularity: kib64})
	g := s.Granularity()
	r, err := s.Reserve(2 * g)
	require.NoError(t, err)
	x, err := s.Reserve(g)
	require.NoError(t, err)
	require.NoError(t, s.Commit(r, 0, g))
	require.NoError(t, s.Share(x, 0, r, 0, g, backing.ReadWrite))
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], 0xabcd)
	require.NoError(t, s.CopyIn(x, 8, b[:]))
	var got [8]byte
	require.NoError(t, s.CopyOut(got[:], r, 8))
	assert.Equal(t, b, got, "one section behind both views")
	st := auth.Stats()
	assert.Equal(t, int64(g), st.Owned)
	assert.Equal(t, int64(2*g), st.Mapped)

	require.Equal(t, accounting.Complete, s.Unreserve(x).Status)
	require.NoError(t, s.Decommit(r, 0, g))
	assert.Equal(t, int64(g), s.PoolStats().Idle)
	require.NoError(t, s.Commit(r, g, g))
	require.NoError(t, s.CopyOut(got[:], r, g+8))
	assert.Equal(t, b, got, "the pooled granule keeps its contents")
	require.NoError(t, s.Decommit(r, g, g))
	n, err := s.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, int64(g), n)
	assert.Zero(t, auth.Stats().Owned)
	require.NoError(t, s.Prefill(2))
	assert.Equal(t, int64(2*g), s.PoolStats().Resident)
	require.Equal(t, accounting.Complete, s.Unreserve(r).Status)
}

// TestSharedWindowsGranularity: granules below the 64 KiB allocation granularity
// are refused, since a view can not start between its steps.
func TestSharedWindowsGranularity(t *testing.T) {
	auth := accounting.NewGovernor().Authority("shared", accounting.HostKey)
	s, err := host.NewShared(host.SharedOptions{Authority: auth, Granularity: 32 << 10})
	assert.Nil(t, s)
	assert.ErrorIs(t, err, host.ErrSharedOptions)
	assert.ErrorContains(t, err, "allocation granularity")
}

// underWine handles NewShared's refusal err of the options opts: under a Wine that
// does not implement placeholders (8.0), it checks that err says so and returns a backing
// on emulated placeholders (see newWinShared); on Windows itself it returns err.
func underWine(t *testing.T, err error, opts host.SharedOptions) (*host.Shared, error) {
	t.Helper()
	v := host.WineVersion()
	if v == "" {
		return nil, err
	}
	assert.ErrorContains(t, err, "placeholders", "under Wine %s", v)
	t.Logf("under Wine %s, which does not implement placeholders (%v): emulating them", v, err)
	host.EmulatePlaceholders(t)
	return host.NewShared(opts)
}
