package kronk_test

// vmarena's tests in place of the nine cases of Kronk's RAM store tests
// (sdk/kronk/kvstorage/ram/ram_test.go, v1.32.6) that test the RAM store's own
// capacity policy; Kronk's other nine cases run unchanged in kronkram/. Each test
// here has a name of its own and says which of Kronk's cases it replaces, what
// that case expects, and why a snapshot.Store does otherwise (README.md has the
// same as a table).
//
// Two choices make every difference. A snapshot.Store commits whole granules (64
// KiB here) on one range it reserves at its first Prepare, so growth never moves
// or copies a snapshot, and Cap is what it holds: the granules that cover the last
// Prepare, not the bytes asked. And it holds only what its snapshot needs, out of
// a budget every session shares: a smaller Prepare and Reset give granules back,
// where the RAM store keeps its array until Close. Kronk's sizes (1000 to 5000
// bytes) fall inside one granule, so where a difference shows only across
// granules these tests use sizes in granules.

import (
	"context"
	"slices"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/snapshot"
)

const gran = 64 << 10

// checked wraps a store with calls that fail the test on error, as ram_test.go's
// checkedStore does.
type checked struct {
	*snapshot.Store
	t *testing.T
}

// newChecked returns a store of a new unlimited factory (newFactory), closed when
// the test ends, and the factory.
func newChecked(t *testing.T) (*checked, *snapshot.Factory) {
	t.Helper()
	f := newFactory(t, accounting.Unlimited)
	return newCheckedOf(t, f), f
}

func newCheckedOf(t *testing.T, f *snapshot.Factory) *checked {
	t.Helper()
	s, err := f.New(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.Close()) })
	return &checked{Store: s, t: t}
}

func (c *checked) Bytes() []byte {
	c.t.Helper()
	b, err := c.Store.Bytes(context.Background())
	require.NoError(c.t, err)
	return b
}

func (c *checked) Prepare(size int) []byte {
	c.t.Helper()
	b, err := c.Store.Prepare(context.Background(), size)
	require.NoError(c.t, err, "Prepare(%d)", size)
	return b
}

func (c *checked) Commit(n int) {
	c.t.Helper()
	require.NoError(c.t, c.Store.Commit(context.Background(), n), "Commit(%d)", n)
}

func (c *checked) Reset() {
	c.t.Helper()
	require.NoError(c.t, c.Store.Reset(context.Background()))
}

func addr(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

// covering returns the bytes of the granules that cover n bytes.
func covering(n int) int { return (n + gran - 1) / gran * gran }

// owned returns the bytes f's ledger is charged.
func owned(f *snapshot.Factory) int64 { return f.Authority().Stats().Owned }

// TestSnapshot_PrepareSmallerGivesBack replaces Kronk's
// TestStore_PrepareReusesBackingArray, which expects a smaller Prepare to reuse the
// array and keep its capacity (Cap 2048 after Prepare(2048) and Prepare(1024)).
// The memory is reused here too (the same address), but the granules past the
// smaller snapshot go back to the budget and Cap drops to those that cover it: a
// store keeps no memory its snapshot does not use, since every session's store
// draws from one budget.
func TestSnapshot_PrepareSmallerGivesBack(t *testing.T) {
	k, f := newChecked(t)
	first := k.Prepare(3 * gran)
	require.Equal(t, 3*gran, k.Cap())

	second := k.Prepare(gran + 1)
	assert.Equal(t, addr(first), addr(second), "Prepare(smaller) moved the memory")
	assert.Equal(t, 2*gran, k.Cap(), "the granule past the smaller snapshot went back")
	assert.Equal(t, int64(2*gran), owned(f), "the budget is charged for what is held")
	assert.Zero(t, k.Len())
}

// TestSnapshot_ResetDecommits replaces Kronk's TestStore_ResetZeroesRetainedCapacity,
// which expects Reset to keep the array (Cap unchanged) and write zeros over all of
// it, so that no byte of a session's prior conversation survives into the next.
// Reset here gives every granule back instead (Cap 0): a session between
// conversations holds no memory. What Kronk's case protects then depends on the
// backing. On Private the granules go back to the OS, and the next Prepare's
// memory reads as zero. On Shared they go to the factory's pool uncleared, and a
// later Prepare of any of its stores may hand out what an earlier snapshot left
// there until the caller writes it; Kronk writes the whole prepared slice before it
// commits. On both no byte is readable through the store: Len is 0 and Bytes nil.
func TestSnapshot_ResetDecommits(t *testing.T) {
	for _, kind := range []snapshot.Kind{snapshot.Private, snapshot.Shared} {
		t.Run(kind.String(), func(t *testing.T) {
			f, err := snapshot.NewFactory(accounting.NewGovernor(),
				snapshot.Options{Backing: kind, Granularity: gran, MaxSize: 1 << 30})
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, f.Close()) })
			k := newCheckedOf(t, f)

			buf := k.Prepare(2 * gran)
			for i := range buf {
				buf[i] = 0xA5
			}
			k.Commit(gran)
			require.Equal(t, 2*gran, k.Cap())

			k.Reset()

			assert.Zero(t, k.Len())
			assert.Nil(t, k.Bytes())
			assert.Zero(t, k.Cap(), "Reset retains no capacity")
			st := f.Stats()
			assert.Zero(t, st.Committed)
			assert.Equal(t, st.Idle, st.Ledger.Owned, "only a Shared pool's idle granules stay charged")
			if kind != snapshot.Private {
				return
			}
			assert.Zero(t, st.Ledger.Owned, "Private gave the memory back")
			again := k.Prepare(2 * gran)
			assert.Equal(t, addr(buf), addr(again), "the next conversation grows on the same base")
			assert.Equal(t, -1, slices.IndexFunc(again, func(b byte) bool { return b != 0 }),
				"a byte of the prior conversation survived Reset")
		})
	}
}

