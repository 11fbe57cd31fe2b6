package kronk_test

// Kronk's tests of its RAM store (sdk/kronk/kvstorage/ram/ram_test.go, v1.32.6),
// ported case by case to a snapshot.Store, each under the name of the case it
// ports. Sizes the RAM tests give in bytes stay where they fall inside one granule
// (64 KiB here); cases about capacity are stated in granules, the unit a store
// commits in. Where a case checks the RAM store's own policy (headroom, keeping
// capacity, a new array on growth, zeroing on Reset) its port says what a
// snapshot.Store does instead, and why.

import (
	"context"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/examples/kronk"
	"github.com/vmarena/vmarena/snapshot"
)

const gran = 64 << 10

// checked wraps a store with calls that fail the test on error, as ram_test.go's
// checkedStore does.
type checked struct {
	*snapshot.Store
	t *testing.T
}

func newChecked(t *testing.T) (*checked, *snapshot.Factory) {
	t.Helper()
	f := newFactory(t, accounting.Unlimited)
	s, err := f.New(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.Close()) })
	return &checked{Store: s, t: t}, f
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

func TestNewFactory(t *testing.T) {
	f := newFactory(t, accounting.Unlimited)
	factory := kronk.Factory(f)
	a, err := factory(context.Background())
	require.NoError(t, err)
	b, err := factory(context.Background())
	require.NoError(t, err)
	assert.NotSame(t, a, b, "the factory returned the same store twice")
	require.NoError(t, a.Close())
	require.NoError(t, b.Close())
}

// TestStore_ZeroValue: differs on purpose in that a snapshot.Store's zero value is
// not usable (a store belongs to a factory and its budget); a new store from the
// factory is what the RAM store's zero value is: empty, nothing held.
func TestStore_ZeroValue(t *testing.T) {
	k, _ := newChecked(t)
	assert.Zero(t, k.Len())
	assert.Zero(t, k.Cap())
	assert.Nil(t, k.Bytes())
}

func TestStore_PrepareGrows(t *testing.T) {
	k, _ := newChecked(t)
	buf := k.Prepare(1024)
	assert.Len(t, buf, 1024)
	assert.Zero(t, k.Len(), "Len before Commit")
	assert.GreaterOrEqual(t, k.Cap(), 1024)
}

// TestStore_PrepareReusesBackingArray: the same memory is reused, as in the RAM
// store. Differs on purpose in Cap: the smaller snapshot keeps only the granules
// it needs and gives the rest back, where the RAM store keeps its capacity.
func TestStore_PrepareReusesBackingArray(t *testing.T) {
	k, _ := newChecked(t)
	first := k.Prepare(2 * gran)
	second := k.Prepare(gran)
	assert.Equal(t, addr(first), addr(second), "Prepare(smaller) moved the memory")
	assert.Equal(t, gran, k.Cap(), "the granule past the smaller snapshot went back")
	assert.Zero(t, k.Len())
}

// TestStore_ResetZeroesRetainedCapacity: differs on purpose. The RAM store keeps
// its capacity and writes zeros over it; Reset here decommits it, so no capacity
// is retained (Cap is 0) and nothing of the old conversation is left to read.
// What the RAM test protects, that no byte of the prior conversation survives into
// the next, is checked on the memory the next Prepare gets at the same address.
func TestStore_ResetZeroesRetainedCapacity(t *testing.T) {
	k, _ := newChecked(t)
	buf := k.Prepare(16)
	for i := range buf {
		buf[i] = 0xA5
	}
	k.Commit(8)
	held := k.Cap()
	require.Positive(t, held)

	k.Reset()

	assert.Zero(t, k.Len())
	assert.Zero(t, k.Cap(), "Reset retains no capacity: it gave the memory back")
	again := k.Prepare(held)
	assert.Equal(t, addr(buf), addr(again), "the next conversation grows on the same base")
	for i, b := range again {
		require.Zerof(t, b, "byte[%d] of the reused range survived Reset", i)
	}
}

// TestStore_PrepareGrowsWhenExceeding: differs on purpose. The RAM store must
// allocate a new array to grow; here growth commits granules after the ones
// already there, so the memory keeps its address.
func TestStore_PrepareGrowsWhenExceeding(t *testing.T) {
	k, _ := newChecked(t)
	first := k.Prepare(1024)
	second := k.Prepare(4 * gran)
	assert.Equal(t, addr(first), addr(second), "growth moved the snapshot")
	assert.GreaterOrEqual(t, k.Cap(), 4*gran)
	assert.Zero(t, k.Len())
}

func TestStore_PrepareNegativeSize(t *testing.T) {
	k, _ := newChecked(t)
	_ = k.Prepare(1024)
	held := k.Cap()
	buf, err := k.Store.Prepare(context.Background(), -1)
	require.Error(t, err)
	assert.ErrorIs(t, err, snapshot.ErrInvalidSize)
	assert.Nil(t, buf)
	assert.Equal(t, held, k.Cap(), "Prepare(-1) kept what was held")
}

func TestStore_Commit(t *testing.T) {
	k, _ := newChecked(t)
	_ = k.Prepare(1024)
	held := k.Cap()
	k.Commit(512)
	assert.Equal(t, 512, k.Len())
	assert.Equal(t, held, k.Cap(), "Commit keeps what was held")
}

func TestStore_CommitRejectsInvalidLength(t *testing.T) {
	k, _ := newChecked(t)
	_ = k.Prepare(1024)
	require.Error(t, k.Store.Commit(context.Background(), -50))
	assert.Zero(t, k.Len())
	require.Error(t, k.Store.Commit(context.Background(), 99999))
	assert.Zero(t, k.Len())
}

