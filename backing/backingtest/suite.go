package backingtest

import (
	"bytes"
	"errors"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// largeReservation is the address space the "Large" property reserves.
const largeReservation = 64 << 30

// Run runs every property against fresh backings from newBacking (one per subtest).
// newBacking registers its own teardown with t.Cleanup.
//
// The properties cover the [backing.Backing] contract and its safety points (see the
// backing package's "Safety contract"): reserve and unreserve, reserve commits nothing, empty
// and very large reservations, commit-write-read, decommit forfeits contents, a stable
// base, range validation (ErrInvalidRange, ErrOutOfRange, ErrCommitted,
// ErrNotCommitted, ErrForeignReservation), a failed call changes nothing, concurrent
// commits of distinct ranges, unreserve of committed granules, and the panic on use
// after Unreserve. Capabilities are probed by type assertion and checked when present:
// [backing.Copier] and [backing.HostAccessible] (at least one is required, to reach the
// contents), [backing.Zeroer], [backing.Sharer] (read-only mappings refuse CopyIn, an
// unknown [backing.Protection] is refused, sharing within one reservation, partial
// decommits of a shared range, each Share's [backing.ShareReport] against the
// ledger, ReadWrite refused with ErrReadOnly from a source
// granule shared to it ReadOnly or protected, ReadOnly allowed from both),
// [backing.Protector] (a round trip ReadWrite to
// ReadOnly and back, CopyIn refused with ErrReadOnly on read-only memory, other
// mappings of the granules untouched, a sharer never granted ReadWrite on a granule
// shared to it ReadOnly, refused ranges change nothing, protected granules decommit
// and commit again read-write), [backing.Pool], [backing.Populator],
// [backing.Waiter]. A capability method that answers with an error wrapping
// [backing.ErrUnsupported] (a [Faulty] over a backing without it, a Fake sharing under
// ByBuffer) counts as absent, after the suite checks that the refusal changed nothing.
//
// Under ByBacking the suite checks the authority's axes: Commit and Share raise Mapped,
// Decommit and Unreserve lower it; Owned is the bytes of live granules, mapped or idle
// in a pool. It also checks the budget: a Commit the budget refuses changes nothing,
// and a Waiter's CommitCtx waits on the governor, is served in arrival order and leaks
// nothing when cancelled. For that the suite sets the limit of the backing's device on
// the backing's governor (Accounting().Authority().Governor()) and restores the
// previous limit when the property ends.
//
// NB: so under ByBacking the factory must give each backing an authority and a device
// budget of its own (a fresh governor does): the suite compares the authority's Owned
// and Mapped with PoolStats, and other users of the device would change its figures.
//
// Each property reserves a few granules, except "Large", which reserves 64 GiB of
// address space and commits only its last granule; a backing may refuse that
// reservation only with an error wrapping [backing.ErrOutOfMemory].
func Run[R any](t *testing.T, newBacking func(t *testing.T) backing.Backing[R]) {
	t.Helper()
	props := []struct {
		name string
		fn   func(e *env[R])
	}{
		{"Identity", testIdentity[R]},
		{"ReserveUnreserve", testReserveUnreserve[R]},
		{"ReserveCommitsNothing", testReserveCommitsNothing[R]},
		{"ReserveBadSize", testReserveBadSize[R]},
		{"ZeroSize", testZeroSize[R]},
		{"Large", testLarge[R]},
		{"CommitWriteRead", testCommitWriteRead[R]},
		{"DecommitForfeits", testDecommitForfeits[R]},
		{"BaseStable", testBaseStable[R]},
		{"Alignment", testAlignment[R]},
		{"OutOfRange", testOutOfRange[R]},
		{"DoubleCommit", testDoubleCommit[R]},
		{"DecommitUncommitted", testDecommitUncommitted[R]},
		{"FailedCallChangesNothing", testFailedCallChangesNothing[R]},
		{"Concurrent", testConcurrent[R]},
		{"UnreserveCommitted", testUnreserveCommitted[R]},
		{"UseAfterUnreserve", testUseAfterUnreserve[R]},
		{"ForeignReservation", testForeign[R]},
		{"Copier", testCopier[R]},
		{"ShareWriteRead", testShareWriteRead[R]},
		{"ShareDecommitSource", testShareDecommitSource[R]},
		{"ShareLastMapping", testShareLastMapping[R]},
		{"ShareReadOnly", testShareReadOnly[R]},
		{"ShareReadOnlyCopyIn", testShareReadOnlyCopyIn[R]},
		{"ShareUnknownProtection", testShareUnknownProtection[R]},
		{"ShareWithin", testShareWithin[R]},
		{"ShareDecommitPart", testShareDecommitPart[R]},
		{"ShareErrors", testShareErrors[R]},
		{"ShareFromReadOnly", testShareFromReadOnly[R]},
		{"ShareReport", testShareReport[R]},
		{"ProtectRoundTrip", testProtectRoundTrip[R]},
		{"ProtectOtherMappings", testProtectOtherMappings[R]},
		{"ProtectSharer", testProtectSharer[R]},
		{"ProtectErrors", testProtectErrors[R]},
		{"ProtectDecommit", testProtectDecommit[R]},
		{"PoolReuse", testPoolReuse[R]},
		{"PoolPrefill", testPoolPrefill[R]},
		{"PoolTrim", testPoolTrim[R]},
		{"Populate", testPopulate[R]},
		{"CommitCtx", testCommitCtx[R]},
		{"AccountingAxes", testAccountingAxes[R]},
		{"BudgetRefusal", testBudgetRefusal[R]},
		{"BudgetWaitFIFO", testBudgetWaitFIFO[R]},
		{"BudgetWaitCancel", testBudgetWaitCancel[R]},
	}
	for _, p := range props {
		t.Run(p.name, func(t *testing.T) {
			e := &env[R]{t: t, newBacking: newBacking, b: newBacking(t)}
			// Probe how to reach the contents before the property takes its baselines:
			// the probe commits a granule, which a pool may keep.
			e.accessors()
			p.fn(e)
		})
	}
}

// env is one property's backing and the helpers that reach it through the interface.
type env[R any] struct {
	t          *testing.T
	newBacking func(t *testing.T) backing.Backing[R]
	b          backing.Backing[R]

	probed bool
	copier bool // CopyIn/CopyOut work
	direct bool // HostAccessible
}

// res is a reservation the property made; it is unreserved at cleanup unless the
// property did it.
type res[R any] struct {
	r    R
	size int
	done bool
}

func (e *env[R]) g() int { return e.b.Granularity() }

// reserve reserves n granules of e.b, which must succeed.
func (e *env[R]) reserve(n int) *res[R] { return reserveOn(e.t, e.b, n*e.g()) }

func reserveOn[R any](t *testing.T, b backing.Backing[R], size int) *res[R] {
	t.Helper()
	r, err := b.Reserve(size)
	require.NoError(t, err, "Reserve(%d)", size)
	x := &res[R]{r: r, size: size}
	t.Cleanup(func() {
		if !x.done {
			x.done = true
			if o := b.Unreserve(r); !o.OK() {
				t.Errorf("cleanup Unreserve: %v", o)
			}
		}
	})
	return x
}

// unreserve unreserves x, which must be Complete with unmapped bytes given back.
func (e *env[R]) unreserve(x *res[R], unmapped int) {
	e.t.Helper()
	o := e.b.Unreserve(x.r)
	x.done = o.Status != accounting.Failed
	assert.Equal(e.t, accounting.Complete, o.Status, "Unreserve: %v", o)
	assert.NoError(e.t, o.Err)
	assert.Equal(e.t, int64(unmapped), o.Unmapped, "Unreserve: bytes unmapped")
	assert.Zero(e.t, o.Residual, "Unreserve: residual")
}

// probe finds out how the contents can be reached: through Copier, directly, or both.
func (e *env[R]) probe() {
	if e.probed {
		return
	}
	e.probed = true
	e.direct = backing.IsHostAccessible(e.b)
	c, ok := e.b.(backing.Copier[R])
	if !ok {
		require.True(e.t, e.direct, "a backing must be a Copier or HostAccessible, or nothing can check its contents")
		return
	}
	x := reserveOn(e.t, e.b, e.g())
	require.NoError(e.t, e.b.Commit(x.r, 0, e.g()))
	err := c.CopyIn(x.r, 0, []byte{1})
	if errors.Is(err, backing.ErrUnsupported) {
		require.True(e.t, e.direct, "Copier answers ErrUnsupported and the backing is not HostAccessible")
	} else {
		require.NoError(e.t, err, "probe CopyIn")
		e.copier = true
	}
	o := e.b.Unreserve(x.r)
	x.done = true
	require.True(e.t, o.OK(), "probe Unreserve: %v", o)
}

// accessors returns the ways to reach the contents: "copier", "direct" or both.
func (e *env[R]) accessors() []string {
	e.probe()
	var out []string
	if e.copier {
		out = append(out, "copier")
	}
	if e.direct {
		out = append(out, "direct")
	}
	return out
}

// accessorsHave reports whether the contents can be reached by how ("copier" or
// "direct").
func (e *env[R]) accessorsHave(how string) bool {
	for _, a := range e.accessors() {
		if a == how {
			return true
		}
	}
	return false
}

// writeVia writes p at off of committed memory in r, by accessor how.
func (e *env[R]) writeVia(how string, r R, off int, p []byte) {
	e.t.Helper()
	if how == "copier" {
		require.NoError(e.t, e.b.(backing.Copier[R]).CopyIn(r, off, p), "CopyIn at %#x", off)
		return
	}
	copy(hostBytes(e.b.Base(r)+uintptr(off), len(p)), p)
}

// readVia reads n bytes at off of committed memory in r, by accessor how.
func (e *env[R]) readVia(how string, r R, off, n int) []byte {
	e.t.Helper()
	p := make([]byte, n)
	if how == "copier" {
		require.NoError(e.t, e.b.(backing.Copier[R]).CopyOut(p, r, off), "CopyOut at %#x", off)
		return p
	}
	copy(p, hostBytes(e.b.Base(r)+uintptr(off), n))
	return p
}

func (e *env[R]) write(r R, off int, p []byte) { e.t.Helper(); e.writeVia(e.accessors()[0], r, off, p) }

// checkRead asserts that every accessor reads want at off.
func (e *env[R]) checkRead(r R, off int, want []byte, what string) {
	e.t.Helper()
	for _, how := range e.accessors() {
		got := e.readVia(how, r, off, len(want))
		if !bytes.Equal(got, want) {
			e.t.Errorf("%s: read via %s at %#x: contents differ (first bytes %x, want %x)", what, how, off, head(got), head(want))
		}
	}
}

func head(p []byte) []byte { return p[:min(len(p), 8)] }

// pattern returns n bytes that differ per seed and per position and are never all
// zero.
func pattern(seed, n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(seed*131 + i*7 + i>>8 + 1)
	}
	return p
}

