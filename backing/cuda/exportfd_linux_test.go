package cuda_test

import (
	"bytes"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// Export and import of granules (export.go) on the fake driver, within one process:
// each Backing has a fake driver of its own, so the two stand for two processes that
// share nothing but the descriptors (memfds, in the fake). The test across two real
// processes is in exportproc_linux_test.go.

// pattern returns n bytes drawn from seed.
func pattern(seed uint64, n int) []byte {
	p := make([]byte, n)
	var key [32]byte
	key[0] = byte(seed)
	_, _ = rand.NewChaCha8(key).Read(p) // never fails
	return p
}

// openFDs counts this process's open descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(es)
}

// closeAll closes descriptors a test was given.
func closeAll(t testing.TB, fds []int) {
	t.Helper()
	for _, fd := range fds {
		require.NoError(t, unix.Close(fd))
	}
}

// exporter returns a Backing with Options.Exportable on a fake driver of its own,
// and a reservation of n granules, all committed and filled from seed.
func exporter(t *testing.T, n int, seed uint64) (*fx, *cuda.Reservation) {
	t.Helper()
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{Exportable: true})
	r := x.reserve(t, n)
	require.NoError(t, x.b.Commit(r, 0, n*x.g))
	require.NoError(t, x.b.CopyIn(r, 0, pattern(seed, n*x.g)))
	return x, r
}

func TestExportImport(t *testing.T) {
	a, ra := exporter(t, 3, 1)
	g := a.g
	fdsBefore := openFDs(t)
	fds, err := a.b.Export(ra, 0, 3*g)
	require.NoError(t, err)
	require.Len(t, fds, 3)
	assert.Equal(t, fdsBefore+3, openFDs(t), "one new descriptor per granule")

	// B maps them at granules 1..3 of a reservation of its own: the bytes are A's.
	b := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{Exportable: true})
	rb := b.reserve(t, 4)
	require.NoError(t, b.b.Import(rb, g, fds, backing.ReadWrite))
	closeAll(t, fds) // the caller's; the mappings do not need them
	got := make([]byte, 3*g)
	require.NoError(t, b.b.CopyOut(got, rb, g))
	assert.True(t, bytes.Equal(pattern(1, 3*g), got), "B reads A's bytes")

	// Mapped, not owned: B's ledger and pool own nothing, and its driver's memory is
	// A's (UsedMemory counts no import).
	assert.Zero(t, b.auth.Stats().Owned)
	assert.EqualValues(t, 3*g, b.auth.Stats().Mapped)
	assert.Zero(t, b.b.PoolStats().Owned)
	assert.EqualValues(t, 3*g, b.b.PoolStats().Mapped)
	assert.Zero(t, b.f.UsedMemory(0))
	assert.Equal(t, 3, b.f.LiveHandles())

	// A write through B reads back through A, and the other way.
	require.NoError(t, b.b.CopyIn(rb, 2*g+5, []byte("from B")))
	seen := make([]byte, 6)
	require.NoError(t, a.b.CopyOut(seen, ra, g+5))
	assert.Equal(t, "from B", string(seen))
	require.NoError(t, a.b.CopyIn(ra, 3*g-3, []byte("A!!")))
	require.NoError(t, b.b.CopyOut(seen[:3], rb, 4*g-3))
	assert.Equal(t, "A!!", string(seen[:3]))

	// B shares an imported granule within itself, read-only; it can not export it.
	rb2 := b.reserve(t, 1)
	require.NoError(t, b.b.Share(rb2, 0, rb, g, g, backing.ReadOnly))
	require.NoError(t, b.b.CopyOut(seen[:3], rb2, 0))
	assert.Equal(t, pattern(1, 3), seen[:3])
	_, err = b.b.Export(rb, g, g)
	assert.ErrorIs(t, err, cuda.ErrNotExportable)

	// A decommits: the exported handles are released, not pooled (B maps them still),
	// and A's ledger gives their bytes back. B still reads them.
	require.NoError(t, a.b.Decommit(ra, 0, 3*g))
	assert.Zero(t, a.b.PoolStats().Idle, "an exported handle never returns to the pool")
	assert.Zero(t, a.b.PoolStats().Owned)
	assert.Zero(t, a.auth.Stats().Owned)
	assert.Zero(t, a.f.UnreleasedHandles())
	require.NoError(t, b.b.CopyOut(got, rb, g))
	assert.Equal(t, "from B", string(got[g+5:g+11]))

	// B gives its mappings back: the imported handles are released with the last.
	require.NoError(t, b.b.Decommit(rb, g, g))
	assert.Equal(t, 3, b.f.LiveHandles(), "granule 1 is still shared into rb2")
	require.True(t, b.b.Unreserve(rb2).OK())
	require.True(t, b.b.Unreserve(rb).OK())
	assert.Zero(t, b.f.LiveHandles())
	assert.Zero(t, b.auth.Stats().Mapped)
	assert.Zero(t, b.b.PoolStats().Mapped)
	assert.Equal(t, fdsBefore-3, openFDs(t), "the memfds went with the last handle and mapping in each process")

	// A granule that was never exported still goes back to A's pool.
	require.NoError(t, a.b.Commit(ra, 0, g))
	require.NoError(t, a.b.Decommit(ra, 0, g))
	assert.EqualValues(t, g, a.b.PoolStats().Idle)
	require.True(t, a.b.Unreserve(ra).OK())
}

