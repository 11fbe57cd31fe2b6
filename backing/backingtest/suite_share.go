package backingtest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
)

// The properties of [backing.Copier] and [backing.Sharer]: byte-granular copies and
// their refusals; sharing granules between reservations and within one, read-only
// mappings, partial decommits of a shared range, and the refused shares.

func testCopier[R any](e *env[R]) {
	t := e.t
	c, ok := e.b.(backing.Copier[R])
	if !ok || !e.accessorsHave("copier") {
		t.Log("not a Copier: its contents are reached directly")
		return
	}
	g := e.g()
	x := e.reserve(3)
	require.NoError(t, e.b.Commit(x.r, 0, 2*g))
	// Byte-granular ranges inside the committed part are fine.
	p := pattern(13, 3)
	require.NoError(t, c.CopyIn(x.r, 2*g-2, p[:2]))
	require.NoError(t, c.CopyIn(x.r, 1, p))
	e.checkRead(x.r, 2*g-2, p[:2], "unaligned CopyIn at the end")
	e.checkRead(x.r, 1, p, "unaligned CopyIn")
	assert.NoError(t, c.CopyIn(x.r, 0, nil), "empty CopyIn")
	assert.NoError(t, c.CopyOut(nil, x.r, 0), "empty CopyOut")
	for _, tt := range []struct {
		name string
		off  int
		n    int
		kind error
	}{
		{"into the reserved granule", 2 * g, 1, backing.ErrNotCommitted},
		{"across into the reserved granule", 2*g - 1, 2, backing.ErrNotCommitted},
		{"past the end", 3 * g, 1, backing.ErrOutOfRange},
		{"across the end", 3*g - 1, 2, backing.ErrOutOfRange},
		{"negative offset", -1, 1, backing.ErrInvalidRange},
	} {
		t.Run(tt.name, func(t *testing.T) {
			buf := make([]byte, tt.n)
			isOp(t, c.CopyIn(x.r, tt.off, buf), tt.kind, "CopyIn")
			isOp(t, c.CopyOut(buf, x.r, tt.off), tt.kind, "CopyOut")
		})
	}
	e.checkRead(x.r, 2*g-2, p[:2], "after refused copies")
	e.unreserve(x, 2*g)
}

// sharer returns the backing's Sharer if sharing works, after checking on a probe
// that a refusal (ErrUnsupported) changed nothing.
func (e *env[R]) sharer() (backing.Sharer[R], bool) {
	t := e.t
	s, ok := e.b.(backing.Sharer[R])
	if !ok {
		t.Log("not a Sharer")
		return nil, false
	}
	g := e.g()
	a := e.reserve(1)
	b := e.reserve(1)
	require.NoError(t, e.b.Commit(a.r, 0, g))
	e.mark(a.r, 0, g, 14)
	err := s.Share(b.r, 0, a.r, 0, g, backing.ReadWrite)
	if errors.Is(err, backing.ErrUnsupported) {
		e.checkState(a.r, []bool{true}, 14, "source after a refused Share")
		e.checkState(b.r, []bool{false}, 0, "destination after a refused Share")
		e.unreserve(a, g)
		e.unreserve(b, 0)
		t.Logf("Share answers ErrUnsupported here: %v", err)
		return nil, false
	}
	require.NoError(t, err, "probe Share")
	e.checkMark(b.r, 0, g, 14, "probe Share")
	e.unreserve(a, g)
	e.unreserve(b, g)
	e.trim()
	return s, true
}

func testShareWriteRead[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(3)
	b := e.reserve(3)
	require.NoError(t, e.b.Commit(a.r, 0, 2*g))
	require.NoError(t, s.Share(b.r, g, a.r, 0, 2*g, backing.ReadWrite), "share A[0,2) at B[1,3)")
	for i, how := range e.accessors() {
		p := pattern(20+i, 64)
		e.writeVia(how, a.r, g+g/2, p)
		e.checkRead(b.r, 2*g+g/2, p, "written in A via "+how+", read in B")
		q := pattern(30+i, 64)
		e.writeVia(how, b.r, g, q)
		e.checkRead(a.r, 0, q, "written in B via "+how+", read in A")
	}
	isOp(t, e.b.Decommit(b.r, 0, g), backing.ErrNotCommitted, "B's granule 0 stays reserved")
	e.unreserve(b, 2*g)
	e.unreserve(a, 2*g)
}

