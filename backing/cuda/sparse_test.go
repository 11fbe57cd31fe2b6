package cuda_test

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// heapInUse returns the live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// A reservation's bookkeeping grows with what is committed in it, not with what it
// reserves: two reservations of 2^46 bytes (2^25 granules each, half a gibibyte of
// slots apiece were they made up front) with a few granules committed far apart,
// across a chunk boundary and at both ends, shared, protected and decommitted, cost
// the heap a few mebibytes at most (most of it the fake driver's copy of the granules
// written).
func TestReserveHugeSparse(t *testing.T) {
	x := fakeBacking(t, cudatest.FakeDriverOptions{}, cuda.Options{})
	g := x.g
	const huge = 1 << 46
	before := heapInUse()
	a, err := x.b.Reserve(huge)
	require.NoError(t, err)
	b, err := x.b.Reserve(huge)
	require.NoError(t, err)

	// A gibibyte is a chunk of 512 granules at 2 MiB: [1 GiB - 2g, 1 GiB + 2g) spans two.
	runs := []struct{ off, n int }{{0, 1}, {1<<30 - 2*g, 4}, {huge / 2, 2}, {huge - g, 1}}
	for i, r := range runs {
		require.NoError(t, x.b.Commit(a, r.off, r.n*g))
		require.NoError(t, x.b.CopyIn(a, r.off+r.n*g-1, []byte{byte(i + 1)}))
		require.NoError(t, x.b.Share(b, huge-r.off-r.n*g, a, r.off, r.n*g, backing.ReadOnly))
	}
	grown := int64(heapInUse()) - int64(before)
	t.Logf("heap grew %d bytes for two reservations of %d bytes", grown, huge)
	assert.Less(t, grown, int64(16<<20), "heap growth with 2x%d bytes reserved, %d granules committed", huge, 2*8)
	x.checkBooks(t, "after the commits and shares")

	for i, r := range runs {
		out := []byte{0}
		require.NoError(t, x.b.CopyOut(out, b, huge-r.off-1))
		assert.Equal(t, byte(i+1), out[0], "shared run %d reads what was written", i)
		assert.ErrorIs(t, x.b.CopyIn(b, huge-r.off-1, out), backing.ErrReadOnly, "run %d is shared read-only", i)
		assert.ErrorIs(t, x.b.Protect(b, huge-r.off-r.n*g, r.n*g, backing.ReadWrite), backing.ErrReadOnly, "run %d", i)
		require.NoError(t, x.b.Protect(a, r.off, r.n*g, backing.ReadOnly))
		assert.ErrorIs(t, x.b.CopyIn(a, r.off, out), backing.ErrReadOnly, "run %d protected", i)
		require.NoError(t, x.b.Protect(a, r.off, r.n*g, backing.ReadWrite))
		require.NoError(t, x.b.CopyIn(a, r.off, out))
	}
	// State errors name the right granule on either side of a chunk boundary.
	assert.ErrorIs(t, x.b.Commit(a, 1<<30-4*g, 3*g), backing.ErrCommitted)
	assert.ErrorIs(t, x.b.Decommit(a, 1<<30, 3*g), backing.ErrNotCommitted)
	assert.ErrorIs(t, x.b.Decommit(a, g, g), backing.ErrNotCommitted, "a granule of a chunk never committed into")
	assert.ErrorIs(t, x.b.CopyOut([]byte{0}, a, 2<<30), backing.ErrNotCommitted)

	// Decommitting a run across the chunk boundary empties both chunks; committing
	// into them again works.
	require.NoError(t, x.b.Decommit(a, 1<<30-2*g, 4*g))
	require.NoError(t, x.b.Commit(a, 1<<30-g, 2*g))
	require.NoError(t, x.b.Decommit(a, 1<<30-g, 2*g))
	require.NoError(t, x.b.Decommit(a, 0, g))
	x.checkBooks(t, "after the decommits")

	// b's runs lie across the same boundary and at both ends: Unreserve gives each back.
	out := x.b.Unreserve(b)
	require.Equal(t, accounting.Complete, out.Status, "%v", out.Err)
	assert.Equal(t, int64(8*g), out.Unmapped)
	out = x.b.Unreserve(a)
	require.Equal(t, accounting.Complete, out.Status, "%v", out.Err)
	assert.Equal(t, int64(3*g), out.Unmapped)
	x.checkBooks(t, "after Unreserve")
}

// A reservation past the device's address space fails as the driver answers it, with
// CUDA_ERROR_OUT_OF_MEMORY (backing.ErrOutOfMemory), and one whose bookkeeping alone
// would be absurd is refused before the driver is asked.
func TestReservePastAddressSpace(t *testing.T) {
	for _, tt := range []struct {
		name   string
		space  int64
		sizes  []int // reserved in turn; the last one fails
		driver bool  // the driver is asked for the last one
	}{
		{"past the default 128 TiB", 0, []int{1 << 48}, true},
		{"what is left", 1 << 40, []int{1 << 39, 1 << 38, 1 << 39}, true},
		{"past any device", 0, []int{1 << 49}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			x := fakeBacking(t, cudatest.FakeDriverOptions{AddressSpace: tt.space}, cuda.Options{})
			var rs []*cuda.Reservation
			last := tt.sizes[len(tt.sizes)-1]
			for _, size := range tt.sizes[:len(tt.sizes)-1] {
				r, err := x.b.Reserve(size)
				require.NoError(t, err)
				rs = append(rs, r)
			}
			calls := x.f.Calls("cuMemAddressReserve")
			r, err := x.b.Reserve(last)
			assert.Nil(t, r)
			require.ErrorIs(t, err, backing.ErrOutOfMemory)
			var res *cuda.Result
			assert.Equal(t, tt.driver, x.f.Calls("cuMemAddressReserve") > calls, "the driver was asked")
			if tt.driver {
				require.ErrorAs(t, err, &res)
				assert.Equal(t, cuda.CodeOutOfMemory, res.Code)
			}
			for _, r := range rs {
				require.Equal(t, accounting.Complete, x.b.Unreserve(r).Status)
			}
		})
	}
}