// marked reserves n granules, commits the first size bytes and marks them with seed:
// the start of many properties.
func (e *env[R]) marked(n, size, seed int) *res[R] {
	e.t.Helper()
	x := e.reserve(n)
	require.NoError(e.t, e.b.Commit(x.r, 0, size))
	e.mark(x.r, 0, size, seed)
	return x
}

// marks writes a few pattern bytes at the head, middle and tail of each granule of
// [off, off+size), cheaper than filling 2 MiB granules.
func (e *env[R]) mark(r R, off, size, seed int) {
	e.t.Helper()
	for o := off; o < off+size; o += e.g() {
		for _, at := range markOffsets(e.g()) {
			e.write(r, o+at, pattern(seed+o/e.g(), 16))
		}
	}
}

func (e *env[R]) checkMark(r R, off, size, seed int, what string) {
	e.t.Helper()
	for o := off; o < off+size; o += e.g() {
		for _, at := range markOffsets(e.g()) {
			e.checkRead(r, o+at, pattern(seed+o/e.g(), 16), what)
		}
	}
}

func markOffsets(g int) []int {
	if g <= 16 {
		return []int{0}
	}
	return []int{0, (g / 2) &^ 15, g - 16}
}

// checkZero asserts that the granules of [off, off+size) read as zero where the
// backing promises it.
func (e *env[R]) checkZero(r R, off, size int, what string) {
	e.t.Helper()
	if z, ok := e.b.(backing.Zeroer); !ok || !z.CommitZeroes() {
		return
	}
	for o := off; o < off+size; o += e.g() {
		for _, at := range markOffsets(e.g()) {
			e.checkRead(r, o+at, make([]byte, 16), what)
		}
	}
}