func TestImportReadOnly(t *testing.T) {
	a, ra := exporter(t, 2, 2)
	g := a.g
	fds, err := a.b.Export(ra, 0, 2*g)
	require.NoError(t, err)
	defer closeAll(t, fds)
	b := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	rb := b.reserve(t, 2)
	defer func() { assert.True(t, b.b.Unreserve(rb).OK()) }()
	require.NoError(t, b.b.Import(rb, 0, fds, backing.ReadOnly))
	access, ok := b.f.MappingAccess(uint64(b.b.Base(rb)))
	require.True(t, ok)
	assert.Equal(t, int32(cuda.AccessRead), access)
	assert.ErrorIs(t, b.b.CopyIn(rb, 0, []byte{1}), backing.ErrReadOnly)
	assert.ErrorIs(t, b.b.Protect(rb, 0, 2*g, backing.ReadWrite), backing.ErrReadOnly,
		"a granule imported read-only never becomes writable")
	got := make([]byte, 2*g)
	require.NoError(t, b.b.CopyOut(got, rb, 0))
	assert.True(t, bytes.Equal(pattern(2, 2*g), got))
	require.True(t, a.b.Unreserve(ra).OK())
}

func TestExportErrors(t *testing.T) {
	a, ra := exporter(t, 2, 3)
	g := a.g
	plain := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	rp := plain.reserve(t, 1)
	require.NoError(t, plain.b.Commit(rp, 0, g))
	other := a.reserve(t, 2)
	require.NoError(t, a.b.Commit(other, 0, g))
	// An imported granule, in an exportable Backing.
	fds, err := a.b.Export(ra, 0, g)
	require.NoError(t, err)
	imp := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{Exportable: true})
	ri := imp.reserve(t, 1)
	require.NoError(t, imp.b.Import(ri, 0, fds, backing.ReadWrite))
	closeAll(t, fds)

	before := openFDs(t)
	for _, tt := range []struct {
		name string
		b    *cuda.Backing
		r    *cuda.Reservation
		off  int
		size int
		want error
	}{
		{"backing not exportable", plain.b, rp, 0, g, cuda.ErrNotExportable},
		{"imported granule", imp.b, ri, 0, g, cuda.ErrNotExportable},
		{"not committed", a.b, other, 0, 2 * g, backing.ErrNotCommitted},
		{"out of range", a.b, ra, g, 2 * g, backing.ErrOutOfRange},
		{"misaligned", a.b, ra, 1, g, backing.ErrInvalidRange},
		{"negative", a.b, ra, -g, g, backing.ErrInvalidRange},
		{"foreign reservation", a.b, rp, 0, g, backing.ErrForeignReservation},
		{"nil reservation", a.b, nil, 0, g, backing.ErrForeignReservation},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fds, err := tt.b.Export(tt.r, tt.off, tt.size)
			assert.ErrorIs(t, err, tt.want)
			assert.Nil(t, fds)
		})
	}
	fds, err = a.b.Export(ra, g, 0)
	assert.NoError(t, err, "nothing to export")
	assert.Empty(t, fds)

	// The driver fails on the second granule: the first's descriptor is closed and
	// neither handle is marked exported (both go back to the pool).
	a.f.Fail("cuMemExportToShareableHandle", 2, cuda.CodeOutOfMemory)
	fds, err = a.b.Export(ra, 0, 2*g)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.Nil(t, fds)
	assert.Equal(t, before, openFDs(t), "no descriptor left open")
	require.NoError(t, a.b.Decommit(other, 0, g))
	idle := a.b.PoolStats().Idle
	require.NoError(t, a.b.Decommit(ra, g, g))
	assert.EqualValues(t, idle+int64(g), a.b.PoolStats().Idle, "a failed export marks nothing")

	require.True(t, imp.b.Unreserve(ri).OK())
	require.True(t, plain.b.Unreserve(rp).OK())
	require.True(t, a.b.Unreserve(other).OK())
	require.True(t, a.b.Unreserve(ra).OK())
	assert.Panics(t, func() { _, _ = a.b.Export(ra, 0, g) }, "use after Unreserve")
}