func testShareDecommitSource[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(2)
	b := e.reserve(2)
	require.NoError(t, e.b.Commit(a.r, 0, 2*g))
	e.mark(a.r, 0, 2*g, 15)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, 2*g, backing.ReadWrite))
	require.NoError(t, e.b.Decommit(a.r, 0, 2*g))
	e.checkMark(b.r, 0, 2*g, 15, "B after A decommitted")
	// A's range is reserved again and commits fresh memory, not B's.
	require.NoError(t, e.b.Commit(a.r, 0, g))
	e.checkZero(a.r, 0, g, "A recommitted")
	e.mark(a.r, 0, g, 16)
	e.checkMark(b.r, 0, 2*g, 15, "B after A recommitted and written")
	e.unreserve(a, g)
	e.checkMark(b.r, 0, 2*g, 15, "B after A unreserved")
	e.unreserve(b, 2*g)
}

func testShareLastMapping[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := int64(e.g())
	start, byBacking := e.inUse()
	require.True(t, byBacking, "a backing that shares must own its granules (ByBacking)")
	a := e.reserve(1)
	b := e.reserve(1)
	c := e.reserve(1)
	require.NoError(t, e.b.Commit(a.r, 0, int(g)))
	e.mark(a.r, 0, int(g), 17)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, int(g), backing.ReadWrite))
	require.NoError(t, s.Share(c.r, 0, b.r, 0, int(g), backing.ReadOnly), "share a shared mapping")
	now, _ := e.inUse()
	assert.Equal(t, start+g, now, "a granule mapped three times is owned once")
	e.unreserve(a, int(g))
	now, _ = e.inUse()
	assert.Equal(t, start+g, now, "two mappings left")
	e.checkMark(c.r, 0, int(g), 17, "C after A went")
	require.NoError(t, e.b.Decommit(b.r, 0, int(g)))
	now, _ = e.inUse()
	assert.Equal(t, start+g, now, "one mapping left")
	e.checkMark(c.r, 0, int(g), 17, "C after B decommitted")
	e.unreserve(c, int(g))
	now, _ = e.inUse()
	assert.Equal(t, start, now, "the last mapping went")
	e.unreserve(b, 0)
}

func testShareReadOnly[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(2)
	b := e.reserve(2)
	require.NoError(t, e.b.Commit(a.r, 0, 2*g))
	e.mark(a.r, 0, 2*g, 18)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, 2*g, backing.ReadOnly))
	e.checkMark(b.r, 0, 2*g, 18, "read-only share")
	// The owner still writes, and the read-only mapping sees it.
	p := pattern(19, 32)
	e.write(a.r, g, p)
	e.checkRead(b.r, g, p, "read-only share after the owner wrote")
	e.unreserve(b, 2*g)
	e.unreserve(a, 2*g)
}

func testShareReadOnlyCopyIn[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	c, ok := e.b.(backing.Copier[R])
	if !ok || !e.accessorsHave("copier") {
		t.Log("not a Copier: a read-only mapping is only written directly, which faults")
		return
	}
	g := e.g()
	a := e.reserve(2)
	b := e.reserve(2)
	m := e.reserve(2)
	require.NoError(t, e.b.Commit(a.r, 0, 2*g))
	e.mark(a.r, 0, 2*g, 40)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, 2*g, backing.ReadOnly))
	// m maps granule 0 read-write and granule 1 read-only: a copy across both must not
	// write the writable part either.
	require.NoError(t, s.Share(m.r, 0, a.r, 0, g, backing.ReadWrite))
	require.NoError(t, s.Share(m.r, g, a.r, g, g, backing.ReadOnly))
	for _, tt := range []struct {
		name string
		r    R
		off  int
		n    int
	}{
		{"first byte", b.r, 0, 1},
		{"granule head", b.r, 0, 16},
		{"across granules", b.r, g - 8, 16},
		{"second granule", b.r, g + g/2, 16},
		{"whole range", b.r, 0, 2 * g},
		{"from a writable granule into a read-only one", m.r, g - 8, 16},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.Error(t, c.CopyIn(tt.r, tt.off, bytes.Repeat([]byte{0xEE}, tt.n)), "CopyIn through a read-only mapping")
		})
	}
	e.checkMark(a.r, 0, 2*g, 40, "source after refused writes")
	e.checkMark(b.r, 0, 2*g, 40, "read-only mapping after refused writes")
	e.checkMark(m.r, 0, 2*g, 40, "mixed mapping after refused writes")
	e.unreserve(m, 2*g)
	e.unreserve(b, 2*g)
	e.unreserve(a, 2*g)
}