func TestStore_CanceledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f := newFactory(t, accounting.Unlimited)
	store, err := f.New(context.Background())
	require.NoError(t, err)
	defer func() { assert.NoError(t, store.Close()) }()

	_, err = store.Prepare(ctx, 1)
	assert.ErrorIs(t, err, context.Canceled, "Prepare")
	_, err = store.Bytes(ctx)
	assert.ErrorIs(t, err, context.Canceled, "Bytes")
	assert.ErrorIs(t, store.Commit(ctx, 0), context.Canceled, "Commit")
	assert.ErrorIs(t, store.Reset(ctx), context.Canceled, "Reset")
	_, err = kronk.Factory(f)(ctx)
	assert.ErrorIs(t, err, context.Canceled, "the factory")
}

// TestStore_Reset: Len goes to 0 and the next Prepare reuses the same memory, as in
// the RAM store. Differs on purpose in Cap: 0, since Reset gave the memory back
// (the RAM store keeps it); the address range stays reserved, which is why the
// next Prepare lands at the same address.
func TestStore_Reset(t *testing.T) {
	k, _ := newChecked(t)
	first := k.Prepare(2048)
	k.Reset()
	assert.Zero(t, k.Len())
	assert.Zero(t, k.Cap(), "Reset gave the memory back")
	second := k.Prepare(1024)
	assert.Equal(t, addr(first), addr(second), "Prepare after Reset moved the memory")
}

func TestStore_BytesAliasesBuffer(t *testing.T) {
	k, _ := newChecked(t)
	buf := k.Prepare(4)
	copy(buf, []byte{0xAA, 0xBB, 0xCC, 0xDD})
	k.Commit(4)
	got := k.Bytes()
	assert.Equal(t, []byte{0xAA, 0xBB, 0xCC, 0xDD}, got)
	assert.Equal(t, addr(buf), addr(got), "Bytes aliases the prepared memory")
}

// TestStore_PrepareAddsHeadroomOnGrow: differs on purpose. The RAM store adds 25%
// headroom on growth so that the next turns need no new array (and no copy); here
// growth never copies, so headroom would only hold memory nobody uses: Cap is the
// snapshot rounded up to the granule, and a small growth past it commits one more
// granule in place.
func TestStore_PrepareAddsHeadroomOnGrow(t *testing.T) {
	k, f := newChecked(t)
	first := k.Prepare(10 * gran)
	require.Equal(t, 10*gran, k.Cap())
	grown := k.Prepare(11*gran - 100) // +10%, within the RAM store's headroom
	assert.Equal(t, 11*gran, k.Cap(), "Cap is the granules the snapshot needs, no headroom")
	assert.Equal(t, int64(11*gran), f.Authority().Stats().Owned, "the budget is charged for no more")
	assert.Equal(t, addr(first), addr(grown))
	assert.Zero(t, k.Len())
}

// TestStore_PrepareReusesAfterHeadroomGrow: the RAM store's payoff, that turns of
// small growth reuse the same memory, holds here for every growth, with or without
// headroom; Cap follows the snapshot instead of staying at the headroom's size.
func TestStore_PrepareReusesAfterHeadroomGrow(t *testing.T) {
	k, _ := newChecked(t)
	first := addr(k.Prepare(10 * gran))
	for _, size := range []int{11 * gran, 11*gran + 1, 12 * gran, 12*gran + gran/2, 13 * gran} {
		buf := k.Prepare(size)
		assert.Equal(t, first, addr(buf), "Prepare(%d) moved the memory", size)
		assert.Equal(t, (size+gran-1)/gran*gran, k.Cap(), "Prepare(%d)", size)
	}
}

func TestStore_PrepareLargeJumpHonorsExactSize(t *testing.T) {
	k, _ := newChecked(t)
	_ = k.Prepare(1000)
	_ = k.Prepare(50 * gran)
	assert.Equal(t, 50*gran, k.Cap(), "a large jump commits exactly the granules it needs")
}

func TestStore_PrepareFirstAllocNoHeadroom(t *testing.T) {
	k, _ := newChecked(t)
	_ = k.Prepare(16 * gran)
	assert.Equal(t, 16*gran, k.Cap(), "no headroom on the first Prepare")
}

// TestStore_PrepareLogarithmicGrowCount: where the RAM store bounds its
// reallocations over 201 turns of 1% growth by 15 (logarithmic), the snapshot
// never moves at all: one address from the first turn to the last.
func TestStore_PrepareLogarithmicGrowCount(t *testing.T) {
	k, _ := newChecked(t)
	size := 1 << 20
	moves := 0
	prev := addr(k.Prepare(size))
	k.Commit(size)
	for range 200 {
		size += size / 100
		buf := k.Prepare(size)
		if a := addr(buf); a != prev {
			moves++
			prev = a
		}
		k.Commit(size)
	}
	assert.Zero(t, moves, "the snapshot moved")
	assert.Equal(t, (size+gran-1)/gran*gran, k.Cap())
}

func TestStore_NoChurnUnderRepeatedSnapshots(t *testing.T) {
	k, _ := newChecked(t)
	first := addr(k.Prepare(1 << 20))
	k.Commit(1 << 20)
	for i := range 100 {
		size := max((1<<20)-(i*1024), 0)
		buf := k.Prepare(size)
		require.Equal(t, first, addr(buf), "iteration %d: the memory moved (size %d)", i, size)
		k.Commit(size)
	}
}
