package arena_test

import (
	"math"
	"reflect"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
)

// heapMem is a Memory over a Go slice, so that views can be tested without a backing.
// n is its length; host false makes it stand for device memory; shift moves the base
// off the slice's (8-aligned) start.
type heapMem struct {
	words []uint64
	n     int
	host  bool
	shift uintptr
}

func newHeapMem(n int) *heapMem {
	return &heapMem{words: make([]uint64, (n+15)/8), n: n, host: true}
}

func (m *heapMem) Base() uintptr {
	return uintptr(unsafe.Pointer(unsafe.SliceData(m.words))) + m.shift
}
func (m *heapMem) Len() int             { return m.n }
func (m *heapMem) HostAccessible() bool { return m.host }

func TestDType(t *testing.T) {
	tests := []struct {
		got  arena.DType
		want arena.DType
		name string
		size int
	}{
		{arena.DTypeOf[float32](), arena.Float32, "float32", 4},
		{arena.DTypeOf[float64](), arena.Float64, "float64", 8},
		{arena.DTypeOf[int8](), arena.Int8, "int8", 1},
		{arena.DTypeOf[int16](), arena.Int16, "int16", 2},
		{arena.DTypeOf[int32](), arena.Int32, "int32", 4},
		{arena.DTypeOf[int64](), arena.Int64, "int64", 8},
		{arena.DTypeOf[uint8](), arena.Uint8, "uint8", 1},
		{arena.DTypeOf[uint16](), arena.Uint16, "uint16", 2},
		{arena.DTypeOf[uint32](), arena.Uint32, "uint32", 4},
		{arena.DTypeOf[uint64](), arena.Uint64, "uint64", 8},
		{arena.DTypeOf[arena.F16](), arena.Float16, "float16", 2},
		{arena.DTypeOf[arena.BF16](), arena.BFloat16, "bfloat16", 2},
		{arena.DTypeOf[arena.F8E4M3](), arena.Float8E4M3, "float8_e4m3", 1},
		{arena.DTypeOf[arena.F8E5M2](), arena.Float8E5M2, "float8_e5m2", 1},
		{arena.DTypeOf[arena.BlockQ8_0](), arena.Q8_0, "q8_0", 34},
	}
	seen := map[arena.DType]bool{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, tt.got)
			assert.True(t, tt.got.Valid())
			assert.Equal(t, tt.name, tt.got.String())
			assert.Equal(t, tt.size, tt.got.Size())
			assert.False(t, seen[tt.got], "DTypes are distinct")
			seen[tt.got] = true
		})
	}
	for _, bad := range []arena.DType{0, arena.Q8_0 + 1, 255} {
		assert.False(t, bad.Valid())
		assert.Zero(t, bad.Size())
		assert.Zero(t, bad.BlockValues())
		_, err := bad.Bytes(1)
		assert.ErrorIs(t, err, arena.ErrDType)
		assert.Contains(t, bad.String(), "DType(")
	}
}

// TestTensorTypesDistinct: the point of `_ [0]T`; two element types of one
// underlying type must not convert into each other.
func TestTensorTypesDistinct(t *testing.T) {
	f16 := reflect.TypeFor[arena.Tensor[arena.F16]]()
	assert.False(t, f16.ConvertibleTo(reflect.TypeFor[arena.Tensor[arena.BF16]]()))
	assert.False(t, f16.ConvertibleTo(reflect.TypeFor[arena.Tensor[uint16]]()))
	assert.True(t, f16.ConvertibleTo(f16))
}

