package kv

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestRefCount checks that a granule's counts change through ref alone and that a
// count going below zero panics with PanicRefCount rather than free memory something
// still maps.
func TestRefCount(t *testing.T) {
	var g granuleRef
	g.mapped()
	assert.Equal(t, int32(1), g.live)
	g.unmap()
	assert.Equal(t, int32(0), g.live)
	assert.PanicsWithValue(t, PanicRefCount, g.unmap)
	assert.Equal(t, int32(0), g.live, "a refused change leaves the count as it was")
	pc := PrefixCache{gbytes: 4096, ubytes: []int64{4096, 8192}}
	pc.hold(&g)
	assert.Equal(t, int64(4096), pc.cachedBytes)
	assert.Equal(t, int64(4096), pc.release(&g), "the last entry gives the granule back")
	assert.Equal(t, int64(0), pc.cachedBytes)
	assert.PanicsWithValue(t, PanicRefCount, func() { pc.release(&g) })
	// A reference of another group counts that group's bytes.
	g2 := granuleRef{grp: 1}
	pc.hold(&g2)
	assert.Equal(t, int64(8192), pc.cachedBytes)
	assert.Equal(t, int64(8192), pc.release(&g2))
}

// TestEntryState checks that an entry's fields name the states the index's doc lists.
func TestEntryState(t *testing.T) {
	for _, tt := range []struct {
		e    pcEntry
		want entryState
	}{
		{pcEntry{origin: &Sequence{}}, entryLazy},
		{pcEntry{seq: &Sequence{}}, entryOwned},
		{pcEntry{closed: true, busy: 1}, entryDraining},
		{pcEntry{closed: true}, entryOut},
	} {
		assert.Equal(t, tt.want, tt.e.state(), tt.want.String())
	}
}