func testShareUnknownProtection[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(1)
	b := e.reserve(1)
	require.NoError(t, e.b.Commit(a.r, 0, g))
	e.mark(a.r, 0, g, 41)
	before := e.books()
	for _, prot := range []backing.Protection{backing.ReadOnly + 1, 7, 255} {
		assert.Error(t, s.Share(b.r, 0, a.r, 0, g, prot), "Share with protection %d", prot)
	}
	e.checkState(a.r, []bool{true}, 41, "source after refused shares")
	e.checkState(b.r, []bool{false}, 0, "destination after refused shares")
	e.expectBooks(before, 0, 0, "refused shares")
	e.unreserve(b, 0)
	e.unreserve(a, g)
}

func testShareWithin[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	x := e.marked(5, 2*g, 42)
	before := e.books()
	require.NoError(t, s.Share(x.r, 3*g, x.r, 0, 2*g, backing.ReadWrite), "share [0,2) of a reservation at [3,5) of itself")
	e.expectBooks(before, int64(2*g), 0, "Share within one reservation")
	e.checkMark(x.r, 3*g, g, 42-3, "the shared range")
	e.checkMark(x.r, 4*g, g, 42-3, "the shared range")
	for i, how := range e.accessors() {
		p := pattern(43+i, 64)
		e.writeVia(how, x.r, g+g/2, p)
		e.checkRead(x.r, 4*g+g/2, p, "written in the source via "+how+", read in the destination")
		q := pattern(53+i, 64)
		e.writeVia(how, x.r, 3*g, q)
		e.checkRead(x.r, 0, q, "written in the destination via "+how+", read in the source")
	}
	isOp(t, e.b.Decommit(x.r, 2*g, g), backing.ErrNotCommitted, "the granule between stays reserved")
	e.unreserve(x, 4*g)
}

func testShareDecommitPart[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(3)
	b := e.reserve(3)
	require.NoError(t, e.b.Commit(a.r, 0, 3*g))
	e.mark(a.r, 0, 3*g, 44)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, 3*g, backing.ReadWrite))
	before := e.books()
	require.NoError(t, e.b.Decommit(b.r, g, g), "decommit the middle of the shared range")
	e.expectBooks(before, -int64(g), 0, "decommit of one mapping of a granule mapped twice")
	e.checkState(b.r, []bool{true, false, true}, 44, "destination after its middle went")
	e.checkState(a.r, []bool{true, true, true}, 44, "source after the destination's middle went")
	// What is left of the destination is still the source's memory.
	p := pattern(45, 32)
	e.write(b.r, 2*g+g/2, p)
	e.checkRead(a.r, 2*g+g/2, p, "written in the destination's tail, read in the source")
	e.unreserve(b, 2*g)
	e.unreserve(a, 3*g)
}

func testShareErrors[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(4)
	b := e.reserve(4)
	require.NoError(t, e.b.Commit(a.r, 0, 2*g))
	e.mark(a.r, 0, 2*g, 21)
	require.NoError(t, e.b.Commit(b.r, 3*g, g))
	e.mark(b.r, 3*g, g, 21)
	other := e.newBacking(t)
	f := reserveOn(t, other, 4*g)
	require.NoError(t, other.Commit(f.r, 0, g))
	e.trim()
	inUse, _ := e.inUse()
	for _, tt := range []struct {
		name         string
		dst          R
		dstOff       int
		src          R
		srcOff, size int
		kind         error
	}{
		{"uncommitted source", b.r, 0, a.r, 2 * g, g, backing.ErrNotCommitted},
		{"partly uncommitted source", b.r, 0, a.r, g, 2 * g, backing.ErrNotCommitted},
		{"committed destination", b.r, 3 * g, a.r, 0, g, backing.ErrCommitted},
		{"partly committed destination", b.r, 2 * g, a.r, 0, 2 * g, backing.ErrCommitted},
		{"onto itself", a.r, 0, a.r, 0, g, backing.ErrCommitted},
		{"foreign source", b.r, 0, f.r, 0, g, backing.ErrForeignReservation},
		{"foreign destination", f.r, g, a.r, 0, g, backing.ErrForeignReservation},
		{"misaligned", b.r, g / 2, a.r, 0, g, backing.ErrInvalidRange},
		{"negative size", b.r, 0, a.r, 0, -g, backing.ErrInvalidRange},
		{"source out of range", b.r, 0, a.r, 3 * g, 2 * g, backing.ErrOutOfRange},
		{"destination out of range", b.r, 3 * g, a.r, 0, 2 * g, backing.ErrOutOfRange},
	} {
		if tt.name == "misaligned" && g == 1 {
			continue
		}
		t.Run(tt.name, func(t *testing.T) {
			isOp(t, s.Share(tt.dst, tt.dstOff, tt.src, tt.srcOff, tt.size, backing.ReadWrite), tt.kind)
		})
	}
	e.checkState(a.r, []bool{true, true, false, false}, 21, "source after refused shares")
	e.checkState(b.r, []bool{false, false, false, true}, 21, "destination after refused shares")
	now, _ := e.inUse()
	assert.Equal(t, inUse, now, "refused shares must not change physical bytes in use")
	e.unreserve(a, 2*g)
	e.unreserve(b, g)
}