// checkState asserts, without changing anything, that granule i of r is committed
// with mark seed when committed[i], and reserved otherwise.
func (e *env[R]) checkState(r R, committed []bool, seed int, what string) {
	e.t.Helper()
	g := e.g()
	for i, c := range committed {
		if c {
			e.checkMark(r, i*g, g, seed, what)
		} else {
			assert.ErrorIs(e.t, e.b.Decommit(r, i*g, g), backing.ErrNotCommitted, "%s: granule %d must be reserved", what, i)
		}
	}
}

// inUse returns the physical bytes in use by mappings (owned minus idle) under
// ByBacking, and false under ByBuffer.
func (e *env[R]) inUse() (int64, bool) {
	if p, ok := e.b.(backing.Pool); ok {
		if s := p.PoolStats(); s.Granule != 0 {
			return s.Owned - s.Idle, true
		}
	}
	a := e.b.Accounting().Authority()
	if a == nil {
		return 0, false
	}
	return a.Stats().Owned, true
}

// owned returns the authority's owned bytes under ByBacking.
func (e *env[R]) owned() (int64, bool) {
	a := e.b.Accounting().Authority()
	if a == nil {
		return 0, false
	}
	return a.Stats().Owned, true
}

// trim gives a pool's idle granules back so that owned bytes say what is mapped.
func (e *env[R]) trim() {
	if p, ok := e.b.(backing.Pool); ok {
		if _, err := p.Trim(0); err != nil && !errors.Is(err, backing.ErrUnsupported) {
			e.t.Errorf("Trim(0): %v", err)
		}
	}
}

