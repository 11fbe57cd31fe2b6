package host_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

// TestSharedProtect checks what the kernel maps after each Protect: read-only
// granules are r--s, one mprotect per call that changes anything, none otherwise.
func TestSharedProtect(t *testing.T) {
	e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64}), true)
	a := e.reserve(3)
	b := e.reserve(2)
	e.commit(a, 0, 3)
	for i := range 3 {
		e.tag(a, i, uint64(10+i))
	}
	e.share(b, 0, a, 0, 2, backing.ReadOnly)
	syscalls := func(call func() error) []string {
		t.Helper()
		e.f.Reset()
		require.NoError(t, call())
		return e.f.Log()
	}
	assert.Equal(t, []string{"protect"}, syscalls(func() error { return e.s.Protect(a, 0, 2*e.g, backing.ReadOnly) }),
		"one mprotect for the range")
	_, ro := host.SharedSlots(a)
	assert.Equal(t, []bool{true, true, false}, ro)
	e.checkMaps(a, e.s.Base(a), 3*e.g)
	e.checkMaps(b, e.s.Base(b), 2*e.g)
	assert.Empty(t, syscalls(func() error { return e.s.Protect(a, e.g, e.g, backing.ReadOnly) }), "nothing to change")

	err := e.s.CopyIn(a, e.g-4, make([]byte, 8))
	assert.ErrorIs(t, err, host.ErrSharedReadOnly)
	assert.ErrorIs(t, err, backing.ErrReadOnly)
	e.tag(a, 2, 12) // the granule past the range is still writable
	for i := range 3 {
		assert.Equal(t, uint64(10+i), e.tagOf(a, i))
	}

	err = e.s.Protect(b, 0, e.g, backing.ReadWrite)
	assert.ErrorIs(t, err, host.ErrSharedReadOnly, "a sharer never gains write access")
	assert.ErrorIs(t, err, backing.ErrReadOnly)
	var op *backing.OpError
	assert.ErrorAs(t, err, &op)
	assert.ErrorIs(t, e.s.Protect(a, 0, e.g, 2), host.ErrSharedArgument, "an unknown protection")
	assert.Equal(t, []string{"protect"}, syscalls(func() error { return e.s.Protect(a, 0, 3*e.g, backing.ReadWrite) }))
	e.checkMaps(a, e.s.Base(a), 3*e.g)
	e.tag(a, 0, 20)
	assert.Equal(t, uint64(20), e.tagOf(b, 0), "the read-only sharer sees the owner's write")
	assert.Equal(t, 1, vmas(t, e.s.Base(a), 3*e.g), "back to read-write, the mappings merge again")
	e.checkMaps(b, e.s.Base(b), 2*e.g)
}

// TestSharedProtectWriteFaults writes into protected memory in place (touch, under
// debug.SetPanicOnFault): the store faults, in the origin as in its read-only sharer,
// and the contents stay.
func TestSharedProtectWriteFaults(t *testing.T) {
	e := newEnv(t, host.SharedOptions{Granularity: kib64}, false)
	a := e.reserve(2)
	b := e.reserve(2)
	e.commit(a, 0, 2)
	e.tag(a, 1, 7)
	e.share(b, 0, a, 0, 2, backing.ReadOnly)
	e.protect(a, 0, 2, backing.ReadOnly)
	for _, tt := range []struct {
		name string
		r    *host.SharedReservation
	}{{"origin", a}, {"read-only sharer", b}} {
		t.Run(tt.name, func(t *testing.T) {
			at := e.s.Base(tt.r) + uintptr(e.g) + 3
			err := testutil.Touch(at, true)
			require.Error(t, err, "a store into a read-only range must fault")
			assert.Equal(t, at, faultAddr(err), "the fault's address")
			assert.NoError(t, testutil.Touch(at, false), "reading is fine")
			assert.Equal(t, uint64(7), e.tagOf(a, 1), "the faulting store wrote nothing")
		})
	}
	e.protect(a, 0, 2, backing.ReadWrite)
	require.NoError(t, testutil.Touch(e.s.Base(a)+uintptr(e.g)+3, true), "the owner writes again after ReadWrite")
	got := make([]byte, 1)
	require.NoError(t, e.s.CopyOut(got, b, e.g+3))
	assert.Equal(t, byte(1), got[0], "the byte landed, and the sharer reads it")
	assert.Error(t, testutil.Touch(e.s.Base(b)+uintptr(e.g)+3, true), "its read-only sharer still faults")
}

// TestSharedProtectRestoreFails: when mprotect fails and so does restoring the old
// access, Protect can not know what the kernel left, so it records the range
// read-only (CopyIn refuses it rather than fault) and says so; a later Protect
// ReadWrite makes it whole.
func TestSharedProtectRestoreFails(t *testing.T) {
	e := newEnv(t, memfdOpts(host.SharedOptions{Granularity: kib64}), true)
	x := e.reserve(3)
	e.commit(x, 0, 3)
	e.tagAll(x)
	e.protect(x, 1, 1, backing.ReadOnly)
	e.f.FailFrom(1, errInjected)
	err := e.s.Protect(x, 0, 3*e.g, backing.ReadOnly)
	log := e.f.Log()
	e.f.Reset()
	require.ErrorIs(t, err, errInjected)
	assert.Contains(t, err.Error(), "recorded read-only")
	assert.Equal(t, []string{"!protect", "!protect", "!protect", "!protect"}, log, "the mprotect and one restore per run")
	_, ro := host.SharedSlots(x)
	assert.Equal(t, []bool{true, true, true}, ro)
	assert.ErrorIs(t, e.s.CopyIn(x, 0, []byte{1}), backing.ErrReadOnly, "the unknown range is refused, not faulted")
	e.protect(x, 0, 3, backing.ReadWrite)
	e.checkMaps(x, e.s.Base(x), 3*e.g)
	slots, _ := host.SharedSlots(x)
	for i, sl := range slots {
		assert.Equal(t, tag(sl), e.tagOf(x, i))
	}
	require.NoError(t, host.CheckShared(e.s))
}
