package arena

import (
	"fmt"
	"math"
)

// MaxRank is the most dimensions a Tensor may have.
const MaxRank = 8

// Tensor is a typed view of elements of type T laid out in a Memory with a shape and
// strides (in elements). It is a value, copied like a slice header (shape and strides
// live inside it, up to MaxRank), so making, copying and slicing one allocates nothing.
//
// A Tensor is checked when it is made: its elements lie wholly within [0, Len) of its
// memory and its first element is aligned to T's alignment (its size for a number, 2
// for a BlockQ8_0). It does not own its memory.
//
// NB: an element is a block for a block-quantized type: a Tensor[BlockQ8_0] indexes
// blocks of 32 values (34 bytes each), its shape and strides count blocks, and At
// returns a whole block to dequantize ([DequantizeQ8_0]). A tensor of a KV cache's
// heads of Q8_0 is [tokens, heads, HeadDim/32].
// A VIEW IS VALID ONLY WHILE THE BYTES IT COVERS STAY COMMITTED AND UNCHANGED IN
// MEANING: a Buffer.Resize below its end invalidates it (At and Set then panic with
// PanicStaleView, Slice fails; a []T taken earlier MUST NOT be used again), and a
// tensor made by an Arena is dead after the Reset or Rewind that frees it, which no
// check can see.
//
// On device memory a Tensor gives only its address ([Tensor.DevicePtr]); it never
// touches the bytes.
//
// The zero Tensor views nothing: rank 0, no elements, no memory.
type Tensor[T Elem] struct {
	_ [0]T // Tensor[F16] and Tensor[BF16] must not convert into each other

	mem        Memory
	off        int // byte offset of the first element in mem
	span       int // bytes from the first element to the end of the last one
	numel      int
	rank       int
	contiguous bool
	shape      [MaxRank]int
	strides    [MaxRank]int
}

// NewTensor returns a row-major (C order) view of the elements of the given shape at
// byte offset off of m. No shape gives a scalar (rank 0, one element); a zero
// dimension gives an empty view. It fails with ErrInvalidShape, ErrOutOfBounds or
// ErrMisaligned.
func NewTensor[T Elem](m Memory, off int, shape ...int) (Tensor[T], error) {
	return newTensor[T](m, off, shape, nil)
}

// NewTensorStrided returns a view with explicit strides, in elements, one per
// dimension; a zero stride repeats an element along its dimension (a broadcast).
// Strides must not be negative. It fails as NewTensor does.
func NewTensorStrided[T Elem](m Memory, off int, shape, strides []int) (Tensor[T], error) {
	if len(strides) != len(shape) {
		return Tensor[T]{}, fmt.Errorf("%w: %d strides for %d dimensions", ErrInvalidShape, len(strides), len(shape))
	}
	return newTensor[T](m, off, shape, strides)
}

// mulOK returns a*b for non-negative a and b and whether it fits in an int.
func mulOK(a, b int) (int, bool) {
	if a != 0 && b > math.MaxInt/a {
		return 0, false
	}
	return a * b, true
}

// newTensor validates and builds a view; strides nil means row-major.
func newTensor[T Elem](m Memory, off int, shape, strides []int) (Tensor[T], error) {
	t, err := layout[T](shape, strides)
	if err != nil {
		return Tensor[T]{}, err
	}
	if m == nil {
		return Tensor[T]{}, fmt.Errorf("%w: nil Memory", ErrOutOfBounds)
	}
	if n := m.Len(); off < 0 || off > n || t.span > n-off {
		return Tensor[T]{}, fmt.Errorf("%w: %d bytes at offset %d of %d", ErrOutOfBounds, t.span, off, n)
	}
	if align := alignOf[T](); (m.Base()+uintptr(off))%uintptr(align) != 0 {
		return Tensor[T]{}, fmt.Errorf("%w: address %#x for %v aligned to %d bytes", ErrMisaligned, m.Base()+uintptr(off), DTypeOf[T](), align)
	}
	t.mem, t.off = m, off
	return t, nil
}

