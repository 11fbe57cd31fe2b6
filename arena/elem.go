package arena

// Elem is the set of element types a typed view may hold: fixed-size numbers, and the
// blocks of block-quantized formats ([BlockQ8_0]), which hold only numbers.
//
// The set is closed on purpose. Tensor memory is mmap'd or device memory that the
// garbage collector never scans, so an element must never be or contain a Go pointer;
// a closed set of pointer-free types guarantees it at compile time. The types are
// exact (no ~): every Elem has exactly one [DType], which [DTypeOf] reports, and a
// caller's own named type (type Token int32, say) is converted at the edge rather than
// admitted silently.
type Elem interface {
	float32 | float64 |
		int8 | int16 | int32 | int64 |
		uint8 | uint16 | uint32 | uint64 |
		F16 | BF16 | F8E4M3 | F8E5M2 |
		BlockQ8_0
}
