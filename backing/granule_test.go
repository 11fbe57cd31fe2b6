package backing_test

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/backing"
)

func TestAlignUp(t *testing.T) {
	tests := []struct {
		n, g, want int
		ok         bool
	}{
		{0, 4096, 0, true},
		{1, 4096, 4096, true},
		{4096, 4096, 4096, true},
		{4097, 4096, 8192, true},
		{-1, 4096, 0, false},
		{math.MaxInt, 4096, 0, false},
		{5, 3, 0, false},
	}
	for _, tt := range tests {
		got, ok := backing.AlignUp(tt.n, tt.g)
		assert.Equal(t, tt.ok, ok, "AlignUp(%d, %d)", tt.n, tt.g)
		assert.Equal(t, tt.want, got, "AlignUp(%d, %d)", tt.n, tt.g)
	}
	assert.Equal(t, 0, backing.Granules(0, 64))
	assert.Equal(t, 1, backing.Granules(1, 64))
	assert.Equal(t, 2, backing.Granules(65, 64))
	assert.Equal(t, 21, backing.Log2(2<<20))
}

func TestCheckRange(t *testing.T) {
	const g = 4096
	tests := []struct {
		name      string
		off, size int
		kind      error
	}{
		{"ok", 0, g, nil},
		{"empty", g, 0, nil},
		{"negative offset", -g, g, backing.ErrInvalidRange},
		{"negative size", 0, -g, backing.ErrInvalidRange},
		{"misaligned offset", 1, g, backing.ErrInvalidRange},
		{"misaligned size", 0, g + 1, backing.ErrInvalidRange},
		{"overflow", math.MaxInt &^ (g - 1), 2 * g, backing.ErrInvalidRange},
		{"outside", 4 * g, g, backing.ErrOutOfRange},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := backing.CheckRange("commit", tt.off, tt.size, 4*g, g)
			if tt.kind == nil {
				assert.NoError(t, err)
				return
			}
			assert.ErrorIs(t, err, tt.kind)
			var op *backing.OpError
			assert.True(t, errors.As(err, &op))
		})
	}
	assert.ErrorIs(t, backing.CheckReserve(-g, g), backing.ErrInvalidRange)
	assert.ErrorIs(t, backing.CheckReserve(g+1, g), backing.ErrInvalidRange)
	assert.NoError(t, backing.CheckReserve(0, g))
}
