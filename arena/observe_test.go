package arena_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
)

// quarantining gives everything back but reports a Quarantined outcome that left one
// granule behind, as a backing whose release failed midway does.
type quarantining struct{ *backingtest.Fake }

var errStuck = errors.New("stuck granule")

func (q quarantining) Unreserve(r *backingtest.FakeReservation) accounting.ReleaseOutcome {
	o := q.Fake.Unreserve(r)
	return accounting.Outcome(o.Unmapped-int64(g), int64(g), true, errStuck)
}

// TestCloseReportsQuarantine: under ByBuffer the buffer owns what a quarantined close
// leaves behind, so it reports it to the governor (and keeps it charged).
func TestCloseReportsQuarantine(t *testing.T) {
	f, a := newFake(t, 1<<30)
	buf, err := arena.NewBuffer(quarantining{f}, 4*g, a)
	require.NoError(t, err)
	require.NoError(t, buf.Resize(3*g))
	o := buf.Close()
	require.Equal(t, accounting.Quarantined, o.Status)
	c := a.Governor().Stats(accounting.HostKey).Counters
	assert.Equal(t, int64(1), c.Quarantines)
	assert.Equal(t, int64(g), c.QuarantinedBytes)
	assert.ErrorIs(t, o.Err, errStuck)
	assert.Equal(t, int64(g), a.Stats().Owned, "the residual stays charged")
	a.Unmap(int64(g))
	a.Release(int64(g))
}