// isOp asserts that err is an *OpError matching kind.
func isOp(t *testing.T, err, kind error, msgAndArgs ...any) {
	t.Helper()
	if !assert.ErrorIs(t, err, kind, msgAndArgs...) {
		return
	}
	var op *backing.OpError
	assert.True(t, errors.As(err, &op), "error %v is not a *backing.OpError", err)
}

func testIdentity[R any](e *env[R]) {
	t := e.t
	g := e.g()
	assert.True(t, backing.IsPowerOfTwo(g), "Granularity %d is not a power of two", g)
	assert.Equal(t, g, e.b.Granularity(), "Granularity must be constant")
	assert.Equal(t, e.b.Device(), e.b.Device(), "Device must be constant")
	if a := e.b.Accounting().Authority(); a != nil {
		assert.Equal(t, e.b.Device(), a.Device(), "a ByBacking authority must take bytes on the backing's device")
	}
	if e.b.Device().Tier != accounting.Host {
		assert.False(t, backing.IsHostAccessible(e.b), "device memory must not be HostAccessible")
	}
	assert.NotEmpty(t, e.accessors())
}

func testReserveUnreserve[R any](e *env[R]) {
	t := e.t
	e.trim()
	before, byBacking := e.owned()
	x := e.reserve(4)
	y := e.reserve(4)
	assert.NotZero(t, e.b.Base(x.r), "Base of a non-empty reservation")
	assert.Equal(t, 4*e.g(), e.b.Size(x.r))
	// Two live reservations never overlap.
	bx, by := e.b.Base(x.r), e.b.Base(y.r)
	assert.True(t, bx+uintptr(x.size) <= by || by+uintptr(y.size) <= bx, "reservations overlap: %#x and %#x", bx, by)
	if byBacking {
		now, _ := e.owned()
		assert.Equal(t, before, now, "Reserve must own no physical bytes")
	}
	e.unreserve(x, 0)
	e.unreserve(y, 0)
	if byBacking {
		now, _ := e.owned()
		assert.Equal(t, before, now, "owned bytes after Unreserve")
	}
}

func testReserveBadSize[R any](e *env[R]) {
	g := e.g()
	sizes := []struct {
		name string
		size int
	}{
		{"negative", -g},
		{"min int", math.MinInt},
		{"misaligned", g + g/2},
	}
	if g > 1 {
		sizes = append(sizes, struct {
			name string
			size int
		}{"one byte", 1})
	}
	for _, tt := range sizes {
		e.t.Run(tt.name, func(t *testing.T) {
			_, err := e.b.Reserve(tt.size)
			isOp(t, err, backing.ErrInvalidRange, "Reserve(%d)", tt.size)
		})
	}
}

func testZeroSize[R any](e *env[R]) {
	t := e.t
	x := e.reserve(0)
	assert.Equal(t, 0, e.b.Size(x.r))
	assert.Equal(t, e.b.Base(x.r), e.b.Base(x.r))
	assert.NoError(t, e.b.Commit(x.r, 0, 0), "an empty Commit is a no-op")
	assert.NoError(t, e.b.Decommit(x.r, 0, 0), "an empty Decommit is a no-op")
	isOp(t, e.b.Commit(x.r, 0, e.g()), backing.ErrOutOfRange)
	isOp(t, e.b.Decommit(x.r, 0, e.g()), backing.ErrOutOfRange)
	e.unreserve(x, 0)
}

