package arena_test

import (
	"math"
	"math/rand/v2"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
)

// f8Format is the reference for an OCP OFP8 format, written from the specification's
// definition (OFP8 Revision 1.0, 2023): the value of a pattern by formula, and rounding
// by search over the exact values. It shares nothing with the code under test.
type f8Format struct {
	name     string
	expBits  uint
	mantBits uint
	ieee     bool // E5M2: S.11111.00 is Inf, S.11111.xx NaN; E4M3: only S.1111.111 is NaN
}

var (
	e4m3Format = f8Format{"E4M3", 4, 3, false}
	e5m2Format = f8Format{"E5M2", 5, 2, true}
)

func (f f8Format) bias() int      { return 1<<(f.expBits-1) - 1 }
func (f f8Format) expMax() uint8  { return 1<<f.expBits - 1 }
func (f f8Format) mantMax() uint8 { return 1<<f.mantBits - 1 }

// maxFinite returns the largest finite positive pattern: S.1111.110 for E4M3,
// S.11110.11 for E5M2.
func (f f8Format) maxFinite() uint8 {
	if f.ieee {
		return (f.expMax()-1)<<f.mantBits | f.mantMax()
	}
	return f.expMax()<<f.mantBits | f.mantMax() - 1
}

// nanBits returns the NaN pattern narrowing gives a float32 NaN of bits u.
func (f f8Format) nanBits(u uint32) uint8 {
	sign := uint8(u>>24) & 0x80
	if !f.ieee {
		return sign | 0x7f
	}
	// Quiet (the top mantissa bit), with the top payload bit of the float32 below it.
	return sign | f.expMax()<<f.mantBits | 1<<(f.mantBits-1) | uint8(u>>21&1)
}

// overflowBits returns what a value past the largest finite one becomes.
func (f f8Format) overflowBits(sign uint8, sat bool) uint8 {
	switch {
	case sat:
		return sign | f.maxFinite()
	case f.ieee:
		return sign | f.expMax()<<f.mantBits // Inf
	}
	return sign | 0x7f // E4M3 has no Inf: NaN
}

// decode returns the exact value of pattern b and whether it is a NaN.
func (f f8Format) decode(b uint8) (v float64, nan bool) {
	sign := 1.0
	if b&0x80 != 0 {
		sign = -1
	}
	e := b >> f.mantBits & f.expMax()
	m := b & f.mantMax()
	switch {
	case e == f.expMax() && f.ieee && m == 0:
		return math.Inf(int(sign)), false
	case e == f.expMax() && (f.ieee || m == f.mantMax()):
		return math.NaN(), true
	case e == 0:
		return sign * math.Ldexp(float64(m), 1-f.bias()-int(f.mantBits)), false
	}
	return sign * math.Ldexp(float64(m|1<<f.mantBits), int(e)-f.bias()-int(f.mantBits)), false
}

// positives returns the values of the patterns 0 .. maxFinite+1 in order, the last
// replaced by the value one step of the top binade past the largest finite one (480,
// 65536): with an unbounded exponent range that is where rounding would go next, so a
// value that rounds to it overflows.
func (f f8Format) positives() []float64 {
	top := f.maxFinite()
	vals := make([]float64, top+2)
	for b := uint8(0); b <= top; b++ {
		vals[b], _ = f.decode(b)
	}
	vals[top+1] = vals[top] + (vals[top] - vals[top-1])
	return vals
}

// want returns the pattern x must narrow to.
func (f f8Format) want(vals []float64, x float32, sat bool) uint8 {
	u := math.Float32bits(x)
	if x != x {
		return f.nanBits(u)
	}
	sign := uint8(u>>24) & 0x80
	a := math.Abs(float64(x))
	top := len(vals) - 1 // the overflow placeholder
	if a >= vals[top] {
		return f.overflowBits(sign, sat)
	}
	i := sort.SearchFloat64s(vals, a) // first pattern whose value >= a
	if vals[i] != a {
		lo, hi := vals[i-1], vals[i]
		switch {
		case a-lo < hi-a:
			i--
		case a-lo == hi-a && i%2 == 1: // a tie goes to the even pattern
			i--
		}
	}
	if i == top {
		return f.overflowBits(sign, sat)
	}
	return sign | uint8(i)
}

type f8Codec struct {
	f     f8Format
	from  func(float32) uint8
	sat   func(float32) uint8
	to    func(uint8) float32
	isNaN func(uint8) bool
}

