package arena

import (
	"math"
	"strconv"
)

// The two 8-bit float formats of the OCP 8-bit Floating Point Specification (OFP8),
// Revision 1.0 (Open Compute Project, 2023-12-01,
// https://www.opencompute.org/documents/ocp-8-bit-floating-point-specification-ofp8-revision-1-0-2023-12-01-pdf-1).
//
// Both have subnormals and signed zeros. E5M2 follows IEEE 754 conventions (it is the
// top byte of an [F16]); E4M3 gives up the infinities and all but one NaN per sign to
// reach one more binade:
//
//	        bias  max normal          min normal  min subnormal  Inf         NaN
//	F8E4M3  7     S.1111.110 = 448    2^-6        2^-9           none        S.1111.111
//	F8E5M2  15    S.11110.11 = 57344  2^-14       2^-16          S.11111.00  S.11111.{01,10,11}
//
// Conversions from float32 round to nearest, ties to even. The specification defines
// two modes for what is out of range after rounding, and both are here:
//
//   - non-saturating (F8E4M3FromFloat32, F8E5M2FromFloat32): E4M3 overflow and ±Inf
//     become NaN; E5M2 overflow and ±Inf become ±Inf. This is IEEE 754's overflow rule
//     where the format has infinities, as [F16FromFloat32] does.
//   - saturating (the ...Sat forms): overflow and ±Inf become the largest finite value
//     of the same sign (±448, ±57344). An outlier is clipped rather than turned into a
//     NaN that spreads through an attention row; CUDA's __nv_fp8_e4m3 and
//     __nv_fp8_e5m2 constructors convert this way (__NV_SATFINITE).
//
// A NaN is a NaN in both modes. "Overflow after rounding" means the rounded value would
// pass the largest finite one: 448 < |x| <= 464 still rounds to 448 in E4M3 (464 is the
// tie between 448 and the 480 the format lacks, and 448's mantissa is even), while
// |x| >= 61440 overflows in E5M2 (the tie between 57344 and 65536 goes to 65536).

// F8E4M3 is an OCP OFP8 E4M3 number held as its bits: 1 sign bit, 4 exponent bits
// (bias 7), 3 mantissa bits; no infinities, one NaN per sign. F8E4M3(bits) and
// uint8(x) convert to and from the bit pattern. PyTorch calls this float8_e4m3fn.
type F8E4M3 uint8

// F8E5M2 is an OCP OFP8 E5M2 number held as its bits: 1 sign bit, 5 exponent bits
// (bias 15), 2 mantissa bits, with IEEE-style infinities and NaNs. F8E5M2(bits) and
// uint8(x) convert to and from the bit pattern.
type F8E5M2 uint8

// F8E4M3FromFloat32 returns the F8E4M3 nearest to f, ties to even, in the
// specification's non-saturating mode: a value that rounds past ±448 (|f| > 464) and
// ±Inf become NaN of f's sign, as does a NaN.
func F8E4M3FromFloat32(f float32) F8E4M3 {
	u := math.Float32bits(f)
	// NB: the normal case, nearly all of real data, is done here without
	// e4m3FromBits's switch (one unsigned compare tests both bounds), as the slice
	// converters do too; e4m3FromBits does the rest.
	if a := u & 0x7fffffff; a-e4m3MinNormal <= e4m3Overflow-e4m3MinNormal {
		return F8E4M3(uint8(u>>24)&0x80 | e4m3Normal(a))
	}
	return F8E4M3(e4m3FromBits(u, false))
}

// F8E4M3FromFloat32Sat returns the F8E4M3 nearest to f, ties to even, in the
// specification's saturating mode: a value that rounds past ±448 and ±Inf become ±448;
// a NaN becomes NaN of f's sign.
func F8E4M3FromFloat32Sat(f float32) F8E4M3 {
	u := math.Float32bits(f)
	if a := u & 0x7fffffff; a-e4m3MinNormal <= e4m3Overflow-e4m3MinNormal {
		return F8E4M3(uint8(u>>24)&0x80 | e4m3Normal(a))
	}
	return F8E4M3(e4m3FromBits(u, true))
}

// Float32 returns x as a float32, exactly. The NaN comes out as the quiet NaN with x's
// sign and no payload (E4M3 has none to keep).
func (x F8E4M3) Float32() float32 { return math.Float32frombits(e4m3Table[x]) }

// IsNaN reports whether x is a NaN (S.1111.111).
func (x F8E4M3) IsNaN() bool { return x&0x7f == 0x7f }

// String formats x as the shortest decimal that converts back to the same float32.
func (x F8E4M3) String() string { return strconv.FormatFloat(float64(x.Float32()), 'g', -1, 32) }