// TestSnapshot_GrowthStaysInPlace replaces Kronk's TestStore_PrepareGrowsWhenExceeding,
// which expects the opposite: a Prepare past the capacity moves the snapshot to a
// new array. Here growth commits granules after those held, on the range reserved
// at the first Prepare, so the address never changes and nothing is copied, from a
// few bytes to many granules and over 200 turns of 1% growth (the load of Kronk's
// TestStore_PrepareLogarithmicGrowCount, which runs unchanged and allows up to 15
// moves).
func TestSnapshot_GrowthStaysInPlace(t *testing.T) {
	k, f := newChecked(t)
	base := addr(k.Prepare(1024))
	for _, size := range []int{4 * gran, 4*gran + 1, 40 * gran, 100*gran + 7} {
		buf := k.Prepare(size)
		assert.Equal(t, base, addr(buf), "Prepare(%d) moved the snapshot", size)
		assert.Equal(t, covering(size), k.Cap(), "Prepare(%d)", size)
		assert.Zero(t, k.Len())
	}

	size := 1 << 20
	k.Reset()
	for range 201 {
		buf := k.Prepare(size)
		require.Equal(t, base, addr(buf), "Prepare(%d) moved the snapshot", size)
		k.Commit(size)
		size += size / 100
	}
	assert.Equal(t, int64(k.Cap()), owned(f))
}

// TestSnapshot_PrepareNegativeSizeChangesNothing replaces Kronk's
// TestStore_PrepareNegativeSize, which expects an error, a nil slice and Cap 1024
// after Prepare(1024), the bytes asked. The error and the nil slice are the same
// here (the error matches snapshot.ErrInvalidSize); Cap is what the store holds,
// the granule that covers 1024 bytes, and Prepare(-1) leaves it, and the committed
// snapshot, as they were.
func TestSnapshot_PrepareNegativeSizeChangesNothing(t *testing.T) {
	k, _ := newChecked(t)
	buf := k.Prepare(1024)
	copy(buf, "snapshot")
	k.Commit(8)
	require.Equal(t, gran, k.Cap())

	buf, err := k.Store.Prepare(context.Background(), -1)
	require.ErrorIs(t, err, snapshot.ErrInvalidSize)
	assert.Nil(t, buf)
	assert.Equal(t, gran, k.Cap(), "Prepare(-1) kept what was held")
	assert.Equal(t, []byte("snapshot"), k.Bytes(), "Prepare(-1) kept the snapshot")
}