var f8Codecs = []f8Codec{
	{
		f:     e4m3Format,
		from:  func(x float32) uint8 { return uint8(arena.F8E4M3FromFloat32(x)) },
		sat:   func(x float32) uint8 { return uint8(arena.F8E4M3FromFloat32Sat(x)) },
		to:    func(b uint8) float32 { return arena.F8E4M3(b).Float32() },
		isNaN: func(b uint8) bool { return arena.F8E4M3(b).IsNaN() },
	},
	{
		f:     e5m2Format,
		from:  func(x float32) uint8 { return uint8(arena.F8E5M2FromFloat32(x)) },
		sat:   func(x float32) uint8 { return uint8(arena.F8E5M2FromFloat32Sat(x)) },
		to:    func(b uint8) float32 { return arena.F8E5M2(b).Float32() },
		isNaN: func(b uint8) bool { return arena.F8E5M2(b).IsNaN() },
	},
}

// checkF8 narrows x in both modes and compares with the reference.
func checkF8(t *testing.T, c f8Codec, vals []float64, x float32) bool {
	t.Helper()
	ok := true
	if got, want := c.from(x), c.f.want(vals, x, false); got != want {
		ok = assert.Equal(t, want, got, "%s(%v = %#08x)", c.f.name, x, math.Float32bits(x))
	}
	if got, want := c.sat(x), c.f.want(vals, x, true); got != want {
		ok = assert.Equal(t, want, got, "%sSat(%v = %#08x)", c.f.name, x, math.Float32bits(x)) && ok
	}
	return ok
}

// TestF8Reference pins the reference itself to figures the specification states, so
// that a wrong reference can not pass a wrong conversion.
func TestF8Reference(t *testing.T) {
	for _, tt := range []struct {
		f                                     f8Format
		max, minNormal, minSub, next, maxSubn float64
		nans, infs                            int
	}{
		{e4m3Format, 448, 0x1p-6, 0x1p-9, 480, 7 * 0x1p-9, 2, 0},
		{e5m2Format, 57344, 0x1p-14, 0x1p-16, 65536, 3 * 0x1p-16, 6, 2},
	} {
		vals := tt.f.positives()
		top := tt.f.maxFinite()
		assert.Equal(t, tt.max, vals[top], tt.f.name)
		assert.Equal(t, tt.next, vals[top+1], tt.f.name)
		assert.Equal(t, tt.minSub, vals[1], tt.f.name)
		assert.Equal(t, tt.maxSubn, vals[tt.f.mantMax()], tt.f.name)
		assert.Equal(t, tt.minNormal, vals[tt.f.mantMax()+1], tt.f.name)
		var nans, infs int
		for i := range 256 {
			v, nan := tt.f.decode(uint8(i))
			if nan {
				nans++
			} else if math.IsInf(v, 0) {
				infs++
			}
		}
		assert.Equal(t, tt.nans, nans, tt.f.name)
		assert.Equal(t, tt.infs, infs, tt.f.name)
	}
	v, _ := e4m3Format.decode(0x38)
	assert.Equal(t, 1.0, v)
	v, _ = e5m2Format.decode(0x3c)
	assert.Equal(t, 1.0, v)
}

// TestF8ToFloat32Exhaustive widens every one of the 256 patterns of each format and
// compares with the reference, then narrows the result back in both modes.
func TestF8ToFloat32Exhaustive(t *testing.T) {
	for _, c := range f8Codecs {
		t.Run(c.f.name, func(t *testing.T) {
			for i := range 256 {
				b := uint8(i)
				got := c.to(b)
				ref, nan := c.f.decode(b)
				assert.Equal(t, nan, c.isNaN(b), "IsNaN(%#02x)", b)
				if nan {
					// Quiet, with b's sign; E5M2 keeps its payload as F16 does.
					want := uint32(b&0x80)<<24 | 0x7fc00000
					if c.f.ieee {
						want |= uint32(b&c.f.mantMax()) << (23 - c.f.mantBits)
					}
					assert.Equal(t, want, math.Float32bits(got), "NaN %#02x widens quiet", b)
					quiet := b
					if c.f.ieee {
						quiet |= 1 << (c.f.mantBits - 1)
					}
					assert.Equal(t, quiet, c.from(got), "NaN %#02x round trip", b)
					assert.Equal(t, quiet, c.sat(got), "NaN %#02x round trip, saturating", b)
					continue
				}
				assert.Equal(t, ref, float64(got), "%#02x widens exactly", b)
				assert.Equal(t, math.Signbit(ref), math.Signbit(float64(got)), "%#02x keeps its sign", b)
				assert.Equal(t, b, c.from(got), "%#02x round trips", b)
				if !math.IsInf(ref, 0) {
					assert.Equal(t, b, c.sat(got), "%#02x round trips, saturating", b)
				}
			}
		})
	}
}