func TestImportErrors(t *testing.T) {
	a, ra := exporter(t, 2, 4)
	g := a.g
	good, err := a.b.Export(ra, 0, 2*g)
	require.NoError(t, err)
	defer closeAll(t, good)
	// An allocation of another size: a fake device with 4 MiB granules.
	big := fakeBacking(t, cudatest.FakeDriverOptions{Granularity: 2 * g}, cuda.Options{Exportable: true})
	rbig := big.reserve(t, 1)
	require.NoError(t, big.b.Commit(rbig, 0, 2*g))
	bigFDs, err := big.b.Export(rbig, 0, 2*g)
	require.NoError(t, err)
	defer closeAll(t, bigFDs)
	// Descriptors that are not exported allocations.
	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	defer closeAll(t, pipe[:])
	file, err := os.CreateTemp(t.TempDir(), "not-an-allocation")
	require.NoError(t, err)
	defer file.Close()
	require.NoError(t, file.Truncate(int64(g)))
	memfd, err := unix.MemfdCreate("another-program", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer closeAll(t, []int{memfd})
	require.NoError(t, unix.Ftruncate(memfd, int64(g)))
	const closed = 1<<20 - 1 // above any descriptor this test opens

	b := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	rb := b.reserve(t, 4)
	require.NoError(t, b.b.Commit(rb, 3*g, g))
	other := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	ro := other.reserve(t, 1)
	defer func() { assert.True(t, other.b.Unreserve(ro).OK()) }()
	for _, tt := range []struct {
		name string
		r    *cuda.Reservation
		off  int
		fds  []int
		prot backing.Protection
		want error // nil: any error
	}{
		{"negative descriptor", rb, 0, []int{-1}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"second descriptor negative", rb, 0, []int{good[0], -5}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"closed descriptor", rb, 0, []int{closed}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"pipe", rb, 0, []int{pipe[0]}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"plain file", rb, 0, []int{int(file.Fd())}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"another program's memfd", rb, 0, []int{memfd}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"second descriptor bad", rb, 0, []int{good[0], pipe[1]}, backing.ReadWrite, cuda.ErrBadDescriptor},
		{"allocation of another size", rb, 0, bigFDs, backing.ReadWrite, nil},
		{"range committed", rb, 2 * g, good, backing.ReadWrite, backing.ErrCommitted},
		{"out of range", rb, 3 * g, good, backing.ReadWrite, backing.ErrOutOfRange},
		{"misaligned", rb, 1, good, backing.ReadWrite, backing.ErrInvalidRange},
		{"negative offset", rb, -g, good, backing.ReadWrite, backing.ErrInvalidRange},
		{"unknown protection", rb, 0, good, backing.Protection(7), nil},
		{"foreign reservation", ro, 0, good[:1], backing.ReadWrite, backing.ErrForeignReservation},
		{"nil reservation", nil, 0, good[:1], backing.ReadWrite, backing.ErrForeignReservation},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := b.b.Import(tt.r, tt.off, tt.fds, tt.prot)
			require.Error(t, err)
			if tt.want != nil {
				assert.ErrorIs(t, err, tt.want)
			}
			// Nothing changed: only granule 3's own handle is live and mapped.
			assert.Equal(t, 1, b.f.LiveHandles(), "an import that failed released what it imported")
			assert.Equal(t, 1, b.f.LiveMappings())
			assert.EqualValues(t, g, b.b.PoolStats().Mapped)
			assert.EqualValues(t, g, b.auth.Stats().Mapped)
		})
	}
	require.NoError(t, b.b.Import(rb, 0, nil, backing.ReadWrite), "nothing to import")

	// The driver fails midway: at the second import, and at cuMemSetAccess.
	for _, fn := range []string{"cuMemImportFromShareableHandle", "cuMemSetAccess"} {
		nth := 1
		if fn == "cuMemImportFromShareableHandle" {
			nth = 2
		}
		b.f.Fail(fn, nth, cuda.CodeOutOfMemory)
		assert.ErrorIs(t, b.b.Import(rb, 0, good, backing.ReadWrite), backing.ErrOutOfMemory, fn)
		assert.Equal(t, 1, b.f.LiveHandles(), fn)
		assert.Equal(t, 1, b.f.LiveMappings(), fn)
		assert.EqualValues(t, g, b.b.PoolStats().Mapped, fn)
	}
	// And then it works.
	require.NoError(t, b.b.Import(rb, 0, good, backing.ReadWrite))
	got := make([]byte, 2*g)
	require.NoError(t, b.b.CopyOut(got, rb, 0))
	assert.True(t, bytes.Equal(pattern(4, 2*g), got))
	require.True(t, b.b.Unreserve(rb).OK())
	assert.Panics(t, func() { _ = b.b.Import(rb, 0, good, backing.ReadWrite) }, "use after Unreserve")
	require.True(t, big.b.Unreserve(rbig).OK())
	require.True(t, a.b.Unreserve(ra).OK())
}

