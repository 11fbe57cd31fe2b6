package backing_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/backing"
)

func TestMapReport(t *testing.T) {
	const g = 64 << 10
	c := backing.CommitReport(3*g, g)
	assert.Equal(t, backing.MapReport{Owned: 3 * g, Mapped: 3 * g, Granules: 3}, c)
	s := backing.ShareReport(2*g, g)
	assert.Equal(t, backing.MapReport{Mapped: 2 * g, Granules: 2}, s, "a Share owns nothing new")
	assert.Equal(t, backing.MapReport{Owned: 3 * g, Mapped: 5 * g, Granules: 5}, c.Add(s))
	assert.Equal(t, c, c.Add(backing.MapReport{}), "the zero report adds nothing")
	assert.Equal(t, backing.MapReport{}, backing.ShareReport(0, g), "an empty Share")
}

func TestMapReportBadInputs(t *testing.T) {
	const g = 4 << 10
	for _, tt := range []struct {
		name          string
		size, granule int
	}{
		{"negative size", -g, g},
		{"part of a granule", g + 1, g},
		{"zero granule", g, 0},
		{"granule not a power of two", 3 * 1000, 1000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.PanicsWithValue(t, backing.PanicReportRange, func() { backing.CommitReport(tt.size, tt.granule) })
			assert.PanicsWithValue(t, backing.PanicReportRange, func() { backing.ShareReport(tt.size, tt.granule) })
		})
	}
}