// TestSnapshot_CommitKeepsGranules replaces Kronk's TestStore_Commit, which expects
// Len 512 and Cap 1024 (the bytes Prepare asked) after Prepare(1024) and
// Commit(512). Len is the same here; Cap stays the granules Prepare committed,
// also those past n, until the next Prepare or Reset, since Commit only publishes.
func TestSnapshot_CommitKeepsGranules(t *testing.T) {
	k, f := newChecked(t)
	_ = k.Prepare(3 * gran)
	k.Commit(gran / 2)
	assert.Equal(t, gran/2, k.Len())
	assert.Equal(t, 3*gran, k.Cap(), "Commit keeps what Prepare committed")
	assert.Equal(t, int64(3*gran), owned(f))
}

// TestSnapshot_ResetKeepsBase replaces Kronk's TestStore_Reset, which expects Reset
// to keep Cap (2048 after Prepare(2048)) and the next Prepare to reuse the same
// array. The next Prepare lands on the same address here too, since the address
// range stays reserved until Close, but Cap is 0 and the budget is charged nothing:
// memory is given back between conversations, where the RAM store keeps it.
func TestSnapshot_ResetKeepsBase(t *testing.T) {
	k, f := newChecked(t)
	first := k.Prepare(2 * gran)
	k.Reset()
	assert.Zero(t, k.Len())
	assert.Zero(t, k.Cap(), "Reset gave the memory back")
	assert.Zero(t, owned(f))

	second := k.Prepare(gran)
	assert.Equal(t, addr(first), addr(second), "Prepare after Reset moved the memory")
	assert.Equal(t, gran, k.Cap())
}

// TestSnapshot_GrowthCommitsNoHeadroom replaces Kronk's
// TestStore_PrepareAddsHeadroomOnGrow, which expects Cap 1000 after Prepare(1000)
// and at least 1250 after Prepare(1100): 25% headroom on growth, which spares the
// RAM store a new array and a copy on the next turns. Growth here never copies, so
// headroom would only hold memory the budget charges and no snapshot uses: Cap is
// the granules that cover the snapshot, and each growth commits what it needs.
// (Kronk's TestStore_PrepareReusesAfterHeadroomGrow runs unchanged: its sizes stay
// inside one granule, which is all the slack a snapshot.Store keeps.)
func TestSnapshot_GrowthCommitsNoHeadroom(t *testing.T) {
	k, f := newChecked(t)
	first := k.Prepare(10 * gran)
	require.Equal(t, 10*gran, k.Cap())

	grown := k.Prepare(11*gran - 100) // +10%, within the RAM store's headroom
	assert.Equal(t, 11*gran, k.Cap(), "Cap is the granules the snapshot needs, no headroom")
	assert.Equal(t, int64(11*gran), owned(f), "the budget is charged for no more")
	assert.Equal(t, addr(first), addr(grown))
	assert.Zero(t, k.Len())
}

// TestSnapshot_LargeJumpCommitsCoveringGranules replaces Kronk's
// TestStore_PrepareLargeJumpHonorsExactSize, which expects Cap to be exactly 5000
// after Prepare(1000) and Prepare(5000). No headroom is added here either, but Cap
// counts the granules that cover the size, the memory held, not the bytes asked.
func TestSnapshot_LargeJumpCommitsCoveringGranules(t *testing.T) {
	k, f := newChecked(t)
	_ = k.Prepare(1000)
	_ = k.Prepare(50*gran + 1)
	assert.Equal(t, 51*gran, k.Cap())
	assert.Equal(t, int64(51*gran), owned(f))
}

// TestSnapshot_FirstPrepareCommitsCoveringGranules replaces Kronk's
// TestStore_PrepareFirstAllocNoHeadroom, which expects Cap to be exactly 1024 after a
// first Prepare(1024). Here Cap is the granule that covers those bytes, and a
// first Prepare of whole granules commits exactly them.
func TestSnapshot_FirstPrepareCommitsCoveringGranules(t *testing.T) {
	for _, size := range []int{1024, gran, 16 * gran, 16*gran + 1} {
		k, f := newChecked(t)
		_ = k.Prepare(size)
		assert.Equal(t, covering(size), k.Cap(), "Prepare(%d)", size)
		assert.Equal(t, int64(covering(size)), owned(f), "Prepare(%d)", size)
	}
}
