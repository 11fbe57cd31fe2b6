package arena

import "fmt"

// DType names the element type of a tensor. The zero DType is not a valid type.
type DType uint8

// The element types of [Elem].
const (
	Float32  DType = iota + 1 // float32
	Float64                   // float64
	Int8                      // int8
	Int16                     // int16
	Int32                     // int32
	Int64                     // int64
	Uint8                     // uint8
	Uint16                    // uint16
	Uint32                    // uint32
	Uint64                    // uint64
	Float16                   // F16, IEEE 754 binary16
	BFloat16                  // BF16, bfloat16

	numDTypes = iota + 1 // one past the last valid DType
)

var dtypeInfo = [numDTypes]struct {
	name string
	size int
}{
	Float32:  {"float32", 4},
	Float64:  {"float64", 8},
	Int8:     {"int8", 1},
	Int16:    {"int16", 2},
	Int32:    {"int32", 4},
	Int64:    {"int64", 8},
	Uint8:    {"uint8", 1},
	Uint16:   {"uint16", 2},
	Uint32:   {"uint32", 4},
	Uint64:   {"uint64", 8},
	Float16:  {"float16", 2},
	BFloat16: {"bfloat16", 2},
}

// Valid reports whether d is one of the element types of [Elem].
func (d DType) Valid() bool { return d > 0 && d < numDTypes }

// Size returns the size of one element in bytes, or 0 for an invalid DType.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypeInfo[d].size
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
	}
	panic("arena: unreachable: Elem type without a DType")
}