// A driver without the export entry points still backs memory, but can not make an
// exportable Backing or import; a device that can not export is refused at New.
func TestExportableNew(t *testing.T) {
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	d := *f.Driver()
	d.MemExportToShareableHandle = nil
	_, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: &d, Exportable: true})
	assert.ErrorIs(t, err, cuda.ErrMissingSymbol)
	assert.Contains(t, err.Error(), "cuMemExportToShareableHandle")
	d.MemImportFromShareableHandle = nil
	b, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: &d})
	require.NoError(t, err, "the export entry points are optional")
	r, err := b.Reserve(2 << 20)
	require.NoError(t, err)
	assert.ErrorIs(t, b.Import(r, 0, []int{0}, backing.ReadWrite), cuda.ErrMissingSymbol)
	assert.True(t, b.Unreserve(r).OK())
	require.NoError(t, b.Close())
	assert.NoError(t, f.CheckLeaks())

	for _, tt := range []struct {
		name string
		fo   cudatest.FakeDriverOptions
		fail string // an entry point that fails on its second call
		want error
	}{
		{"device can not export", cudatest.FakeDriverOptions{NoExport: true}, "", cuda.ErrNoExport},
		{"attribute query fails", cudatest.FakeDriverOptions{}, "cuDeviceGetAttribute", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := cudatest.NewFakeDriver(tt.fo)
			if tt.fail != "" {
				f.Fail(tt.fail, 2, cuda.CodeUnknown)
			}
			b, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: f.Driver(), Exportable: true})
			require.Error(t, err)
			assert.Nil(t, b)
			if tt.want != nil {
				assert.ErrorIs(t, err, tt.want)
				assert.ErrorIs(t, err, backing.ErrUnsupported, "a caller falls back on ErrUnsupported")
			}
			assert.NoError(t, f.CheckLeaks())
		})
	}
}