func TestNewTensor(t *testing.T) {
	const big = 1 << 40
	tests := []struct {
		name    string
		shape   []int
		strides []int // nil: NewTensor (row-major)
		off     int
		memLen  int
		err     error
		numel   int
		wantStr []int
		contig  bool
	}{
		{name: "scalar", shape: nil, off: 8, memLen: 64, numel: 1, wantStr: []int{}, contig: true},
		{name: "vector", shape: []int{16}, memLen: 64, numel: 16, wantStr: []int{1}, contig: true},
		{name: "matrix", shape: []int{3, 5}, memLen: 64, numel: 15, wantStr: []int{5, 1}, contig: true},
		{name: "rank 4", shape: []int{2, 1, 2, 3}, memLen: 64, numel: 12, wantStr: []int{6, 6, 3, 1}, contig: true},
		{name: "rank 8", shape: []int{1, 1, 1, 1, 1, 1, 2, 2}, memLen: 64, numel: 4, wantStr: []int{4, 4, 4, 4, 4, 4, 2, 1}, contig: true},
		{name: "fills the memory exactly", shape: []int{4, 4}, off: 0, memLen: 64, numel: 16, wantStr: []int{4, 1}, contig: true},
		{name: "ends exactly at Len", shape: []int{2}, off: 56, memLen: 64, numel: 2, wantStr: []int{1}, contig: true},
		{name: "zero rows", shape: []int{0, 4096}, memLen: 64, numel: 0, wantStr: []int{4096, 1}, contig: true},
		{name: "zero in the middle", shape: []int{3, 0, 2}, memLen: 64, numel: 0, wantStr: []int{0, 2, 1}, contig: true},
		{name: "empty view at Len", shape: []int{0}, off: 64, memLen: 64, numel: 0, wantStr: []int{1}, contig: true},
		{name: "huge but empty", shape: []int{big, 0}, memLen: 64, numel: 0, wantStr: []int{0, 1}, contig: true},
		{name: "transposed", shape: []int{2, 3}, strides: []int{1, 2}, memLen: 64, numel: 6, wantStr: []int{1, 2}, contig: false},
		{name: "broadcast row", shape: []int{1000, 4}, strides: []int{0, 1}, memLen: 16, numel: 4000, wantStr: []int{0, 1}, contig: false},
		{name: "padded rows", shape: []int{2, 3}, strides: []int{4, 1}, memLen: 64, numel: 6, wantStr: []int{4, 1}, contig: false},
		{name: "size-1 dims ignore strides", shape: []int{1, 3}, strides: []int{99, 1}, memLen: 64, numel: 3, wantStr: []int{99, 1}, contig: true},
		{name: "strided extent fits", shape: []int{2, 2}, strides: []int{14, 1}, memLen: 64, numel: 4, wantStr: []int{14, 1}, contig: false},

		{name: "rank 9", shape: []int{1, 1, 1, 1, 1, 1, 1, 1, 1}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "negative dimension", shape: []int{2, -1}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "element count overflows", shape: []int{big, big}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "byte size overflows", shape: []int{math.MaxInt / 2}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "strides overflow behind a zero", shape: []int{0, big, big}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "negative stride", shape: []int{2, 2}, strides: []int{-2, 1}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "strides do not match the rank", shape: []int{2, 2}, strides: []int{1}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "extent overflows", shape: []int{2, 2}, strides: []int{math.MaxInt / 2, 1}, memLen: 64, err: arena.ErrInvalidShape},
		{name: "one element past Len", shape: []int{17}, memLen: 64, err: arena.ErrOutOfBounds},
		{name: "offset pushes it past Len", shape: []int{2}, off: 60, memLen: 64, err: arena.ErrOutOfBounds},
		{name: "strided extent past Len", shape: []int{2, 2}, strides: []int{15, 1}, memLen: 64, err: arena.ErrOutOfBounds},
		{name: "broadcast still needs its row", shape: []int{1000, 4}, strides: []int{0, 1}, memLen: 12, err: arena.ErrOutOfBounds},
		{name: "negative offset", shape: []int{1}, off: -4, memLen: 64, err: arena.ErrOutOfBounds},
		{name: "offset past Len", shape: []int{0}, off: 68, memLen: 64, err: arena.ErrOutOfBounds},
		{name: "offset near MaxInt", shape: []int{1}, off: math.MaxInt - 3, memLen: 64, err: arena.ErrOutOfBounds},
		{name: "misaligned", shape: []int{1}, off: 2, memLen: 64, err: arena.ErrMisaligned},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newHeapMem(tt.memLen)
			var (
				v   arena.Tensor[float32]
				err error
			)
			if tt.strides == nil {
				v, err = arena.NewTensor[float32](m, tt.off, tt.shape...)
			} else {
				v, err = arena.NewTensorStrided[float32](m, tt.off, tt.shape, tt.strides)
			}
			if tt.err != nil {
				assert.ErrorIs(t, err, tt.err)
				assert.Zero(t, v.NumElems())
				assert.Nil(t, v.Memory())
				return
			}
			require.NoError(t, err)
			assert.Equal(t, len(tt.shape), v.Rank())
			if len(tt.shape) == 0 {
				assert.Empty(t, v.Shape())
			} else {
				assert.Equal(t, tt.shape, v.Shape())
			}
			assert.Equal(t, tt.wantStr, append([]int{}, v.Strides()...))
			for i := range tt.shape {
				assert.Equal(t, tt.shape[i], v.Dim(i))
				assert.Equal(t, tt.wantStr[i], v.Stride(i))
			}
			assert.Equal(t, tt.numel, v.NumElems())
			assert.Equal(t, 4*tt.numel, v.NumBytes())
			assert.Equal(t, tt.contig, v.IsContiguous())
			assert.Equal(t, tt.off, v.Offset())
			assert.Equal(t, m.Base()+uintptr(tt.off), v.DevicePtr())
			assert.Equal(t, arena.Float32, v.DType())
			assert.True(t, v.HostAccessible())
			assert.Same(t, m, v.Memory())
		})
	}
}

