package backingtest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
)

// The properties of [backing.Protector]. Writes to read-only memory are only ever
// tried through Copier.CopyIn, which must refuse them: a direct store would fault and
// kill the test process. A backing that is a Protector but not a Copier is checked
// for everything but the refusals.

// protector returns the backing's Protector and its Copier (nil when the contents are
// only reached directly) if protecting works, after checking on a probe that a
// refusal (ErrUnsupported) changed nothing.
func (e *env[R]) protector() (backing.Protector[R], backing.Copier[R], bool) {
	t := e.t
	p, ok := e.b.(backing.Protector[R])
	if !ok {
		t.Log("not a Protector")
		return nil, nil, false
	}
	g := e.g()
	x := e.marked(1, g, 60)
	err := p.Protect(x.r, 0, g, backing.ReadOnly)
	if errors.Is(err, backing.ErrUnsupported) {
		e.checkState(x.r, []bool{true}, 60, "after a refused Protect")
		e.writable(nil, x.r, 0, g, "after a refused Protect")
		e.unreserve(x, g)
		t.Logf("Protect answers ErrUnsupported here: %v", err)
		return nil, nil, false
	}
	require.NoError(t, err, "probe Protect")
	e.unreserve(x, g)
	e.trim()
	var c backing.Copier[R]
	if e.accessorsHave("copier") {
		c = e.b.(backing.Copier[R])
	} else {
		t.Log("not a Copier: writes to read-only memory are not tried (they would fault)")
	}
	return p, c, true
}

// writable asserts that every granule of [off, off+size) of r takes a CopyIn, which
// leaves the contents as they were (it writes back what it read). With a nil c it
// does nothing beyond the write through the first accessor, which must be direct.
func (e *env[R]) writable(c backing.Copier[R], r R, off, size int, what string) {
	e.t.Helper()
	if c == nil {
		c, _ = e.b.(backing.Copier[R])
		if c == nil || !e.accessorsHave("copier") {
			return
		}
	}
	for o := off; o < off+size; o += e.g() {
		p := e.readVia("copier", r, o, 16)
		assert.NoError(e.t, c.CopyIn(r, o, p), "%s: CopyIn at %#x must work", what, o)
	}
}

// readOnly asserts that a CopyIn into any granule of [off, off+size) of r is refused
// with ErrReadOnly, also one that starts in the granule before, and that nothing was
// written. Without a Copier it checks nothing.
func (e *env[R]) readOnly(c backing.Copier[R], r R, off, size, seed int, what string) {
	e.t.Helper()
	if c == nil {
		return
	}
	g := e.g()
	for o := off; o < off+size; o += g {
		junk := bytes.Repeat([]byte{0xEE}, 16)
		isOp(e.t, c.CopyIn(r, o, junk), backing.ErrReadOnly, "%s: CopyIn at %#x", what, o)
		isOp(e.t, c.CopyIn(r, o+g-16, junk), backing.ErrReadOnly, "%s: CopyIn at the end of the granule at %#x", what, o)
		if o > 0 {
			isOp(e.t, c.CopyIn(r, o-8, junk), backing.ErrReadOnly, "%s: CopyIn across into the granule at %#x", what, o)
		}
	}
	e.checkMark(r, off, size, seed, what+": after refused writes")
}

func testProtectRoundTrip[R any](e *env[R]) {
	p, c, ok := e.protector()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	x := e.marked(4, 3*g, 61)
	before := e.books()
	require.NoError(t, p.Protect(x.r, 0, 2*g, backing.ReadOnly))
	e.sameBooks(before, "Protect ReadOnly")
	e.checkMark(x.r, 0, 3*g, 61, "after Protect ReadOnly")
	e.readOnly(c, x.r, 0, 2*g, 61, "protected")
	e.writable(c, x.r, 2*g, g, "the granule past the protected range")
	require.NoError(t, p.Protect(x.r, g, g, backing.ReadOnly), "ReadOnly again")
	e.readOnly(c, x.r, 0, 2*g, 61, "protected twice")
	require.NoError(t, p.Protect(x.r, 0, 3*g, backing.ReadWrite))
	e.sameBooks(before, "Protect ReadWrite")
	e.checkMark(x.r, 0, 3*g, 61, "after Protect ReadWrite")
	e.writable(c, x.r, 0, 3*g, "after Protect ReadWrite")
	if t.Failed() {
		return // a direct write below could fault
	}
	// Written after the round trip, through every accessor.
	for i, how := range e.accessors() {
		q := pattern(62+i, 64)
		e.writeVia(how, x.r, g-32, q)
		e.checkRead(x.r, g-32, q, "written via "+how+" after the round trip")
	}
	require.NoError(t, p.Protect(x.r, 0, 0, backing.ReadOnly), "an empty Protect is a no-op")
	e.writable(c, x.r, 0, 3*g, "after an empty Protect")
	e.unreserve(x, 3*g)
}