// The fake's own rules for export and import, on the raw seam.
func TestFakeExportRules(t *testing.T) {
	x := newRawFake(t, cudatest.FakeDriverOptions{Memory: 8 * mib})
	d := x.d
	plain := x.create(2 * mib)
	p := *x.prop()
	p.RequestedHandleTypes = cuda.HandleTypePosixFD
	var h uint64
	require.Equal(t, cuda.Success, d.MemCreate(&h, 2*mib, &p, 0))
	var v int32
	require.Equal(t, cuda.Success, d.DeviceGetAttribute(&v, cuda.AttrPosixFDSupported, 0))
	assert.EqualValues(t, 1, v)

	fd := int32(-1)
	out := cuda.Int32Ptr(&fd)
	assert.Equal(t, cuda.CodeInvalidValue, d.MemExportToShareableHandle(out, plain, cuda.HandleTypePosixFD, 0), "not created exportable")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemExportToShareableHandle(out, h, cuda.HandleTypePosixFD, 1), "flags must be 0")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemExportToShareableHandle(nil, h, cuda.HandleTypePosixFD, 0), "nil out")
	assert.Equal(t, cuda.CodeNotSupported, d.MemExportToShareableHandle(out, h, 2, 0), "WIN32 handles")
	assert.Equal(t, cuda.CodeInvalidValue, d.MemExportToShareableHandle(out, 999, cuda.HandleTypePosixFD, 0), "no such handle")
	assert.EqualValues(t, -1, fd, "nothing written on failure")
	require.Equal(t, cuda.Success, d.MemExportToShareableHandle(out, h, cuda.HandleTypePosixFD, 0))
	require.GreaterOrEqual(t, fd, int32(0))
	defer closeAll(t, []int{int(fd)})

	var in uint64
	assert.Equal(t, cuda.CodeInvalidValue, d.MemImportFromShareableHandle(nil, uintptr(fd), cuda.HandleTypePosixFD))
	assert.Equal(t, cuda.CodeNotSupported, d.MemImportFromShareableHandle(&in, uintptr(fd), 2))
	assert.Equal(t, cuda.CodeInvalidValue, d.MemImportFromShareableHandle(&in, 1<<40, cuda.HandleTypePosixFD))
	require.Equal(t, cuda.Success, d.MemImportFromShareableHandle(&in, uintptr(fd), cuda.HandleTypePosixFD))
	assert.NotEqual(t, h, in, "an import is a handle of its own")
	assert.EqualValues(t, 4*mib, x.f.UsedMemory(0), "an import is not counted again")

	// The exporter releases its handle: the memory lives on in the import.
	va := x.reserve(2 * mib)
	require.Equal(t, cuda.Success, d.MemMap(va, 2*mib, 0, h, 0))
	require.Equal(t, cuda.Success, x.access(va, 2*mib, cuda.AccessReadWrite))
	require.Equal(t, cuda.Success, x.write(va, []byte("shared")))
	require.Equal(t, cuda.Success, d.MemUnmap(va, 2*mib))
	require.Equal(t, cuda.Success, d.MemRelease(h))
	assert.Equal(t, cuda.CodeInvalidValue, d.MemExportToShareableHandle(out, h, cuda.HandleTypePosixFD, 0), "released")
	require.Equal(t, cuda.Success, d.MemMap(va, 2*mib, 0, in, 0))
	require.Equal(t, cuda.Success, x.access(va, 2*mib, cuda.AccessRead))
	got, c := x.read(va, 6)
	require.Equal(t, cuda.Success, c)
	assert.Equal(t, "shared", string(got))
	require.Equal(t, cuda.Success, d.MemUnmap(va, 2*mib))
	require.Equal(t, cuda.Success, d.MemRelease(in))
	require.Equal(t, cuda.Success, d.MemRelease(plain))
	require.Equal(t, cuda.Success, d.MemAddressFree(va, 2*mib))
	require.Equal(t, cuda.Success, d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, x.f.CheckLeaks())

	// A device that can not export refuses exportable allocations.
	y := newRawFake(t, cudatest.FakeDriverOptions{NoExport: true})
	require.Equal(t, cuda.Success, y.d.DeviceGetAttribute(&v, cuda.AttrPosixFDSupported, 0))
	assert.Zero(t, v)
	assert.Equal(t, cuda.CodeNotSupported, y.d.MemCreate(&h, 2*mib, &p, 0))
	require.Equal(t, cuda.Success, y.d.DevicePrimaryCtxRelease(0))
	assert.NoError(t, y.f.CheckLeaks())
}