// TestF8FromFloat32Boundaries narrows, for every pair of adjacent patterns (and the
// largest finite value against the overflow point), both values, the exact halfway
// point (a tie) and the float32 values either side of it, with both signs and in both
// modes: every rounding decision the formats have.
func TestF8FromFloat32Boundaries(t *testing.T) {
	for _, c := range f8Codecs {
		t.Run(c.f.name, func(t *testing.T) {
			vals := c.f.positives()
			bad := 0
			for _, x := range roundingPoints(t, vals) {
				if !checkF8(t, c, vals, x) || !checkF8(t, c, vals, -x) {
					bad++
				}
				if bad > 10 {
					t.FailNow()
				}
			}
		})
	}
}

// TestF8FromFloat32Edges names the cases people get wrong.
func TestF8FromFloat32Edges(t *testing.T) {
	f32 := math.Float32frombits
	inf := float32(math.Inf(1))
	tests := []struct {
		name                         string
		in                           float32
		e4m3, e4m3Sat, e5m2, e5m2Sat uint8
	}{
		{"+0", 0, 0x00, 0x00, 0x00, 0x00},
		{"-0", float32(math.Copysign(0, -1)), 0x80, 0x80, 0x80, 0x80},
		{"one", 1, 0x38, 0x38, 0x3c, 0x3c},
		{"minus two", -2, 0xc0, 0xc0, 0xc0, 0xc0},
		{"E4M3 max 448", 448, 0x7e, 0x7e, 0x5f, 0x5f},
		{"E4M3 464 ties to 448", 464, 0x7e, 0x7e, 0x5f, 0x5f},
		{"E4M3 just over 464 overflows", math.Nextafter32(464, inf), 0x7f, 0x7e, 0x5f, 0x5f},
		{"E4M3 -480 overflows", -480, 0xff, 0xfe, 0xe0, 0xe0},
		{"E5M2 max 57344", 57344, 0x7f, 0x7e, 0x7b, 0x7b},
		{"just under the E5M2 overflow tie", math.Nextafter32(61440, 0), 0x7f, 0x7e, 0x7b, 0x7b},
		{"E5M2 61440 ties to overflow", 61440, 0x7f, 0x7e, 0x7c, 0x7b},
		{"-1e6", -1e6, 0xff, 0xfe, 0xfc, 0xfb},
		{"float32 max", math.MaxFloat32, 0x7f, 0x7e, 0x7c, 0x7b},
		{"+Inf", inf, 0x7f, 0x7e, 0x7c, 0x7b},
		{"-Inf", -inf, 0xff, 0xfe, 0xfc, 0xfb},
		{"E4M3 smallest subnormal 2^-9", 0x1p-9, 0x01, 0x01, 0x18, 0x18},
		{"E4M3 2^-10 ties to zero", 0x1p-10, 0x00, 0x00, 0x14, 0x14},
		{"E4M3 just over 2^-10 rounds up", math.Nextafter32(0x1p-10, 1), 0x01, 0x01, 0x14, 0x14},
		{"E4M3 3*2^-10 ties to even 2^-8", 3 * 0x1p-10, 0x02, 0x02, 0x1a, 0x1a},
		{"E4M3 largest subnormal", 7 * 0x1p-9, 0x07, 0x07, 0x23, 0x23},
		{"E4M3 rounds up into the smallest normal", math.Nextafter32(0x1p-6, 0), 0x08, 0x08, 0x24, 0x24},
		{"E5M2 smallest subnormal 2^-16", 0x1p-16, 0x00, 0x00, 0x01, 0x01},
		{"E5M2 2^-17 ties to zero", 0x1p-17, 0x00, 0x00, 0x00, 0x00},
		{"E5M2 -3*2^-17 ties to even -2^-15", -3 * 0x1p-17, 0x80, 0x80, 0x82, 0x82},
		{"E5M2 rounds up into the smallest normal", math.Nextafter32(0x1p-14, 0), 0x00, 0x00, 0x04, 0x04},
		{"E4M3 tie down to even", 1 + 0x1p-4, 0x38, 0x38, 0x3c, 0x3c},
		{"E4M3 tie up to even", 1 + 3*0x1p-4, 0x3a, 0x3a, 0x3d, 0x3d},
		{"rounding carries into the exponent", f32(0x3fffffff), 0x40, 0x40, 0x40, 0x40},
		{"float32 smallest subnormal", f32(1), 0x00, 0x00, 0x00, 0x00},
		{"quiet NaN", f32(0x7fc00000), 0x7f, 0x7f, 0x7e, 0x7e},
		{"signaling NaN comes out quiet", f32(0x7f800001), 0x7f, 0x7f, 0x7e, 0x7e},
		{"NaN payload top bit kept in E5M2", f32(0x7fa00000), 0x7f, 0x7f, 0x7f, 0x7f},
		{"negative NaN keeps its sign", f32(0xff812345), 0xff, 0xff, 0xfe, 0xfe},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.e4m3, uint8(arena.F8E4M3FromFloat32(tt.in)), "E4M3")
			assert.Equal(t, tt.e4m3Sat, uint8(arena.F8E4M3FromFloat32Sat(tt.in)), "E4M3 saturating")
			assert.Equal(t, tt.e5m2, uint8(arena.F8E5M2FromFloat32(tt.in)), "E5M2")
			assert.Equal(t, tt.e5m2Sat, uint8(arena.F8E5M2FromFloat32Sat(tt.in)), "E5M2 saturating")
		})
	}
}