func testLarge[R any](e *env[R]) {
	t := e.t
	e.trim()
	before, byBacking := e.owned()
	r, err := e.b.Reserve(largeReservation)
	if err != nil {
		isOp(t, err, backing.ErrOutOfMemory, "a 64 GiB reservation may only be refused for lack of memory")
		if byBacking {
			now, _ := e.owned()
			assert.Equal(t, before, now, "a refused Reserve must own nothing")
		}
		t.Logf("64 GiB reservation refused (accepted): %v", err)
		return
	}
	x := &res[R]{r: r, size: largeReservation}
	t.Cleanup(func() {
		if !x.done {
			e.b.Unreserve(r)
		}
	})
	g := e.g()
	last := largeReservation - g
	assert.Equal(t, largeReservation, e.b.Size(r))
	require.NoError(t, e.b.Commit(r, last, g), "commit the last granule")
	e.checkZero(r, last, g, "fresh last granule")
	e.mark(r, last, g, 7)
	e.checkMark(r, last, g, 7, "last granule")
	isOp(t, e.b.Commit(r, last+g, g), backing.ErrOutOfRange)
	isOp(t, e.b.Commit(r, last, 2*g), backing.ErrOutOfRange)
	e.unreserve(x, g)
	if byBacking {
		e.trim()
		now, _ := e.owned()
		assert.Equal(t, before, now, "owned bytes after Unreserve")
	}
}

// testReserveCommitsNothing checks that Reserve takes address space only: no granule
// of a new reservation is Committed (a Decommit of each is refused with
// ErrNotCommitted), and under ByBacking the ledger neither owns nor maps a byte more.
func testReserveCommitsNothing[R any](e *env[R]) {
	t := e.t
	g := e.g()
	e.trim()
	mapped := func() int64 {
		if a := e.b.Accounting().Authority(); a != nil {
			return a.Stats().Mapped
		}
		return 0
	}
	inUse, byBacking := e.inUse()
	owned, _ := e.owned()
	before := mapped()
	x := e.reserve(4)
	for i := range 4 {
		isOp(t, e.b.Decommit(x.r, i*g, g), backing.ErrNotCommitted, "granule %d of a new reservation", i)
	}
	if byBacking {
		now, _ := e.inUse()
		assert.Equal(t, inUse, now, "Reserve must commit nothing")
		nowOwned, _ := e.owned()
		assert.Equal(t, owned, nowOwned, "Reserve must own no physical bytes")
		assert.Equal(t, before, mapped(), "Reserve must map nothing")
	}
	e.unreserve(x, 0)
}

func testCommitWriteRead[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.reserve(4)
	require.NoError(t, e.b.Commit(x.r, g, 2*g))
	e.checkZero(x.r, g, 2*g, "fresh commit")
	// Every accessor writes, every accessor reads, across the granule boundary.
	for i, how := range e.accessors() {
		p := pattern(i+1, g)
		off := g + g/2
		e.writeVia(how, x.r, off, p)
		e.checkRead(x.r, off, p, "written via "+how)
	}
	e.unreserve(x, 2*g)
}

func testDecommitForfeits[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.marked(2, 2*g, 3)
	require.NoError(t, e.b.Decommit(x.r, 0, g))
	e.checkMark(x.r, g, g, 3, "the granule left committed")
	require.NoError(t, e.b.Commit(x.r, 0, g))
	// Whether recommitted memory is zero is the backing's answer, not an assumption;
	// either way it must be writable again.
	e.checkZero(x.r, 0, g, "recommitted granule")
	e.mark(x.r, 0, g, 4)
	e.checkMark(x.r, 0, g, 4, "recommitted granule")
	e.unreserve(x, 2*g)
}

func testBaseStable[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.reserve(4)
	base := e.b.Base(x.r)
	for i := range 3 {
		require.NoError(t, e.b.Commit(x.r, 0, (i+1)*g))
		assert.Equal(t, base, e.b.Base(x.r), "Base after commit %d", i)
		require.NoError(t, e.b.Decommit(x.r, 0, (i+1)*g))
		assert.Equal(t, base, e.b.Base(x.r), "Base after decommit %d", i)
	}
	assert.Equal(t, 4*g, e.b.Size(x.r))
	e.unreserve(x, 0)
}