// testShareFromReadOnly checks that Share grants ReadWrite only on memory the source
// may write now: a granule shared ReadOnly into the source, or one its owner
// protected, is refused with ErrReadOnly and nothing changes; ReadOnly shares of both
// work (prefixes chain so); and once the owner makes its range ReadWrite again, a
// ReadWrite share of it works. Without a Protector only the first half is checked.
func testShareFromReadOnly[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	p, c, protects := e.protector()
	t := e.t
	g := e.g()
	// a: three granules of its own, the last protected ReadOnly (with a Protector).
	// b: granule 0 its own, 1 and 2 shared ReadOnly from a's 0 and 1.
	a := e.marked(3, 3*g, 70)
	b := e.marked(3, g, 80)
	require.NoError(t, s.Share(b.r, g, a.r, 0, 2*g, backing.ReadOnly))
	if protects {
		require.NoError(t, p.Protect(a.r, 2*g, g, backing.ReadOnly))
	}
	w := e.reserve(4)
	before := e.books()
	type share struct {
		name         string
		dst          R
		dstOff       int
		src          R
		srcOff, size int
		kind         error
	}
	refused := []share{
		{"shared read-only into the source", w.r, 0, b.r, g, g, backing.ErrReadOnly},
		{"own, then shared read-only", w.r, 0, b.r, 0, 2 * g, backing.ErrReadOnly},
		{"a chained read-only share onto a committed destination", b.r, 0, b.r, g, g, backing.ErrCommitted},
	}
	if protects {
		refused = append(refused,
			share{"protected in the source", w.r, 0, a.r, 2 * g, g, backing.ErrReadOnly},
			share{"writable, then protected", w.r, 0, a.r, g, 2 * g, backing.ErrReadOnly},
			share{"a protected source onto a committed destination", b.r, 0, a.r, 2 * g, g, backing.ErrCommitted})
	}
	for _, tt := range refused {
		t.Run(tt.name, func(t *testing.T) {
			isOp(t, s.Share(tt.dst, tt.dstOff, tt.src, tt.srcOff, tt.size, backing.ReadWrite), tt.kind,
				"ReadWrite share of memory its source may not write")
		})
	}
	e.sameBooks(before, "refused shares")
	e.checkState(w.r, []bool{false, false, false, false}, 0, "destination after refused shares")
	e.checkMark(a.r, 0, 3*g, 70, "source after refused shares")
	e.checkMark(b.r, 0, g, 80, "the sharer's own granule after refused shares")
	e.checkMark(b.r, g, 2*g, 69, "the sharer's read-only granules after refused shares")
	e.readOnly(c, b.r, g, 2*g, 69, "the sharer's read-only granules after refused shares")
	if protects {
		e.readOnly(c, a.r, 2*g, g, 70, "the protected granule after refused shares")
		e.writable(c, a.r, 0, 2*g, "the owner's writable granules after refused shares")
	}
	if t.Failed() {
		return // a refused share may have mapped something writable
	}

	// ReadOnly shares of the same granules work, and stay read-only.
	require.NoError(t, s.Share(w.r, 0, b.r, g, 2*g, backing.ReadOnly), "read-only share of a read-only share")
	shared := 2
	if protects {
		require.NoError(t, s.Share(w.r, 2*g, a.r, 2*g, g, backing.ReadOnly), "read-only share of a protected range")
		shared++
	}
	e.expectBooks(before, int64(shared*g), 0, "read-only shares of read-only memory")
	e.checkMark(w.r, 0, shared*g, 70, "read-only shares of read-only memory")
	e.readOnly(c, w.r, 0, shared*g, 70, "read-only shares of read-only memory")
	// ReadWrite from a writable granule of a source that holds read-only ones works.
	require.NoError(t, s.Share(w.r, 3*g, b.r, 0, g, backing.ReadWrite), "read-write share of the sharer's own granule")
	q := pattern(81, 32)
	e.write(w.r, 3*g+g/4, q)
	e.checkRead(b.r, g/4, q, "written through the read-write share, read in its source")

	if protects {
		// Once the owner may write again, so may a new read-write sharer.
		require.NoError(t, p.Protect(a.r, 2*g, g, backing.ReadWrite), "the owner writes again")
		v := e.reserve(1)
		require.NoError(t, s.Share(v.r, 0, a.r, 2*g, g, backing.ReadWrite), "read-write share once the owner's range is writable")
		q2 := pattern(82, 32)
		e.write(v.r, g/4, q2)
		e.checkRead(a.r, 2*g+g/4, q2, "written by the new read-write sharer, read in the owner")
		e.checkRead(w.r, 2*g+g/4, q2, "written by the new read-write sharer, read in the read-only sharer")
		e.readOnly(c, w.r, 2*g, g, 70, "the read-only share after the owner went back")
		e.unreserve(v, g)
	}
	e.unreserve(w, (shared+1)*g)
	e.unreserve(b, 3*g)
	e.unreserve(a, 3*g)
}