// TestF8FromFloat32Sample narrows a large sample of float32 bit patterns: uniform over
// all patterns, and uniform over the exponents where each format has values.
func TestF8FromFloat32Sample(t *testing.T) {
	for _, c := range f8Codecs {
		t.Run(c.f.name, func(t *testing.T) {
			vals := c.f.positives()
			rng := rand.New(rand.NewPCG(7, 8))
			eLo := 127 - c.f.bias() - int(c.f.mantBits) - 2
			eHi := 127 + c.f.bias() + 3
			for range 1 << 18 {
				if !checkF8(t, c, vals, math.Float32frombits(rng.Uint32())) {
					t.FailNow()
				}
				e := uint32(eLo + rng.IntN(eHi-eLo+1))
				if !checkF8(t, c, vals, math.Float32frombits(rng.Uint32()&0x807fffff|e<<23)) {
					t.FailNow()
				}
			}
		})
	}
}

// TestF8FromFloat32All narrows every float32 (with -long: 2^32 values a mode and a
// format), checking what, together with TestF8FromFloat32Boundaries, makes the
// conversion right everywhere: the result never decreases as |x| grows (patterns of
// one sign are ordered as their values, and the overflow result follows the largest
// finite one), -x narrows to x's pattern with the sign set, and every NaN narrows to
// the reference's NaN. Between two points the boundary test checks, a non-decreasing
// result can only be the value both ends have. (Comparing each value with the search
// of the reference instead takes over ten minutes a format here.)
func TestF8FromFloat32All(t *testing.T) {
	if !longTests() {
		t.Skip("with -long only: 2^34 conversions")
	}
	for _, c := range f8Codecs {
		for _, m := range []struct {
			name string
			from func(float32) uint8
		}{{"non-saturating", c.from}, {"saturating", c.sat}} {
			t.Run(c.f.name+"/"+m.name, func(t *testing.T) {
				const top = 0x7f800000 // +Inf: the magnitudes are [0, top]
				var wg sync.WaitGroup
				var bad atomic.Int64 // bits + 1 of the first failure found
				workers := runtime.GOMAXPROCS(0)
				chunk := uint32(top/workers + 1)
				for w := range workers {
					wg.Go(func() {
						lo := uint32(w) * chunk
						hi := min(lo+chunk, top) // each chunk also checks hi against hi-1
						prev := m.from(math.Float32frombits(lo))
						for u := lo; u <= hi && bad.Load() == 0; u++ {
							x := math.Float32frombits(u)
							p := m.from(x)
							if p < prev || m.from(-x) != p|0x80 {
								bad.Store(int64(u) + 1)
							}
							prev = p
						}
					})
				}
				wg.Wait()
				require.Zero(t, bad.Load(), "fails at %#08x", bad.Load()-1)
				for u := uint32(top + 1); u <= 0x7fffffff; u++ {
					for _, v := range []uint32{u, u | 0x80000000} {
						if got, want := m.from(math.Float32frombits(v)), c.f.nanBits(v); got != want {
							require.Equal(t, want, got, "NaN %#08x", v)
						}
					}
				}
			})
		}
	}
}