// layout returns a view without memory of the given shape and strides (nil:
// row-major): dimensions, element count, span and contiguity, all checked.
func layout[T Elem](shape, strides []int) (Tensor[T], error) {
	var t Tensor[T]
	if len(shape) > MaxRank {
		return t, fmt.Errorf("%w: rank %d exceeds MaxRank %d", ErrInvalidShape, len(shape), MaxRank)
	}
	t.rank = len(shape)
	t.numel = 1
	for i, d := range shape {
		if d < 0 {
			return Tensor[T]{}, fmt.Errorf("%w: dimension %d is %d", ErrInvalidShape, i, d)
		}
		var ok bool
		if t.numel, ok = mulOK(t.numel, d); !ok {
			return Tensor[T]{}, fmt.Errorf("%w: element count of %v overflows int", ErrInvalidShape, dims(shape))
		}
		t.shape[i] = d
	}
	size := sizeOf[T]()
	if _, ok := mulOK(t.numel, size); !ok {
		return Tensor[T]{}, fmt.Errorf("%w: byte size of %v overflows int", ErrInvalidShape, dims(shape))
	}
	if strides == nil {
		// Row-major strides, checked on their own: behind a zero dimension the element
		// count is 0 but a stride can still overflow.
		s := 1
		for i := t.rank - 1; i >= 0; i-- {
			t.strides[i] = s
			var ok bool
			if s, ok = mulOK(s, shape[i]); !ok && i > 0 {
				return Tensor[T]{}, fmt.Errorf("%w: strides of %v overflow int", ErrInvalidShape, dims(shape))
			}
		}
	} else {
		for i, s := range strides {
			if s < 0 {
				return Tensor[T]{}, fmt.Errorf("%w: stride %d is %d", ErrInvalidShape, i, s)
			}
			t.strides[i] = s
		}
	}
	// The span: bytes from the first element to the end of the last one.
	if t.numel > 0 {
		last := 0 // element offset of the last element
		ok := true
		for i := 0; i < t.rank && ok; i++ {
			var step int
			step, ok = mulOK(t.shape[i]-1, t.strides[i])
			ok = ok && last < math.MaxInt-step
			last += step
		}
		if ok {
			t.span, ok = mulOK(last+1, size)
		}
		if !ok {
			return Tensor[T]{}, fmt.Errorf("%w: extent of shape %v, strides %v overflows int", ErrInvalidShape, dims(shape), dims(t.strides[:t.rank]))
		}
	}
	t.contiguous = isRowMajor(t.shape[:t.rank], t.strides[:t.rank], t.numel)
	return t, nil
}

// dims returns a copy of d for an error message. NB: handing d itself to fmt would
// move it to the heap on every call, error or not: a caller's variadic shape or a
// Tensor on the stack, which must cost no allocation.
func dims(d []int) []int { return append([]int(nil), d...) }

// isRowMajor reports whether the view's elements are dense in row-major order.
func isRowMajor(shape, strides []int, numel int) bool {
	if numel == 0 {
		return true
	}
	want := 1
	for i := len(shape) - 1; i >= 0; i-- {
		if shape[i] != 1 && strides[i] != want {
			return false
		}
		want *= shape[i]
	}
	return true
}

// DType returns the element type.
func (t Tensor[T]) DType() DType { return DTypeOf[T]() }

// Rank returns the number of dimensions.
func (t Tensor[T]) Rank() int { return t.rank }

// Dim returns the size of dimension i. It panics with PanicIndex if i is not in
// [0, Rank).
func (t Tensor[T]) Dim(i int) int {
	if uint(i) >= uint(t.rank) {
		panic(PanicIndex)
	}
	return t.shape[i]
}

// Stride returns the stride of dimension i in elements. It panics with PanicIndex if
// i is not in [0, Rank).
func (t Tensor[T]) Stride(i int) int {
	if uint(i) >= uint(t.rank) {
		panic(PanicIndex)
	}
	return t.strides[i]
}

// Shape returns a new slice of the dimensions.
func (t Tensor[T]) Shape() []int { return append([]int(nil), t.shape[:t.rank]...) }

// Strides returns a new slice of the strides, in elements.
func (t Tensor[T]) Strides() []int { return append([]int(nil), t.strides[:t.rank]...) }

// NumElems returns the number of elements.
func (t Tensor[T]) NumElems() int { return t.numel }

// NumBytes returns the bytes the elements hold: NumElems times the element size.
func (t Tensor[T]) NumBytes() int { return t.numel * sizeOf[T]() }

// Memory returns the memory the view is over (nil for the zero Tensor).
func (t Tensor[T]) Memory() Memory { return t.mem }

// Offset returns the byte offset of the first element in the memory.
func (t Tensor[T]) Offset() int { return t.off }

// IsContiguous reports whether the elements are dense in row-major order, with no gap
// and no repeat. An empty view is contiguous.
func (t Tensor[T]) IsContiguous() bool { return t.contiguous || t.numel == 0 }

// HostAccessible reports whether the CPU may read and write the elements.
func (t Tensor[T]) HostAccessible() bool { return t.mem != nil && t.mem.HostAccessible() }

// DevicePtr returns the address of the first element, to hand to a kernel or a driver
// call: a device address on a device (never to be dereferenced on the CPU), the host
// address on the host. It is 0 for the zero Tensor.
func (t Tensor[T]) DevicePtr() uintptr {
	if t.mem == nil {
		return 0
	}
	return t.mem.Base() + uintptr(t.off)
}

