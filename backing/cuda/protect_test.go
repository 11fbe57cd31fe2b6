package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// access returns the driver's access flags of each granule of r.
func (x *fx) access(t *testing.T, r *cuda.Reservation) []int32 {
	t.Helper()
	out := make([]int32, x.b.Size(r)/x.g)
	for i := range out {
		a, ok := x.f.MappingAccess(uint64(x.b.Base(r)) + uint64(i*x.g))
		require.True(t, ok, "granule %d is mapped", i)
		out[i] = a
	}
	return out
}

// deviceWrite writes one byte at off of r through the raw driver, as a kernel would:
// the fake driver refuses it without READWRITE access.
func (x *fx) deviceWrite(t *testing.T, r *cuda.Reservation, off int) cuda.Code {
	t.Helper()
	var c cuda.Code
	withContext(t, x.f.Driver(), func() {
		c = x.f.Driver().MemsetD8(uint64(x.b.Base(r))+uint64(off), 1, 1)
	})
	return c
}

func TestProtect(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	a, b := x.reserve(t, 3), x.reserve(t, 2)
	require.NoError(t, x.b.Commit(a, 0, 3*g))
	require.NoError(t, x.b.CopyIn(a, g, []byte("kv")))
	require.NoError(t, x.b.Share(b, 0, a, 0, 2*g, backing.ReadOnly))

	assert.Equal(t, 1, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Protect(a, 0, 2*g, backing.ReadOnly))
	}), "one cuMemSetAccess for the range")
	assert.Equal(t, []int32{cuda.AccessRead, cuda.AccessRead, cuda.AccessReadWrite}, x.access(t, a))
	assert.Zero(t, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Protect(a, g, g, backing.ReadOnly))
	}), "nothing to change")
	err := x.b.CopyIn(a, g, []byte{1})
	assert.ErrorIs(t, err, cuda.ErrReadOnly)
	assert.ErrorIs(t, err, backing.ErrReadOnly)
	assert.ErrorIs(t, x.b.Memset(a, 0, 1, 0), cuda.ErrReadOnly)
	assert.NotEqual(t, cuda.Success, x.deviceWrite(t, a, g), "the device can not write a protected range")
	assert.Equal(t, cuda.Success, x.deviceWrite(t, a, 2*g), "the granule past it")

	err = x.b.Protect(b, 0, g, backing.ReadWrite)
	assert.ErrorIs(t, err, cuda.ErrReadOnly, "a sharer never gains write access")
	assert.ErrorIs(t, err, backing.ErrReadOnly)
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	assert.Equal(t, []int32{cuda.AccessRead, cuda.AccessRead}, x.access(t, b))
	assert.Error(t, x.b.Protect(a, 0, g, 2), "an unknown protection")

	assert.Equal(t, 1, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Protect(a, 0, 3*g, backing.ReadWrite))
	}))
	assert.Equal(t, []int32{cuda.AccessReadWrite, cuda.AccessReadWrite, cuda.AccessReadWrite}, x.access(t, a))
	assert.Equal(t, []int32{cuda.AccessRead, cuda.AccessRead}, x.access(t, b), "the sharer's mappings are untouched")
	require.NoError(t, x.b.CopyIn(a, g, []byte("KV")))
	got := make([]byte, 2)
	require.NoError(t, x.b.CopyOut(got, b, g))
	assert.Equal(t, []byte("KV"), got)
	assert.ErrorIs(t, x.b.CopyIn(b, g, []byte{1}), cuda.ErrReadOnly)
	x.checkBooks(t, "after the round trip")
	for _, r := range []*cuda.Reservation{a, b} {
		require.True(t, x.b.Unreserve(r).OK())
	}
}

// TestProtectNotSupported: a driver without read-only device mappings leaves the
// mapping read-write; the Go side still refuses writes, and the driver is not asked
// again.
func TestProtectNotSupported(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{NoReadOnly: true}, cuda.Options{})
	g := x.g
	a := x.reserve(t, 2)
	require.NoError(t, x.b.Commit(a, 0, 2*g))
	assert.Equal(t, 1, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Protect(a, 0, g, backing.ReadOnly))
	}))
	assert.Equal(t, []int32{cuda.AccessReadWrite, cuda.AccessReadWrite}, x.access(t, a), "the driver kept read-write")
	assert.ErrorIs(t, x.b.CopyIn(a, 0, []byte{1}), cuda.ErrReadOnly, "the Go side refuses")
	assert.Zero(t, x.calls("cuMemSetAccess", func() {
		require.NoError(t, x.b.Protect(a, g, g, backing.ReadOnly))
	}), "the driver is not asked again")
	assert.ErrorIs(t, x.b.CopyIn(a, g, []byte{1}), cuda.ErrReadOnly)
	require.NoError(t, x.b.Protect(a, 0, 2*g, backing.ReadWrite))
	require.NoError(t, x.b.CopyIn(a, 0, []byte{1}))
	require.True(t, x.b.Unreserve(a).OK())
}

// TestProtectRestoreFails: when cuMemSetAccess fails and so does restoring the old
// access, the range is recorded read-only (the helpers refuse it) and the error says
// so; a later Protect ReadWrite makes it whole.
func TestProtectRestoreFails(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	a := x.reserve(t, 2)
	require.NoError(t, x.b.Commit(a, 0, 2*g))
	x.f.Fail("cuMemSetAccess", 1, cuda.CodeUnknown)
	x.f.Fail("cuMemSetAccess", 2, cuda.CodeUnknown)
	err := x.b.Protect(a, 0, 2*g, backing.ReadOnly)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "recorded read-only")
	assert.Zero(t, x.f.Pending())
	assert.Equal(t, []int32{cuda.AccessReadWrite, cuda.AccessReadWrite}, x.access(t, a), "the driver changed nothing")
	assert.ErrorIs(t, x.b.CopyIn(a, 0, []byte{1}), cuda.ErrReadOnly, "the unknown range is refused")
	require.NoError(t, x.b.Protect(a, 0, 2*g, backing.ReadWrite))
	require.NoError(t, x.b.CopyIn(a, 0, []byte{1}))

	// A single failure is restored: nothing changed.
	x.f.Fail("cuMemSetAccess", 1, cuda.CodeUnknown)
	require.Error(t, x.b.Protect(a, 0, g, backing.ReadOnly))
	require.NoError(t, x.b.CopyIn(a, 0, []byte{2}), "still writable")
	require.True(t, x.b.Unreserve(a).OK())
}