// F8E5M2FromFloat32 returns the F8E5M2 nearest to f, ties to even, in the
// specification's non-saturating mode: values of magnitude 61440 and above become ±Inf,
// and a NaN becomes a quiet NaN that keeps f's sign and the top bit of its payload.
func F8E5M2FromFloat32(f float32) F8E5M2 {
	u := math.Float32bits(f)
	if a := u & 0x7fffffff; a-e5m2MinNormal < e5m2Overflow-e5m2MinNormal {
		return F8E5M2(uint8(u>>24)&0x80 | e5m2Normal(a))
	}
	return F8E5M2(e5m2FromBits(u, false))
}

// F8E5M2FromFloat32Sat returns the F8E5M2 nearest to f, ties to even, in the
// specification's saturating mode: values of magnitude 61440 and above and ±Inf become
// ±57344; a NaN becomes a NaN as in F8E5M2FromFloat32.
func F8E5M2FromFloat32Sat(f float32) F8E5M2 {
	u := math.Float32bits(f)
	if a := u & 0x7fffffff; a-e5m2MinNormal < e5m2Overflow-e5m2MinNormal {
		return F8E5M2(uint8(u>>24)&0x80 | e5m2Normal(a))
	}
	return F8E5M2(e5m2FromBits(u, true))
}

// Float32 returns x as a float32, exactly. A NaN comes out quiet with x's sign and
// payload, as [F16.Float32] does.
func (x F8E5M2) Float32() float32 { return math.Float32frombits(e5m2Table[x]) }

// IsNaN reports whether x is a NaN.
func (x F8E5M2) IsNaN() bool { return x&0x7f > 0x7c }

// IsInf reports whether x is an infinity, as [F16.IsInf].
func (x F8E5M2) IsInf(sign int) bool {
	return x == 0x7c && sign >= 0 || x == 0xfc && sign <= 0
}

// String formats x as the shortest decimal that converts back to the same float32.
func (x F8E5M2) String() string { return strconv.FormatFloat(float64(x.Float32()), 'g', -1, 32) }

// F8E4M3sFromFloat32s converts min(len(dst), len(src)) elements of src into dst, as
// [F8E4M3FromFloat32] does, and returns how many it converted (as copy does).
func F8E4M3sFromFloat32s(dst []F8E4M3, src []float32) int { return e4m3s(dst, src, false) }

// F8E4M3sFromFloat32sSat converts as [F8E4M3sFromFloat32s] does, saturating as
// [F8E4M3FromFloat32Sat] does.
func F8E4M3sFromFloat32sSat(dst []F8E4M3, src []float32) int { return e4m3s(dst, src, true) }

// Float32sFromF8E4M3s converts min(len(dst), len(src)) elements of src into dst, as
// [F8E4M3.Float32] does, and returns how many it converted.
func Float32sFromF8E4M3s(dst []float32, src []F8E4M3) int {
	n := min(len(dst), len(src))
	dst, src = dst[:n], src[:n]
	for i, x := range src {
		dst[i] = math.Float32frombits(e4m3Table[x])
	}
	return n
}

// F8E5M2sFromFloat32s converts min(len(dst), len(src)) elements of src into dst, as
// [F8E5M2FromFloat32] does, and returns how many it converted (as copy does).
func F8E5M2sFromFloat32s(dst []F8E5M2, src []float32) int { return e5m2s(dst, src, false) }

// F8E5M2sFromFloat32sSat converts as [F8E5M2sFromFloat32s] does, saturating as
// [F8E5M2FromFloat32Sat] does.
func F8E5M2sFromFloat32sSat(dst []F8E5M2, src []float32) int { return e5m2s(dst, src, true) }

// Float32sFromF8E5M2s converts min(len(dst), len(src)) elements of src into dst, as
// [F8E5M2.Float32] does, and returns how many it converted.
func Float32sFromF8E5M2s(dst []float32, src []F8E5M2) int {
	n := min(len(dst), len(src))
	dst, src = dst[:n], src[:n]
	for i, x := range src {
		dst[i] = math.Float32frombits(e5m2Table[x])
	}
	return n
}

// e4m3s converts as F8E4M3sFromFloat32s does, saturating when sat is true.
func e4m3s(dst []F8E4M3, src []float32, sat bool) int {
	n := min(len(dst), len(src))
	dst, src = dst[:n], src[:n]
	for i, f := range src {
		u := math.Float32bits(f)
		if a := u & 0x7fffffff; a-e4m3MinNormal <= e4m3Overflow-e4m3MinNormal {
			dst[i] = F8E4M3(uint8(u>>24)&0x80 | e4m3Normal(a))
			continue
		}
		dst[i] = F8E4M3(e4m3FromBits(u, sat))
	}
	return n
}