// badRanges are the ranges every range-taking method must refuse, on a reservation
// of 4 granules.
func badRanges(g int) []struct {
	name      string
	off, size int
	kind      error
} {
	type rg = struct {
		name      string
		off, size int
		kind      error
	}
	out := []rg{
		{"negative offset", -g, g, backing.ErrInvalidRange},
		{"negative size", 0, -g, backing.ErrInvalidRange},
		{"min int offset", math.MinInt, g, backing.ErrInvalidRange},
		{"misaligned size", 0, g + g/2, backing.ErrInvalidRange},
		{"overflow", math.MaxInt &^ (g - 1), 2 * g, backing.ErrInvalidRange},
		{"past the end", 4 * g, g, backing.ErrOutOfRange},
		{"straddles the end", 3 * g, 2 * g, backing.ErrOutOfRange},
		{"far past the end", 1 << 50, g, backing.ErrOutOfRange},
	}
	if g > 1 {
		out = append(out, rg{"misaligned offset", 1, g, backing.ErrInvalidRange},
			rg{"misaligned both", g / 2, g / 2, backing.ErrInvalidRange})
	}
	return out
}

func testAlignment[R any](e *env[R]) { testRefusedRanges(e, backing.ErrInvalidRange, 0, 5) }

func testOutOfRange[R any](e *env[R]) { testRefusedRanges(e, backing.ErrOutOfRange, 3, 6) }

// testRefusedRanges commits granule at of a 4-granule reservation, then checks that
// every bad range of the given kind is refused by Commit and Decommit and changes
// nothing.
func testRefusedRanges[R any](e *env[R], kind error, at, mark int) {
	g := e.g()
	x := e.reserve(4)
	require.NoError(e.t, e.b.Commit(x.r, at*g, g))
	e.mark(x.r, at*g, g, mark)
	for _, tt := range badRanges(g) {
		if tt.kind != kind {
			continue
		}
		e.t.Run(tt.name, func(t *testing.T) {
			isOp(t, e.b.Commit(x.r, tt.off, tt.size), tt.kind, "Commit(%#x, %#x)", tt.off, tt.size)
			isOp(t, e.b.Decommit(x.r, tt.off, tt.size), tt.kind, "Decommit(%#x, %#x)", tt.off, tt.size)
		})
	}
	state := make([]bool, 4)
	state[at] = true
	e.checkState(x.r, state, mark, "after refused calls")
	e.unreserve(x, g)
}

func testDoubleCommit[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.reserve(4)
	require.NoError(t, e.b.Commit(x.r, g, g))
	e.mark(x.r, g, g, 8)
	for _, tt := range []struct {
		name      string
		off, size int
	}{
		{"same", g, g},
		{"overlap before", 0, 2 * g},
		{"overlap after", g, 2 * g},
		{"covers", 0, 4 * g},
	} {
		t.Run(tt.name, func(t *testing.T) {
			isOp(t, e.b.Commit(x.r, tt.off, tt.size), backing.ErrCommitted, "Commit(%#x, %#x)", tt.off, tt.size)
		})
	}
	e.checkState(x.r, []bool{false, true, false, false}, 8, "after refused commits")
	e.unreserve(x, g)
}

func testDecommitUncommitted[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.reserve(4)
	isOp(t, e.b.Decommit(x.r, 0, g), backing.ErrNotCommitted, "decommit of a reserved granule")
	require.NoError(t, e.b.Commit(x.r, g, g))
	e.mark(x.r, g, g, 9)
	isOp(t, e.b.Decommit(x.r, 0, 2*g), backing.ErrNotCommitted, "partly committed, hole first")
	isOp(t, e.b.Decommit(x.r, g, 2*g), backing.ErrNotCommitted, "partly committed, hole last")
	require.NoError(t, e.b.Decommit(x.r, g, g))
	isOp(t, e.b.Decommit(x.r, g, g), backing.ErrNotCommitted, "double decommit")
	e.checkState(x.r, []bool{false, false, false, false}, 9, "after double decommit")
	e.unreserve(x, 0)
}

