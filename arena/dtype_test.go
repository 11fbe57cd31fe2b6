package arena_test

import (
	"math"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
)

// sizeMatches reports whether T's DType says the size Go gives T.
func sizeMatches[T arena.Elem](t *testing.T) {
	t.Helper()
	var z T
	dt := arena.DTypeOf[T]()
	assert.Equal(t, int(unsafe.Sizeof(z)), dt.Size(), "%v", dt)
}

func TestDTypeSizeIsGoSize(t *testing.T) {
	sizeMatches[float32](t)
	sizeMatches[float64](t)
	sizeMatches[int8](t)
	sizeMatches[int16](t)
	sizeMatches[int32](t)
	sizeMatches[int64](t)
	sizeMatches[uint8](t)
	sizeMatches[uint16](t)
	sizeMatches[uint32](t)
	sizeMatches[uint64](t)
	sizeMatches[arena.F16](t)
	sizeMatches[arena.BF16](t)
	sizeMatches[arena.F8E4M3](t)
	sizeMatches[arena.F8E5M2](t)
	sizeMatches[arena.BlockQ8_0](t)
	// llama.cpp's block_q8_0: a 2-byte scale, then the quants, no padding.
	var b arena.BlockQ8_0
	assert.Equal(t, uintptr(34), unsafe.Sizeof(b))
	assert.Equal(t, uintptr(2), unsafe.Offsetof(b.Qs))
	assert.Equal(t, uintptr(2), unsafe.Alignof(b))
}

func TestDTypeBytes(t *testing.T) {
	for d := arena.DType(1); d.Valid(); d++ {
		if d == arena.Q8_0 {
			continue
		}
		assert.Equal(t, 1, d.BlockValues(), "%v", d)
		for _, n := range []int{0, 1, 7, 1 << 20} {
			got, err := d.Bytes(n)
			require.NoError(t, err)
			assert.Equal(t, n*d.Size(), got, "%v × %d", d, n)
		}
	}
	q := arena.Q8_0
	assert.Equal(t, 32, q.BlockValues())
	assert.Equal(t, 34, q.Size())
	tests := []struct {
		name string
		d    arena.DType
		n    int
		want int
		err  error
	}{
		{"no values", q, 0, 0, nil},
		{"one block", q, 32, 34, nil},
		{"a head of 128", q, 128, 136, nil},
		{"8 heads of 128", q, 8 * 128, 8 * 136, nil},
		{"part of a block", q, 16, 0, arena.ErrPartialBlock},
		{"one past a block", q, 33, 0, arena.ErrPartialBlock},
		{"negative", q, -32, 0, arena.ErrInvalidSize},
		{"negative number", arena.Float16, -1, 0, arena.ErrInvalidSize},
		{"overflow", q, math.MaxInt / 32 * 32, 0, arena.ErrInvalidSize},
		{"number overflow", arena.Float64, math.MaxInt/8 + 1, 0, arena.ErrInvalidSize},
		{"largest number", arena.Float64, math.MaxInt / 8, math.MaxInt / 8 * 8, nil},
		{"invalid type", arena.DType(0), 1, 0, arena.ErrDType},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.d.Bytes(tt.n)
			if tt.err != nil {
				assert.ErrorIs(t, err, tt.err)
				assert.Zero(t, got)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}