// e5m2s converts as F8E5M2sFromFloat32s does, saturating when sat is true.
func e5m2s(dst []F8E5M2, src []float32, sat bool) int {
	n := min(len(dst), len(src))
	dst, src = dst[:n], src[:n]
	for i, f := range src {
		u := math.Float32bits(f)
		if a := u & 0x7fffffff; a-e5m2MinNormal < e5m2Overflow-e5m2MinNormal {
			dst[i] = F8E5M2(uint8(u>>24)&0x80 | e5m2Normal(a))
			continue
		}
		dst[i] = F8E5M2(e5m2FromBits(u, sat))
	}
	return n
}

// Bit patterns of float32 magnitudes that bound the FP8 cases.
const (
	e4m3MinNormal = 0x3c800000 // 2^-6
	e4m3Overflow  = 0x43e80000 // 464: the tie between 448 and 480 rounds to 448; above it overflows
	e4m3Magic     = 0x46800000 // 2^14, whose float32 ulp is 2^-9, E4M3's subnormal step
	e5m2MinNormal = 0x38800000 // 2^-14
	e5m2Overflow  = 0x47700000 // 61440: the tie between 57344 and 65536 rounds to 65536, i.e. overflows
	e5m2Magic     = 0x43000000 // 2^7, whose float32 ulp is 2^-16, E5M2's subnormal step
)

// e4m3FromBits converts the bits of a float32 to the bits of the nearest F8E4M3,
// saturating or not.
func e4m3FromBits(u uint32, sat bool) uint8 {
	sign := uint8(u>>24) & 0x80
	a := u & 0x7fffffff
	switch {
	case a > f32Inf: // NaN
		return sign | 0x7f
	case a > e4m3Overflow: // overflow after rounding, or Inf
		if sat {
			return sign | 0x7e
		}
		return sign | 0x7f
	case a >= e4m3MinNormal:
		return sign | e4m3Normal(a)
	}
	// Subnormal or zero. Adding 2^14, whose ulp is the subnormal step 2^-9, makes the
	// FPU round |f| to a multiple of the step, ties to even; the low mantissa bits are
	// then the answer (8, the smallest normal, when it rounds up to 2^-6).
	return sign | uint8(math.Float32bits(math.Float32frombits(a)+math.Float32frombits(e4m3Magic))-e4m3Magic)
}

// e5m2FromBits converts the bits of a float32 to the bits of the nearest F8E5M2,
// saturating or not.
func e5m2FromBits(u uint32, sat bool) uint8 {
	sign := uint8(u>>24) & 0x80
	a := u & 0x7fffffff
	switch {
	case a > f32Inf: // NaN: set the quiet bit, keep the payload's top bit
		return sign | 0x7e | uint8(a>>21)&1
	case a >= e5m2Overflow: // overflow after rounding, or Inf
		if sat {
			return sign | 0x7b
		}
		return sign | 0x7c
	case a >= e5m2MinNormal:
		return sign | e5m2Normal(a)
	}
	// Subnormal or zero, as in e4m3FromBits with 2^7, whose ulp is 2^-16.
	return sign | uint8(math.Float32bits(math.Float32frombits(a)+math.Float32frombits(e5m2Magic))-e5m2Magic)
}

// e4m3Normal returns the magnitude bits of the F8E4M3 nearest to the float32 of
// magnitude bits a, which must lie in [2^-6, 464]: it rounds to nearest even at bit 20
// and rebiases the exponent from 127 to 7. A carry out of the mantissa bumps the
// exponent, which is the right result.
func e4m3Normal(a uint32) uint8 {
	a += 0x7ffff + (a>>20)&1
	return uint8((a - (127-7)<<23) >> 20)
}

// e5m2Normal is e4m3Normal for F8E5M2: a must lie in [2^-14, 61440), rounding is at
// bit 21 and the bias is 15.
func e5m2Normal(a uint32) uint8 {
	a += 0xfffff + (a>>21)&1
	return uint8((a - (127-15)<<23) >> 21)
}

// e4m3ToBits converts the bits of an F8E4M3 to the bits of the equal float32.
func e4m3ToBits(x uint32) uint32 {
	sign := (x & 0x80) << 24
	a := x & 0x7f
	switch {
	case a == 0x7f:
		return sign | f32Inf | 0x400000 // the NaN, quiet
	case a >= 0x08: // normal: rebias the exponent from 7 to 127
		return sign | (a<<20 + (127-7)<<23)
	}
	return sign | math.Float32bits(float32(a)*0x1p-9) // zero or subnormal: a * 2^-9, exact
}

// The float32 bits of every F8E4M3 and F8E5M2: 1 KiB each, so widening is one load.
var (
	e4m3Table = f8Table(e4m3ToBits)
	e5m2Table = f8Table(func(x uint32) uint32 { return f16ToBits(x << 8) }) // E5M2 is an F16's top byte
)

// f8Table returns widen of every 8-bit pattern.
func f8Table(widen func(uint32) uint32) *[256]uint32 {
	var t [256]uint32
	for i := range t {
		t[i] = widen(uint32(i))
	}
	return &t
}