func testProtectOtherMappings[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	p, c, ok := e.protector()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(2)
	b := e.reserve(2)
	w := e.reserve(2)
	require.NoError(t, e.b.Commit(a.r, 0, 2*g))
	e.mark(a.r, 0, 2*g, 63)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, 2*g, backing.ReadOnly))
	require.NoError(t, s.Share(w.r, 0, a.r, 0, 2*g, backing.ReadWrite))
	require.NoError(t, p.Protect(a.r, 0, 2*g, backing.ReadOnly), "the origin goes read-only as its sharer is")
	e.readOnly(c, a.r, 0, 2*g, 63, "protected origin")
	e.readOnly(c, b.r, 0, 2*g, 63, "read-only sharer of a protected origin")
	// Protect leaves other mappings be: a read-write sharer mapped before still writes.
	e.writable(c, w.r, 0, 2*g, "read-write sharer of a protected origin")
	q := pattern(64, 32)
	e.write(w.r, g+8, q)
	e.checkRead(a.r, g+8, q, "written by a read-write sharer, read in the protected origin")
	e.checkRead(b.r, g+8, q, "written by a read-write sharer, read in the read-only sharer")
	require.NoError(t, p.Protect(a.r, 0, 2*g, backing.ReadWrite), "the owner may write again")
	e.writable(c, a.r, 0, 2*g, "origin back to ReadWrite")
	e.readOnly(c, b.r, 0, g, 63, "the read-only sharer after the origin went back")
	e.unreserve(w, 2*g)
	e.unreserve(b, 2*g)
	e.unreserve(a, 2*g)
}

func testProtectSharer[R any](e *env[R]) {
	s, ok := e.sharer()
	if !ok {
		return
	}
	p, c, ok := e.protector()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	a := e.reserve(3)
	b := e.reserve(3)
	require.NoError(t, e.b.Commit(a.r, 0, 3*g))
	e.mark(a.r, 0, 3*g, 65)
	require.NoError(t, s.Share(b.r, 0, a.r, 0, g, backing.ReadWrite))
	require.NoError(t, e.b.Commit(b.r, g, g))
	e.mark(b.r, g, g, 65)
	require.NoError(t, s.Share(b.r, 2*g, a.r, 2*g, g, backing.ReadOnly))
	// b holds: 0 shared ReadWrite, 1 its own, 2 shared ReadOnly.
	require.NoError(t, p.Protect(b.r, 0, 2*g, backing.ReadOnly), "a read-write sharer and an owner may go read-only")
	require.NoError(t, p.Protect(b.r, 2*g, g, backing.ReadOnly), "read-only on a read-only share is a no-op")
	before := e.books()
	for _, tt := range []struct {
		name      string
		off, size int
	}{
		{"the read-only share", 2 * g, g},
		{"own and the read-only share", g, 2 * g},
		{"all", 0, 3 * g},
	} {
		t.Run(tt.name, func(t *testing.T) {
			isOp(t, p.Protect(b.r, tt.off, tt.size, backing.ReadWrite), backing.ErrReadOnly,
				"ReadWrite on a granule shared ReadOnly must be refused")
		})
	}
	e.sameBooks(before, "refused Protect ReadWrite")
	e.readOnly(c, b.r, 0, 3*g, 65, "sharer after refused Protect ReadWrite")
	e.writable(c, a.r, 0, 3*g, "the owner while its sharer is refused")
	require.NoError(t, p.Protect(b.r, 0, 2*g, backing.ReadWrite), "what b may write, it may write again")
	e.writable(c, b.r, 0, 2*g, "read-write share and own granule back to ReadWrite")
	e.readOnly(c, b.r, 2*g, g, 65, "the read-only share stays read-only")
	q := pattern(66, 32)
	e.write(b.r, g/2, q)
	e.checkRead(a.r, g/2, q, "written by the read-write sharer, read in the owner")
	e.unreserve(b, 3*g)
	e.unreserve(a, 3*g)
}