// testShareReport checks each Share against the ledger: a Share that succeeds moves
// the bytes in use (owned minus a pool's idle) and the authority's Mapped by
// exactly backing.ShareReport (owns nothing new, maps size bytes), whether its
// source granules are the source's own, shared to it, or in its own reservation; a
// Share that fails moves nothing.
func testShareReport[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(4)
	b := e.reserve(3)
	c := e.reserve(2)
	require.NoError(t, e.b.Commit(a.r, 0, 3*g))
	ledger := func() (inUse, mapped int64) {
		inUse, _ = e.inUse()
		return inUse, e.b.Accounting().Authority().Stats().Mapped
	}
	var sum backing.MapReport
	start, startMapped := ledger()
	for _, tt := range []struct {
		name         string
		dst          R
		dstOff       int
		src          R
		srcOff, size int
		prot         backing.Protection
		fails        error
	}{
		{"own granules", b.r, 0, a.r, 0, 2 * g, backing.ReadWrite, nil},
		{"a shared mapping onward", c.r, 0, b.r, g, g, backing.ReadOnly, nil},
		{"within one reservation", a.r, 3 * g, a.r, 2 * g, g, backing.ReadOnly, nil},
		{"onto a committed granule", c.r, 0, a.r, 0, g, backing.ReadOnly, backing.ErrCommitted},
		{"from a reserved granule", c.r, g, b.r, 2 * g, g, backing.ReadOnly, backing.ErrNotCommitted},
	} {
		inUse, mapped := ledger()
		err := s.Share(tt.dst, tt.dstOff, tt.src, tt.srcOff, tt.size, tt.prot)
		want := backing.ShareReport(tt.size, g)
		if tt.fails != nil {
			isOp(t, err, tt.fails, tt.name)
			want = backing.MapReport{}
		} else {
			require.NoError(t, err, tt.name)
		}
		nowInUse, nowMapped := ledger()
		assert.Equal(t, want.Owned, nowInUse-inUse, "%s: bytes newly owned", tt.name)
		assert.Equal(t, want.Mapped, nowMapped-mapped, "%s: bytes newly mapped", tt.name)
		sum = sum.Add(want)
	}
	end, endMapped := ledger()
	assert.Equal(t, backing.MapReport{Owned: 0, Mapped: int64(4 * g), Granules: 4}, sum, "the reports of the Shares")
	assert.Equal(t, sum.Owned, end-start, "the reports' Owned against the ledger")
	assert.Equal(t, sum.Mapped, endMapped-startMapped, "the reports' Mapped against the ledger")
	e.unreserve(a, 4*g)
	e.unreserve(b, 2*g)
	e.unreserve(c, g)
}