func testFailedCallChangesNothing[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.reserve(6)
	// Committed: 1, 2 and 4; reserved: 0, 3, 5.
	state := []bool{false, true, true, false, true, false}
	for i, c := range state {
		if c {
			require.NoError(t, e.b.Commit(x.r, i*g, g))
		}
	}
	for i, c := range state {
		if c {
			e.mark(x.r, i*g, g, 10)
		}
	}
	e.trim()
	inUse, byBacking := e.inUse()
	// Each call fails on a granule after some that it could have changed already.
	isOp(t, e.b.Commit(x.r, 3*g, 2*g), backing.ErrCommitted, "commit [3,5) over committed 4")
	isOp(t, e.b.Commit(x.r, 0, 6*g), backing.ErrCommitted, "commit all")
	isOp(t, e.b.Decommit(x.r, g, 3*g), backing.ErrNotCommitted, "decommit [1,4) over reserved 3")
	isOp(t, e.b.Decommit(x.r, g, 5*g), backing.ErrNotCommitted, "decommit [1,6)")
	isOp(t, e.b.Commit(x.r, 5*g, 2*g), backing.ErrOutOfRange, "commit past the end")
	isOp(t, e.b.Decommit(x.r, 4*g, 3*g), backing.ErrOutOfRange, "decommit past the end")
	e.checkState(x.r, state, 10, "after refused calls")
	if byBacking {
		now, _ := e.inUse()
		assert.Equal(t, inUse, now, "refused calls must not change physical bytes in use")
	}
	e.unreserve(x, 3*g)
}

func testConcurrent[R any](e *env[R]) {
	const workers, perWorker, rounds = 4, 2, 8
	g := e.g()
	e.accessors() // probe before the goroutines start
	x := e.reserve(workers * perWorker)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := w * perWorker * g
			for round := range rounds {
				// Alternate between one granule at a time and the worker's whole range.
				if round%2 == 0 {
					for k := range perWorker {
						if !assert.NoError(e.t, e.b.Commit(x.r, off+k*g, g)) {
							return
						}
					}
				} else if !assert.NoError(e.t, e.b.Commit(x.r, off, perWorker*g)) {
					return
				}
				p := pattern(w*rounds+round, 64)
				for k := range perWorker {
					e.writeConcurrent(x.r, off+k*g+g-64, p)
				}
				for k := range perWorker {
					if got := e.readConcurrent(x.r, off+k*g+g-64, 64); !bytes.Equal(got, p) {
						e.t.Errorf("worker %d round %d: granule %d lost its contents", w, round, k)
					}
				}
				if !assert.NoError(e.t, e.b.Decommit(x.r, off, perWorker*g)) {
					return
				}
			}
		}()
	}
	wg.Wait()
	e.checkState(x.r, make([]bool, workers*perWorker), 0, "after the workers")
	e.unreserve(x, 0)
}

// writeConcurrent and readConcurrent are writeVia and readVia for goroutines other
// than the test's: they report with Errorf rather than stop the test.
func (e *env[R]) writeConcurrent(r R, off int, p []byte) {
	if e.copier {
		if err := e.b.(backing.Copier[R]).CopyIn(r, off, p); err != nil {
			e.t.Errorf("CopyIn at %#x: %v", off, err)
		}
		return
	}
	copy(hostBytes(e.b.Base(r)+uintptr(off), len(p)), p)
}

func (e *env[R]) readConcurrent(r R, off, n int) []byte {
	p := make([]byte, n)
	if e.copier {
		if err := e.b.(backing.Copier[R]).CopyOut(p, r, off); err != nil {
			e.t.Errorf("CopyOut at %#x: %v", off, err)
		}
		return p
	}
	copy(p, hostBytes(e.b.Base(r)+uintptr(off), n))
	return p
}

func testUnreserveCommitted[R any](e *env[R]) {
	t := e.t
	g := e.g()
	e.trim()
	before, byBacking := e.owned()
	x := e.reserve(5)
	require.NoError(t, e.b.Commit(x.r, 0, g))
	require.NoError(t, e.b.Commit(x.r, 2*g, 2*g))
	e.mark(x.r, 0, g, 11)
	if byBacking {
		now, _ := e.owned()
		assert.GreaterOrEqual(t, now, before+int64(3*g), "ByBacking must own the committed granules")
	} else if a := e.b.Accounting().Authority(); a != nil {
		t.Errorf("ByBuffer accounting with an authority")
	}
	e.unreserve(x, 3*g)
	if byBacking {
		e.trim()
		now, _ := e.owned()
		assert.Equal(t, before, now, "Unreserve must give every committed granule back")
	}
}