func testProtectErrors[R any](e *env[R]) {
	p, c, ok := e.protector()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	x := e.reserve(4)
	// Committed: 0 and 1 (read-write), 2 (read-only); 3 reserved.
	require.NoError(t, e.b.Commit(x.r, 0, 3*g))
	e.mark(x.r, 0, 3*g, 67)
	require.NoError(t, p.Protect(x.r, 2*g, g, backing.ReadOnly))
	before := e.books()
	for _, tt := range badRanges(g) {
		t.Run(tt.name, func(t *testing.T) {
			isOp(t, p.Protect(x.r, tt.off, tt.size, backing.ReadOnly), tt.kind, "Protect(%#x, %#x)", tt.off, tt.size)
		})
	}
	for _, tt := range []struct {
		name      string
		off, size int
		prot      backing.Protection
	}{
		{"uncommitted", 3 * g, g, backing.ReadOnly},
		{"partly uncommitted", 0, 4 * g, backing.ReadOnly},
		{"partly uncommitted, read-write", g, 3 * g, backing.ReadWrite},
	} {
		t.Run(tt.name, func(t *testing.T) {
			isOp(t, p.Protect(x.r, tt.off, tt.size, tt.prot), backing.ErrNotCommitted)
		})
	}
	for _, prot := range []backing.Protection{backing.ReadOnly + 1, 7, 255} {
		assert.Error(t, p.Protect(x.r, 0, g, prot), "Protect with protection %d", prot)
		assert.Error(t, p.Protect(x.r, 2*g, g, prot), "Protect with protection %d", prot)
	}
	other := e.newBacking(t)
	y := reserveOn(t, other, g)
	require.NoError(t, other.Commit(y.r, 0, g))
	isOp(t, p.Protect(y.r, 0, g, backing.ReadOnly), backing.ErrForeignReservation, "Protect of a foreign reservation")
	e.sameBooks(before, "refused Protects")
	e.checkState(x.r, []bool{true, true, true, false}, 67, "after refused Protects")
	e.writable(c, x.r, 0, 2*g, "read-write granules after refused Protects")
	e.readOnly(c, x.r, 2*g, g, 67, "the read-only granule after refused Protects")
	if o := other.Unreserve(y.r); assert.True(t, o.OK(), "%v", o) {
		y.done = true
	}
	e.unreserve(x, 3*g)
}

func testProtectDecommit[R any](e *env[R]) {
	p, c, ok := e.protector()
	if !ok {
		return
	}
	t := e.t
	g := e.g()
	x := e.marked(3, 3*g, 68)
	require.NoError(t, p.Protect(x.r, 0, 3*g, backing.ReadOnly))
	before := e.books()
	require.NoError(t, e.b.Decommit(x.r, g, 2*g), "decommit part of a protected range")
	e.expectBooks(before, -2*int64(g), -2*int64(g), "decommit of protected granules")
	e.checkState(x.r, []bool{true, false, false}, 68, "after the decommit")
	e.readOnly(c, x.r, 0, g, 68, "what stays of the protected range")
	require.NoError(t, e.b.Commit(x.r, g, 2*g), "commit again where protected granules were")
	e.checkZero(x.r, g, 2*g, "recommitted")
	e.writable(c, x.r, g, 2*g, "recommitted granules are read-write")
	if t.Failed() {
		return // a direct write below could fault
	}
	for i, how := range e.accessors() {
		q := pattern(69+i, 64)
		e.writeVia(how, x.r, 2*g+g/2, q)
		e.checkRead(x.r, 2*g+g/2, q, "written via "+how+" after the recommit")
	}
	e.unreserve(x, 3*g)
}