func TestNewTensorBadMemory(t *testing.T) {
	_, err := arena.NewTensor[float32](nil, 0, 1)
	assert.ErrorIs(t, err, arena.ErrOutOfBounds)

	// The alignment is of the address, not of the offset alone.
	m := newHeapMem(64)
	m.shift = 2
	_, err = arena.NewTensor[float32](m, 0, 2)
	assert.ErrorIs(t, err, arena.ErrMisaligned)
	v, err := arena.NewTensor[float32](m, 2, 2)
	require.NoError(t, err)
	assert.Zero(t, v.DevicePtr()%4)
	_, err = arena.NewTensor[arena.F16](m, 0, 2)
	assert.NoError(t, err)
	_, err = arena.NewTensor[uint8](m, 1, 2)
	assert.NoError(t, err)
}

// iota fills a host tensor with 0, 1, 2, ... in row-major index order through Set.
func fillIota(t *testing.T, v arena.Tensor[float32]) {
	t.Helper()
	s, err := v.Slice()
	require.NoError(t, err)
	for i := range s {
		s[i] = float32(i)
	}
}

func TestTensorSub(t *testing.T) {
	m := newHeapMem(256)
	v, err := arena.NewTensor[float32](m, 16, 6, 4) // rows of 4, 96 bytes at 16
	require.NoError(t, err)
	fillIota(t, v)

	tests := []struct {
		name   string
		i, j   int
		off    int
		first  float32
		numel  int
		panics bool
	}{
		{name: "middle", i: 2, j: 5, off: 16 + 2*16, first: 8, numel: 12},
		{name: "all", i: 0, j: 6, off: 16, first: 0, numel: 24},
		{name: "last row", i: 5, j: 6, off: 16 + 5*16, first: 20, numel: 4},
		{name: "empty at the start", i: 0, j: 0, off: 16, numel: 0},
		{name: "empty at the end", i: 6, j: 6, off: 16 + 6*16, numel: 0},
		{name: "negative", i: -1, j: 2, panics: true},
		{name: "reversed", i: 3, j: 2, panics: true},
		{name: "past the end", i: 0, j: 7, panics: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.panics {
				assert.PanicsWithValue(t, arena.PanicIndex, func() { v.Sub(tt.i, tt.j) })
				return
			}
			s := v.Sub(tt.i, tt.j)
			assert.Equal(t, []int{tt.j - tt.i, 4}, s.Shape())
			assert.Equal(t, []int{4, 1}, s.Strides())
			assert.Equal(t, tt.off, s.Offset())
			assert.Equal(t, tt.numel, s.NumElems())
			assert.True(t, s.IsContiguous())
			got, err := s.Slice()
			require.NoError(t, err)
			require.Len(t, got, tt.numel)
			for k := range got {
				assert.Equal(t, tt.first+float32(k), got[k])
			}
			if tt.j-tt.i > 1 {
				assert.Equal(t, tt.first+5, s.At(1, 1))
			}
		})
	}

	// A sub-view of a sub-view, and of a transposed view.
	assert.Equal(t, float32(12), v.Sub(1, 5).Sub(2, 3).At(0, 0))
	tr, err := arena.NewTensorStrided[float32](m, 16, []int{4, 6}, []int{1, 4})
	require.NoError(t, err)
	st := tr.Sub(1, 3)
	assert.Equal(t, []int{2, 6}, st.Shape())
	assert.Equal(t, 16+4, st.Offset())
	assert.False(t, st.IsContiguous())
	for r := range 2 {
		for c := range 6 {
			assert.Equal(t, v.At(c, r+1), st.At(r, c))
		}
	}
	_, err = st.Slice()
	assert.ErrorIs(t, err, arena.ErrNotContiguous)
	// Cutting a padded view down to one row makes it contiguous.
	padded, err := arena.NewTensorStrided[float32](m, 16, []int{3, 2}, []int{4, 1})
	require.NoError(t, err)
	require.False(t, padded.IsContiguous())
	one, err := padded.Sub(2, 3).Slice()
	require.NoError(t, err)
	assert.Equal(t, []float32{8, 9}, one)

	// An empty sub-view past a stride no element uses would overflow its offset.
	odd, err := arena.NewTensorStrided[float32](m, 0, []int{1, 2}, []int{math.MaxInt / 2, 1})
	require.NoError(t, err)
	assert.Equal(t, 2, odd.Sub(0, 1).NumElems())
	assert.PanicsWithValue(t, arena.PanicIndex, func() { odd.Sub(1, 1) })
	// The same where the index times the stride overflows before the element size
	// is applied: an empty tensor checks no stride against memory.
	hollow, err := arena.NewTensorStrided[float32](m, 0, []int{4, 0}, []int{math.MaxInt / 2, 1})
	require.NoError(t, err)
	assert.PanicsWithValue(t, arena.PanicIndex, func() { hollow.Sub(3, 4) })

	// No first dimension to cut.
	sc, err := arena.NewTensor[float32](m, 0)
	require.NoError(t, err)
	assert.PanicsWithValue(t, arena.PanicIndex, func() { sc.Sub(0, 0) })
}

