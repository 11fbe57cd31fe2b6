//go:build linux || darwin || windows

package arena_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

func newHostBuffer(t *testing.T, capacity int) (*arena.Buffer[*host.PrivateReservation, *host.Private], *accounting.Authority) {
	t.Helper()
	p, err := host.NewPrivate(host.PrivateOptions{})
	require.NoError(t, err)
	a := accounting.NewGovernor().Authority("test", accounting.HostKey)
	buf, err := arena.NewBuffer(p, capacity, a)
	require.NoError(t, err)
	return buf, a
}

func TestHostBufferBytesAndFaults(t *testing.T) {
	buf, a := newHostBuffer(t, 1<<20)
	g := buf.Granularity()
	require.NoError(t, buf.Resize(g+10))
	b := buf.Bytes()
	require.Len(t, b, g+10)
	assert.True(t, buf.HostAccessible())
	for i := range b {
		b[i] = byte(i)
	}
	base := buf.Base()

	// The rest of the committed granule may be touched; past it, the memory faults.
	assert.NoError(t, testutil.Touch(base+uintptr(2*g-1), true), "inside the last committed granule")
	assert.Error(t, testutil.Touch(base+uintptr(2*g), true), "past the committed part")
	assert.Error(t, testutil.Touch(base+uintptr(buf.Capacity()-1), true), "at the end of the reservation")

	// Growth keeps the bytes and the base.
	require.NoError(t, buf.Resize(8*g))
	assert.Equal(t, base, buf.Base())
	b = buf.Bytes()
	for i := range g + 10 {
		if b[i] != byte(i) {
			t.Fatalf("byte %d: got %d", i, b[i])
		}
	}
	// Shrinking decommits: the contents are forfeit and a touch faults.
	require.NoError(t, buf.Resize(g))
	assert.Error(t, testutil.Touch(base+uintptr(g), true), "decommitted memory faults")
	assert.Equal(t, int64(g), a.Stats().Owned)
	require.NoError(t, buf.Resize(2*g))
	assert.Equal(t, byte(0), buf.Bytes()[g+1], "recommitted private memory reads zero")
	assert.True(t, buf.Close().OK())
	assert.Equal(t, int64(0), a.Stats().Owned)
}

func TestHostBufferExample(t *testing.T) {
	buf, _ := newHostBuffer(t, 0)
	assert.Equal(t, 0, buf.Capacity())
	assert.ErrorIs(t, buf.Resize(1), arena.ErrCapacity)
	assert.Nil(t, buf.Bytes())
	assert.True(t, buf.Close().OK())
}
