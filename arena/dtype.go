package arena

import (
	"fmt"
	"math"
)

// DType names the element type of a tensor. The zero DType is not a valid type.
//
// An element is what a Tensor indexes: one value for a number type, one block of
// BlockValues values for a block-quantized type ([Q8_0]). Size is the bytes of one
// element, so n values take Bytes(n) = n / BlockValues × Size bytes, and a block type
// can hold only a whole number of blocks.
type DType uint8

// The element types of [Elem].
const (
	Float32    DType = iota + 1 // float32
	Float64                     // float64
	Int8                        // int8
	Int16                       // int16
	Int32                       // int32
	Int64                       // int64
	Uint8                       // uint8
	Uint16                      // uint16
	Uint32                      // uint32
	Uint64                      // uint64
	Float16                     // F16, IEEE 754 binary16
	BFloat16                    // BF16, bfloat16
	Float8E4M3                  // F8E4M3, OCP OFP8 E4M3
	Float8E5M2                  // F8E5M2, OCP OFP8 E5M2
	Q8_0                        // BlockQ8_0, llama.cpp's Q8_0: blocks of 32 values in 34 bytes

	numDTypes = iota + 1 // one past the last valid DType
)

var dtypeInfo = [numDTypes]struct {
	name  string
	size  int // bytes of one element
	block int // values of one element
}{
	Float32:    {"float32", 4, 1},
	Float64:    {"float64", 8, 1},
	Int8:       {"int8", 1, 1},
	Int16:      {"int16", 2, 1},
	Int32:      {"int32", 4, 1},
	Int64:      {"int64", 8, 1},
	Uint8:      {"uint8", 1, 1},
	Uint16:     {"uint16", 2, 1},
	Uint32:     {"uint32", 4, 1},
	Uint64:     {"uint64", 8, 1},
	Float16:    {"float16", 2, 1},
	BFloat16:   {"bfloat16", 2, 1},
	Float8E4M3: {"float8_e4m3", 1, 1},
	Float8E5M2: {"float8_e5m2", 1, 1},
	Q8_0:       {"q8_0", 2 + Q8_0BlockValues, Q8_0BlockValues},
}

// Valid reports whether d is one of the element types of [Elem].
func (d DType) Valid() bool { return d > 0 && d < numDTypes }

// Size returns the size of one element in bytes (for a block type, of one block: 34
// for Q8_0), or 0 for an invalid DType.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypeInfo[d].size
}

// BlockValues returns the values one element holds: 1 for a number type, the block's
// values for a block type (32 for Q8_0), 0 for an invalid DType.
func (d DType) BlockValues() int {
	if !d.Valid() {
		return 0
	}
	return dtypeInfo[d].block
}

// Bytes returns the bytes n values take. It fails with ErrDType for an invalid DType,
// ErrPartialBlock when n is not a whole number of blocks, and ErrInvalidSize for a
// negative n or a size that overflows int.
func (d DType) Bytes(n int) (int, error) {
	switch {
	case !d.Valid():
		return 0, fmt.Errorf("%w: %v", ErrDType, d)
	case n < 0:
		return 0, fmt.Errorf("%w: %d values of %v", ErrInvalidSize, n, d)
	}
	info := dtypeInfo[d]
	if n%info.block != 0 {
		return 0, fmt.Errorf("%w: %d values of %v in blocks of %d", ErrPartialBlock, n, d, info.block)
	}
	if n/info.block > math.MaxInt/info.size {
		return 0, fmt.Errorf("%w: %d values of %v overflow", ErrInvalidSize, n, d)
	}
	return n / info.block * info.size, nil
}

// String returns the type's usual name ("float16", "bfloat16", "int8", ...).
func (d DType) String() string {
	if !d.Valid() {
		return fmt.Sprintf("DType(%d)", uint8(d))
	}
	return dtypeInfo[d].name
}

// DTypeOf returns the DType of T.
func DTypeOf[T Elem]() DType {
	var z T
	switch any(z).(type) {
	case float32:
		return Float32
	case float64:
		return Float64
	case int8:
		return Int8
	case int16:
		return Int16
	case int32:
		return Int32
	case int64:
		return Int64
	case uint8:
		return Uint8
	case uint16:
		return Uint16
	case uint32:
		return Uint32
	case uint64:
		return Uint64
	case F16:
		return Float16
	case BF16:
		return BFloat16
	case F8E4M3:
		return Float8E4M3
	case F8E5M2:
		return Float8E5M2
	case BlockQ8_0:
		return Q8_0
	}
	panic("arena: unreachable: Elem type without a DType")
}