// Sub returns the view of indices [i, j) along the first dimension (tokens, say), with
// the same memory and strides. It panics with PanicIndex unless 0 <= i <= j <= Dim(0).
func (t Tensor[T]) Sub(i, j int) Tensor[T] {
	if t.rank == 0 || i < 0 || j < i || j > t.shape[0] {
		panic(PanicIndex)
	}
	s := t
	rows := t.shape[0]
	s.shape[0] = j - i
	if rows > 0 {
		s.numel = t.numel / rows * (j - i)
	}
	size := sizeOf[T]()
	// NB: only an empty sub-view at the end can reach past the span, and only there
	// can a stride the shape never used (on a dimension of 1) overflow.
	step, ok := mulOK(i, t.strides[0])
	if ok {
		step, ok = mulOK(step, size)
	}
	if !ok || step > math.MaxInt-t.off {
		panic(PanicIndex)
	}
	s.off = t.off + step
	if s.numel == 0 {
		s.span = 0
	} else {
		s.span = t.span - (rows-(j-i))*t.strides[0]*size
	}
	s.contiguous = isRowMajor(s.shape[:s.rank], s.strides[:s.rank], s.numel)
	return s
}

// Reshape returns a row-major view of the same elements with another shape of the same
// element count. The view must be contiguous (ErrNotContiguous); the new shape is
// checked as NewTensor checks it (ErrInvalidShape).
func (t Tensor[T]) Reshape(shape ...int) (Tensor[T], error) {
	if !t.IsContiguous() {
		return Tensor[T]{}, fmt.Errorf("%w: reshape of shape %v, strides %v", ErrNotContiguous, dims(t.shape[:t.rank]), dims(t.strides[:t.rank]))
	}
	r, err := layout[T](shape, nil)
	if err != nil {
		return Tensor[T]{}, err
	}
	if r.numel != t.numel {
		return Tensor[T]{}, fmt.Errorf("%w: %v holds %d elements, not %d", ErrInvalidShape, dims(shape), r.numel, t.numel)
	}
	// Same elements, dense in the same order: the same bytes, already checked.
	r.mem, r.off = t.mem, t.off
	return r, nil
}

// host checks that the elements may be touched on the CPU now.
func (t Tensor[T]) host() {
	if t.mem == nil {
		panic(PanicIndex)
	}
	if !t.mem.HostAccessible() {
		panic(PanicDeviceAccess)
	}
	if t.off+t.span > t.mem.Len() {
		panic(PanicStaleView)
	}
}

// addr returns the address of element idx. It panics with PanicIndex unless idx has
// Rank indices, each within its dimension.
func (t Tensor[T]) addr(idx []int) uintptr {
	if len(idx) != t.rank {
		panic(PanicIndex)
	}
	e := 0
	for i, x := range idx {
		if uint(x) >= uint(t.shape[i]) {
			panic(PanicIndex)
		}
		e += x * t.strides[i]
	}
	return t.mem.Base() + uintptr(t.off+e*sizeOf[T]())
}

// At returns the element at idx (one index per dimension; none for a scalar). It
// panics with PanicIndex for a bad index, PanicDeviceAccess on device memory and
// PanicStaleView when the memory shrank below the view.
func (t Tensor[T]) At(idx ...int) T {
	t.host()
	return *elemAt[T](t.addr(idx))
}

// Set stores v at idx. It panics as At does.
func (t Tensor[T]) Set(v T, idx ...int) {
	t.host()
	*elemAt[T](t.addr(idx)) = v
}

// Slice returns the elements as a slice, valid while the view is (see Tensor). The view
// must be contiguous (ErrNotContiguous) and in host memory (ErrNotHostAccessible), and
// its memory must still cover it (ErrOutOfBounds). The zero Tensor gives nil.
func (t Tensor[T]) Slice() ([]T, error) {
	switch {
	case t.mem == nil:
		return nil, nil
	case !t.mem.HostAccessible():
		return nil, fmt.Errorf("%w: tensor at %#x", ErrNotHostAccessible, t.DevicePtr())
	case !t.contiguous:
		return nil, fmt.Errorf("%w: shape %v, strides %v", ErrNotContiguous, dims(t.shape[:t.rank]), dims(t.strides[:t.rank]))
	case t.off+t.span > t.mem.Len():
		return nil, fmt.Errorf("%w: %d bytes at offset %d of %d (the memory shrank)", ErrOutOfBounds, t.span, t.off, t.mem.Len())
	}
	return sliceAt[T](t.mem.Base()+uintptr(t.off), t.numel), nil
}

// String describes the view: element type, shape, strides and offset.
func (t Tensor[T]) String() string {
	return fmt.Sprintf("Tensor[%v]%v strides %v offset %d", DTypeOf[T](), t.shape[:t.rank], t.strides[:t.rank], t.off)
}