func TestTensorAtSet(t *testing.T) {
	m := newHeapMem(64)
	v, err := arena.NewTensor[int16](m, 2, 2, 3, 4)
	require.NoError(t, err)
	for i := range 2 {
		for j := range 3 {
			for k := range 4 {
				v.Set(int16(100*i+10*j+k), i, j, k)
			}
		}
	}
	s, err := v.Slice()
	require.NoError(t, err)
	assert.Equal(t, int16(123), s[1*12+2*4+3])
	assert.Equal(t, int16(123), v.At(1, 2, 3))
	assert.Equal(t, int16(0), v.At(0, 0, 0))

	for _, idx := range [][]int{{}, {1, 2}, {1, 2, 3, 0}, {2, 0, 0}, {0, 3, 0}, {0, 0, -1}} {
		assert.PanicsWithValue(t, arena.PanicIndex, func() { v.At(idx...) }, "At(%v)", idx)
		assert.PanicsWithValue(t, arena.PanicIndex, func() { v.Set(1, idx...) }, "Set(%v)", idx)
	}

	sc, err := arena.NewTensor[float64](m, 8)
	require.NoError(t, err)
	sc.Set(2.5)
	assert.Equal(t, 2.5, sc.At())
	assert.PanicsWithValue(t, arena.PanicIndex, func() { sc.At(0) })

	empty, err := arena.NewTensor[float32](m, 0, 0, 3)
	require.NoError(t, err)
	assert.PanicsWithValue(t, arena.PanicIndex, func() { empty.At(0, 0) })
}