func testUseAfterUnreserve[R any](e *env[R]) {
	t := e.t
	g := e.g()
	x := e.reserve(2)
	y := e.reserve(2)
	require.NoError(t, e.b.Commit(x.r, 0, g))
	require.NoError(t, e.b.Commit(y.r, 0, g))
	e.unreserve(x, g)
	r := x.r
	const want = backing.PanicUseAfterUnreserve
	calls := []struct {
		name string
		fn   func()
	}{
		{"Base", func() { e.b.Base(r) }},
		{"Size", func() { e.b.Size(r) }},
		{"Commit", func() { _ = e.b.Commit(r, g, g) }},
		{"Decommit", func() { _ = e.b.Decommit(r, 0, g) }},
		{"Unreserve", func() { e.b.Unreserve(r) }},
	}
	if c, ok := e.b.(backing.Copier[R]); ok && e.copier {
		calls = append(calls,
			struct {
				name string
				fn   func()
			}{"CopyIn", func() { _ = c.CopyIn(r, 0, []byte{1}) }},
			struct {
				name string
				fn   func()
			}{"CopyOut", func() { _ = c.CopyOut(make([]byte, 1), r, 0) }})
	}
	if p, ok := e.b.(backing.Populator[R]); ok && e.supports(func() error { return p.Populate(y.r, 0, g) }) {
		calls = append(calls, struct {
			name string
			fn   func()
		}{"Populate", func() { _ = p.Populate(r, 0, g) }})
	}
	if s, ok := e.b.(backing.Sharer[R]); ok {
		z := e.reserve(2)
		if e.supports(func() error { return s.Share(z.r, 0, y.r, 0, g, backing.ReadWrite) }) {
			calls = append(calls,
				struct {
					name string
					fn   func()
				}{"ShareFrom", func() { _ = s.Share(z.r, g, r, 0, g, backing.ReadWrite) }},
				struct {
					name string
					fn   func()
				}{"ShareInto", func() { _ = s.Share(r, g, y.r, 0, g, backing.ReadWrite) }})
		}
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			assert.PanicsWithValue(t, want, c.fn)
		})
	}
}

// supports runs a capability call that must either work or answer ErrUnsupported, and
// reports which.
func (e *env[R]) supports(call func() error) bool {
	e.t.Helper()
	err := call()
	if errors.Is(err, backing.ErrUnsupported) {
		return false
	}
	require.NoError(e.t, err)
	return true
}

func testForeign[R any](e *env[R]) {
	t := e.t
	g := e.g()
	other := e.newBacking(t)
	require.Equal(t, g, other.Granularity(), "the factory must make alike backings")
	x := e.reserve(2)
	y := reserveOn(t, other, 2*g) // other's reservation, foreign to e.b
	require.NoError(t, e.b.Commit(x.r, 0, g))
	e.mark(x.r, 0, g, 12)
	require.NoError(t, other.Commit(y.r, 0, g))

	isOp(t, e.b.Commit(y.r, g, g), backing.ErrForeignReservation, "Commit")
	isOp(t, e.b.Decommit(y.r, 0, g), backing.ErrForeignReservation, "Decommit")
	o := e.b.Unreserve(y.r)
	assert.Equal(t, accounting.Failed, o.Status, "Unreserve of a foreign reservation: %v", o)
	isOp(t, o.Err, backing.ErrForeignReservation, "Unreserve")
	if c, ok := e.b.(backing.Copier[R]); ok && e.copier {
		isOp(t, c.CopyIn(y.r, 0, []byte{1}), backing.ErrForeignReservation, "CopyIn")
		isOp(t, c.CopyOut(make([]byte, 1), y.r, 0), backing.ErrForeignReservation, "CopyOut")
	}
	if p, ok := e.b.(backing.Populator[R]); ok {
		if err := p.Populate(y.r, 0, g); !errors.Is(err, backing.ErrUnsupported) {
			isOp(t, err, backing.ErrForeignReservation, "Populate")
		}
	}
	if s, ok := e.b.(backing.Sharer[R]); ok {
		if err := s.Share(x.r, g, y.r, 0, g, backing.ReadWrite); !errors.Is(err, backing.ErrUnsupported) {
			isOp(t, err, backing.ErrForeignReservation, "Share from a foreign source")
		}
		if err := s.Share(y.r, g, x.r, 0, g, backing.ReadWrite); !errors.Is(err, backing.ErrUnsupported) {
			isOp(t, err, backing.ErrForeignReservation, "Share into a foreign destination")
		}
	}
	// Nothing changed on either side.
	e.checkState(x.r, []bool{true, false}, 12, "own reservation after foreign calls")
	assert.ErrorIs(t, other.Decommit(y.r, g, g), backing.ErrNotCommitted, "foreign reservation, granule 1")
	require.NoError(t, other.Decommit(y.r, 0, g), "foreign reservation, granule 0 is still committed")
	if o := other.Unreserve(y.r); assert.True(t, o.OK(), "%v", o) {
		y.done = true
	}
	e.unreserve(x, g)
}
