package arena

import (
	"fmt"
	"math"
)

// Q8_0BlockValues is the number of values in one [BlockQ8_0].
const Q8_0BlockValues = 32

// BlockQ8_0 is one block of llama.cpp's Q8_0 format: 32 values stored as one F16 scale
// followed by 32 int8 quants, 34 bytes, with value j equal to Qs[j] × D. The layout is
// that of block_q8_0 in llama.cpp's ggml/src/ggml-common.h (a ggml_half d, then
// int8_t qs[QK8_0] with QK8_0 = 32, no padding), so a kernel written for llama.cpp's
// blocks reads these bytes as they are; the scale is in the machine's byte order,
// little-endian on every platform the project builds for.
//
// A block is the element of a Q8_0 tensor: a Tensor[BlockQ8_0] is indexed by block,
// not by value, and DType [Q8_0] has Size 34 and BlockValues 32 (DType.Bytes counts n
// values). The zero BlockQ8_0 holds 32 zeros.
type BlockQ8_0 struct {
	D  F16                   // the scale: max |x| / 127 of the block's values
	Qs [Q8_0BlockValues]int8 // the quants: round(x / scale), ties away from zero
}

// QuantizeQ8_0 quantizes min(len(dst), len(src)/32) blocks of 32 values of src into
// dst, as llama.cpp's reference quantizer (quantize_row_q8_0_ref in
// ggml/src/ggml-quants.c) defines the format, and returns how many blocks it wrote.
// For each block, with float32 arithmetic throughout:
//
//	amax = max |x_j|;  d = amax / 127;  id = 1/d (0 when d is 0)
//	D = d rounded to F16 (ties to even);  Qs[j] = round(x_j × id), ties away from zero
//
// NB: the quants are computed with the float32 d, not the rounded D, as the reference
// does. Where 1/d overflows float32 (amax below about 2^-121) the reference converts an
// infinity or a NaN to int8, which C leaves undefined; here such a block stores zero quants, and
// either way its D is 0 and every value dequantizes to 0.
//
// len(src) must be a whole number of blocks (ErrPartialBlock). A block with a NaN or
// an infinity, or whose scale overflows F16 (amax of 127 × 65520 or more), is refused
// with ErrQuantize; the blocks before it are written and counted.
func QuantizeQ8_0(dst []BlockQ8_0, src []float32) (int, error) {
	if len(src)%Q8_0BlockValues != 0 {
		return 0, fmt.Errorf("%w: %d values in blocks of %d", ErrPartialBlock, len(src), Q8_0BlockValues)
	}
	n := min(len(dst), len(src)/Q8_0BlockValues)
	for i := range dst[:n] {
		x := (*[Q8_0BlockValues]float32)(src[i*Q8_0BlockValues:])
		// NB: the magnitudes are compared as bits, whose order is their values' for
		// non-negative floats and which puts Inf and NaN above every finite value: an
		// integer max, no NaN rules, no branch.
		var abits uint32
		for _, v := range x {
			abits = max(abits, math.Float32bits(v)&0x7fffffff)
		}
		amax := math.Float32frombits(abits)
		d := amax / 127
		h := F16FromFloat32(d)
		if abits >= f32Inf || h.IsInf(0) {
			return i, fmt.Errorf("%w: Q8_0 block %d has max |x| %v", ErrQuantize, i, amax)
		}
		b := &dst[i]
		b.D = h
		var id float32
		if d != 0 {
			id = 1 / d
		}
		if id > math.MaxFloat32 {
			id = 0 // see the NB above
		}
		for j, v := range x {
			// NB: roundf, in float64 where adding ±0.5 is exact, then truncation
			// toward zero; |v × id| <= 127 + an ulp, so it fits an int8.
			q := float64(v * id)
			b.Qs[j] = int8(q + math.Copysign(0.5, q))
		}
	}
	return n, nil
}

// DequantizeQ8_0 dequantizes min(len(dst)/32, len(src)) blocks of src into dst (value
// j of a block is Qs[j] × D, in float32, as llama.cpp's dequantize_row_q8_0) and
// returns how many blocks it read. len(dst) must be a whole number of blocks
// (ErrPartialBlock).
func DequantizeQ8_0(dst []float32, src []BlockQ8_0) (int, error) {
	if len(dst)%Q8_0BlockValues != 0 {
		return 0, fmt.Errorf("%w: %d values in blocks of %d", ErrPartialBlock, len(dst), Q8_0BlockValues)
	}
	n := min(len(dst)/Q8_0BlockValues, len(src))
	for i := range src[:n] {
		b := &src[i]
		d := b.D.Float32()
		y := (*[Q8_0BlockValues]float32)(dst[i*Q8_0BlockValues:])
		for j, q := range b.Qs {
			y[j] = float32(q) * d
		}
	}
	return n, nil
}