// TestF8Slices checks that the slice converters agree with the scalar ones and stop at
// the shorter slice.
func TestF8Slices(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	src := make([]float32, 3000)
	for i := range src {
		src[i] = math.Float32frombits(rng.Uint32())
		if i%2 == 0 {
			src[i] = float32(rng.NormFloat64() * 200)
		}
	}
	src[0], src[1], src[2] = float32(math.NaN()), float32(math.Inf(-1)), 1e6

	e4 := make([]arena.F8E4M3, len(src))
	e4s := make([]arena.F8E4M3, len(src))
	e5 := make([]arena.F8E5M2, len(src))
	e5s := make([]arena.F8E5M2, len(src))
	require.Equal(t, len(src), arena.F8E4M3sFromFloat32s(e4, src))
	require.Equal(t, len(src), arena.F8E4M3sFromFloat32sSat(e4s, src))
	require.Equal(t, len(src), arena.F8E5M2sFromFloat32s(e5, src))
	require.Equal(t, len(src), arena.F8E5M2sFromFloat32sSat(e5s, src))
	w4 := make([]float32, len(src))
	w5 := make([]float32, len(src))
	require.Equal(t, len(src), arena.Float32sFromF8E4M3s(w4, e4))
	require.Equal(t, len(src), arena.Float32sFromF8E5M2s(w5, e5))
	for i, x := range src {
		assert.Equal(t, arena.F8E4M3FromFloat32(x), e4[i])
		assert.Equal(t, arena.F8E4M3FromFloat32Sat(x), e4s[i])
		assert.Equal(t, arena.F8E5M2FromFloat32(x), e5[i])
		assert.Equal(t, arena.F8E5M2FromFloat32Sat(x), e5s[i])
		assert.Equal(t, math.Float32bits(e4[i].Float32()), math.Float32bits(w4[i]))
		assert.Equal(t, math.Float32bits(e5[i].Float32()), math.Float32bits(w5[i]))
	}
	assert.Equal(t, arena.F8E4M3(0xff), e4[1], "-Inf is NaN in E4M3")
	assert.Equal(t, arena.F8E4M3(0xfe), e4s[1], "-Inf saturates to -448")

	short := make([]arena.F8E4M3, 2)
	assert.Equal(t, 2, arena.F8E4M3sFromFloat32s(short, []float32{1, -2, 3}))
	assert.Equal(t, []arena.F8E4M3{0x38, 0xc0}, short)
	out := []float32{9, 9, 9}
	assert.Equal(t, 2, arena.Float32sFromF8E5M2s(out, []arena.F8E5M2{0x3c, 0xc0}))
	assert.Equal(t, []float32{1, -2, 9}, out)
	assert.Equal(t, 1, arena.Float32sFromF8E4M3s(out[:1], []arena.F8E4M3{0x40, 0x38}))
	assert.Equal(t, float32(2), out[0])
	assert.Zero(t, arena.F8E5M2sFromFloat32sSat(nil, src))
	assert.Zero(t, arena.F8E4M3sFromFloat32sSat(e4, nil))
}

func TestF8InfAndString(t *testing.T) {
	assert.True(t, arena.F8E5M2(0x7c).IsInf(0))
	assert.True(t, arena.F8E5M2(0x7c).IsInf(1))
	assert.False(t, arena.F8E5M2(0x7c).IsInf(-1))
	assert.True(t, arena.F8E5M2(0xfc).IsInf(-1))
	assert.False(t, arena.F8E5M2(0xfc).IsInf(1))
	assert.False(t, arena.F8E5M2(0x7b).IsInf(0))
	assert.False(t, arena.F8E5M2(0x7d).IsInf(0), "a NaN is not an infinity")

	assert.Equal(t, "448", arena.F8E4M3(0x7e).String())
	assert.Equal(t, "-0.001953125", arena.F8E4M3(0x81).String())
	assert.Equal(t, "NaN", arena.F8E4M3(0xff).String())
	assert.Equal(t, "57344", arena.F8E5M2(0x7b).String())
	assert.Equal(t, "-Inf", arena.F8E5M2(0xfc).String())
	assert.Equal(t, "1.5258789e-05", arena.F8E5M2(0x01).String())
}