func TestTensorDevice(t *testing.T) {
	m := newHeapMem(64)
	m.host = false
	v, err := arena.NewTensor[arena.BF16](m, 8, 4, 2)
	require.NoError(t, err)
	assert.False(t, v.HostAccessible())
	assert.Equal(t, m.Base()+8, v.DevicePtr())
	assert.Equal(t, m.Base()+8+2*2*2, v.Sub(2, 4).DevicePtr())
	_, err = v.Slice()
	assert.ErrorIs(t, err, arena.ErrNotHostAccessible)
	assert.PanicsWithValue(t, arena.PanicDeviceAccess, func() { v.At(0, 0) })
	assert.PanicsWithValue(t, arena.PanicDeviceAccess, func() { v.Set(1, 0, 0) })
}

func TestTensorStale(t *testing.T) {
	m := newHeapMem(64)
	v, err := arena.NewTensor[uint32](m, 32, 8)
	require.NoError(t, err)
	v.Set(7, 7)
	m.n = 60 // the memory shrank below the view's end
	assert.PanicsWithValue(t, arena.PanicStaleView, func() { v.At(0) })
	assert.PanicsWithValue(t, arena.PanicStaleView, func() { v.Set(1, 0) })
	_, err = v.Slice()
	assert.ErrorIs(t, err, arena.ErrOutOfBounds)
	// The part still inside is fine.
	head := v.Sub(0, 7)
	assert.Equal(t, uint32(0), head.At(6))
	_, err = head.Slice()
	assert.NoError(t, err)
}

func TestTensorReshape(t *testing.T) {
	m := newHeapMem(128)
	v, err := arena.NewTensor[float32](m, 8, 2, 3, 4)
	require.NoError(t, err)
	fillIota(t, v)

	r, err := v.Reshape(6, 4)
	require.NoError(t, err)
	assert.Equal(t, []int{6, 4}, r.Shape())
	assert.Equal(t, v.Offset(), r.Offset())
	assert.Equal(t, float32(13), r.At(3, 1))
	flat, err := v.Reshape(24)
	require.NoError(t, err)
	assert.Equal(t, float32(23), flat.At(23))
	heads, err := v.Sub(1, 2).Reshape(3, 2, 2)
	require.NoError(t, err)
	assert.Equal(t, float32(12+4+2+1), heads.At(1, 1, 1))

	_, err = v.Reshape(5, 5)
	assert.ErrorIs(t, err, arena.ErrInvalidShape)
	_, err = v.Reshape(-6, -4)
	assert.ErrorIs(t, err, arena.ErrInvalidShape)
	_, err = v.Reshape(1, 1, 1, 1, 1, 1, 1, 1, 24)
	assert.ErrorIs(t, err, arena.ErrInvalidShape)
	tr, err := arena.NewTensorStrided[float32](m, 8, []int{4, 6}, []int{1, 4})
	require.NoError(t, err)
	_, err = tr.Reshape(24)
	assert.ErrorIs(t, err, arena.ErrNotContiguous)

	empty, err := arena.NewTensor[float32](m, 0, 0, 4)
	require.NoError(t, err)
	e2, err := empty.Reshape(4, 0, 2)
	require.NoError(t, err)
	assert.Zero(t, e2.NumElems())
}

func TestTensorZero(t *testing.T) {
	var v arena.Tensor[float32]
	assert.Zero(t, v.Rank())
	assert.Zero(t, v.NumElems())
	assert.Zero(t, v.NumBytes())
	assert.Zero(t, v.DevicePtr())
	assert.Nil(t, v.Memory())
	assert.False(t, v.HostAccessible())
	assert.True(t, v.IsContiguous())
	s, err := v.Slice()
	assert.NoError(t, err)
	assert.Nil(t, s)
	assert.PanicsWithValue(t, arena.PanicIndex, func() { v.At() })
	assert.PanicsWithValue(t, arena.PanicIndex, func() { v.Dim(0) })
	assert.PanicsWithValue(t, arena.PanicIndex, func() { v.Stride(0) })
	assert.PanicsWithValue(t, arena.PanicIndex, func() { v.Sub(0, 0) })
}

func TestTensorString(t *testing.T) {
	m := newHeapMem(64)
	v, err := arena.NewTensor[arena.F16](m, 4, 2, 3)
	require.NoError(t, err)
	assert.Equal(t, "Tensor[float16][2 3] strides [3 1] offset 4", v.String())
}
