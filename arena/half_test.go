package arena_test

import (
	"flag"
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

func init() {
	// NB: another test file of this package may define -long too; define it only once.
	if flag.Lookup("long") == nil {
		flag.Bool("long", false, "run long, exhaustive tests")
	}
}

// longTests reports whether -long was given.
func longTests() bool {
	f := flag.Lookup("long")
	return f != nil && f.Value.String() == "true"
}

// halfFormat describes a small binary float format for the float64 reference.
type halfFormat struct {
	name     string
	expBits  uint // exponent field width
	mantBits uint // mantissa field width
}

var (
	f16Format  = halfFormat{"F16", 5, 10}
	bf16Format = halfFormat{"BF16", 8, 7}
)

func (f halfFormat) bias() int      { return 1<<(f.expBits-1) - 1 }
func (f halfFormat) expMax() uint32 { return 1<<f.expBits - 1 }
func (f halfFormat) infBits() uint16 {
	return uint16(f.expMax() << f.mantBits)
}

// decode returns the exact value of the bit pattern b, computed in float64 from the
// format's definition (not from the code under test), and whether it is a NaN.
func (f halfFormat) decode(b uint16) (v float64, nan bool) {
	sign := 1.0
	if b&0x8000 != 0 {
		sign = -1
	}
	e := uint32(b>>f.mantBits) & f.expMax()
	m := uint32(b) & (1<<f.mantBits - 1)
	switch {
	case e == f.expMax() && m != 0:
		return math.NaN(), true
	case e == f.expMax():
		return math.Inf(int(sign)), false
	case e == 0: // zero or subnormal: m * 2^(1-bias-mantBits)
		return sign * math.Ldexp(float64(m), 1-f.bias()-int(f.mantBits)), false
	}
	return sign * math.Ldexp(float64(m|1<<f.mantBits), int(e)-f.bias()-int(f.mantBits)), false
}

// positives returns the values of the non-negative patterns 0 .. +Inf in order. The
// value of +Inf is replaced by 2^(emax+1), the next step past the largest finite value:
// IEEE rounding treats that point as the place where values round to Inf.
func (f halfFormat) positives() []float64 {
	inf := f.infBits()
	vals := make([]float64, inf+1)
	for b := uint16(0); b < inf; b++ {
		vals[b], _ = f.decode(b)
	}
	vals[inf] = math.Ldexp(1, int(f.expMax())-f.bias())
	return vals
}

// round returns the pattern nearest to x, ties to the even pattern, by search over the
// exact values. x must not be NaN.
func (f halfFormat) round(vals []float64, x float64) uint16 {
	var sign uint16
	if math.Signbit(x) {
		sign = 0x8000
		x = -x
	}
	inf := f.infBits()
	if x >= vals[inf] {
		return sign | inf
	}
	// i is the first pattern whose value is >= x.
	i := sort.SearchFloat64s(vals, x)
	if vals[i] == x {
		return sign | uint16(i)
	}
	lo, hi := vals[i-1], vals[i]
	switch {
	case x-lo < hi-x:
		return sign | uint16(i-1)
	case x-lo > hi-x:
		return sign | uint16(i)
	case i%2 == 0:
		return sign | uint16(i)
	}
	return sign | uint16(i-1)
}

// quietNaN returns the float32 bits a NaN pattern b widens to: quiet, same sign and payload.
func (f halfFormat) quietNaNBits(b uint16) uint32 {
	m := uint32(b) & (1<<f.mantBits - 1)
	return uint32(b&0x8000)<<16 | 0x7fc00000 | m<<(23-f.mantBits)
}

type halfCodec struct {
	f      halfFormat
	from   func(float32) uint16
	to     func(uint16) float32
	isNaN  func(uint16) bool
	isInf  func(uint16, int) bool
	string func(uint16) string
}

var codecs = []halfCodec{
	{
		f:      f16Format,
		from:   func(x float32) uint16 { return uint16(arena.F16FromFloat32(x)) },
		to:     func(b uint16) float32 { return arena.F16(b).Float32() },
		isNaN:  func(b uint16) bool { return arena.F16(b).IsNaN() },
		isInf:  func(b uint16, s int) bool { return arena.F16(b).IsInf(s) },
		string: func(b uint16) string { return arena.F16(b).String() },
	},
	{
		f:      bf16Format,
		from:   func(x float32) uint16 { return uint16(arena.BF16FromFloat32(x)) },
		to:     func(b uint16) float32 { return arena.BF16(b).Float32() },
		isNaN:  func(b uint16) bool { return arena.BF16(b).IsNaN() },
		isInf:  func(b uint16, s int) bool { return arena.BF16(b).IsInf(s) },
		string: func(b uint16) string { return arena.BF16(b).String() },
	},
}

// TestHalfToFloat32Exhaustive widens every one of the 65,536 patterns and compares with
// the float64 reference, then narrows the result back.
func TestHalfToFloat32Exhaustive(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.f.name, func(t *testing.T) {
			var nans, infs, bad int
			for i := 0; i < 1<<16; i++ {
				b := uint16(i)
				got := c.to(b)
				ref, nan := c.f.decode(b)
				assert.Equal(t, nan, c.isNaN(b), "IsNaN(%#04x)", b)
				assert.Equal(t, math.IsInf(ref, 0), c.isInf(b, 0), "IsInf(%#04x, 0)", b)
				assert.Equal(t, math.IsInf(ref, 1), c.isInf(b, 1), "IsInf(%#04x, 1)", b)
				assert.Equal(t, math.IsInf(ref, -1), c.isInf(b, -1), "IsInf(%#04x, -1)", b)
				if nan {
					nans++
					if !assert.Equal(t, c.f.quietNaNBits(b), math.Float32bits(got), "NaN %#04x widens quiet with its payload", b) {
						bad++
					}
					// Narrowing gives back the pattern, made quiet.
					assert.Equal(t, b|1<<(c.f.mantBits-1), c.from(got), "NaN %#04x round trip", b)
					continue
				}
				if math.IsInf(ref, 0) {
					infs++
				}
				if !assert.Equal(t, ref, float64(got), "%#04x widens exactly", b) ||
					!assert.Equal(t, math.Signbit(ref), math.Signbit(float64(got)), "%#04x keeps its sign", b) {
					bad++
				}
				if !assert.Equal(t, b, c.from(got), "%#04x round trips", b) {
					bad++
				}
				if bad > 10 {
					t.FailNow()
				}
			}
			// Both formats: 2 infinities and 2*(2^mantBits - 1) NaNs.
			assert.Equal(t, 2, infs)
			assert.Equal(t, 2*(1<<c.f.mantBits-1), nans)
		})
	}
}

// narrowWant returns the pattern x must narrow to: the reference rounding, or for a
// NaN the quiet NaN with x's sign and top payload bits.
func narrowWant(c halfCodec, vals []float64, x float32) uint16 {
	if x != x {
		u := math.Float32bits(x)
		return uint16(u>>16)&0x8000 | c.f.infBits() | 1<<(c.f.mantBits-1) | uint16(u&0x7fffff>>(23-c.f.mantBits))
	}
	return c.f.round(vals, float64(x))
}

// checkNarrow narrows x and compares with the reference.
func checkNarrow(t *testing.T, c halfCodec, vals []float64, x float32) bool {
	t.Helper()
	got, want := c.from(x), narrowWant(c, vals, x)
	if got == want {
		return true
	}
	return assert.Equal(t, want, got, "%s(%v = %#08x)", c.f.name, x, math.Float32bits(x))
}

// TestHalfFromFloat32Boundaries narrows, for every pair of adjacent patterns (and the
// largest finite value against the point where values round to Inf), both values, the
// exact halfway point (a tie) and the float32 values on either side of it, with both
// signs: every rounding decision the format has.
func TestHalfFromFloat32Boundaries(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.f.name, func(t *testing.T) {
			vals := c.f.positives()
			bad := 0
			for _, x := range roundingPoints(t, vals) {
				if !checkNarrow(t, c, vals, x) || !checkNarrow(t, c, vals, -x) {
					bad++
				}
				if bad > 10 {
					t.FailNow()
				}
			}
		})
	}
}

// roundingPoints returns, for every pair of adjacent values of vals (the exact
// non-negative values of a format in order), both values, the exact halfway point
// between them (a tie, which must be a float32), the float32 values either side of it,
// and the float32 just above the lower value.
func roundingPoints(t *testing.T, vals []float64) []float32 {
	t.Helper()
	inf := float32(math.Inf(1))
	var xs []float32
	for i := 0; i+1 < len(vals); i++ {
		lo, hi := float32(vals[i]), float32(vals[i+1])
		mid64 := (vals[i] + vals[i+1]) / 2
		mid := float32(mid64)
		require.Equal(t, mid64, float64(mid), "the halfway point is a float32")
		xs = append(xs, lo, hi, mid, math.Nextafter32(mid, 0), math.Nextafter32(mid, inf), math.Nextafter32(lo, inf))
	}
	return xs
}

// TestHalfFromFloat32Edges names the cases people get wrong.
func TestHalfFromFloat32Edges(t *testing.T) {
	f32 := math.Float32frombits
	tests := []struct {
		name      string
		in        float32
		f16, bf16 uint16
	}{
		{"+0", 0, 0x0000, 0x0000},
		{"-0", float32(math.Copysign(0, -1)), 0x8000, 0x8000},
		{"one", 1, 0x3c00, 0x3f80},
		{"minus two", -2, 0xc000, 0xc000},
		{"F16 max finite", 65504, 0x7bff, 0x4780},
		{"just under the F16 overflow tie", math.Nextafter32(65520, 0), 0x7bff, 0x4780},
		{"F16 overflow tie to Inf", 65520, 0x7c00, 0x4780},
		{"F16 overflow", 1e6, 0x7c00, 0x4974},
		{"float32 max", math.MaxFloat32, 0x7c00, 0x7f80},
		{"-float32 max", -math.MaxFloat32, 0xfc00, 0xff80},
		{"+Inf", float32(math.Inf(1)), 0x7c00, 0x7f80},
		{"-Inf", float32(math.Inf(-1)), 0xfc00, 0xff80},
		{"BF16 max finite", f32(0x7f7f0000), 0x7c00, 0x7f7f},
		{"BF16 overflow tie to Inf", f32(0x7f7f8000), 0x7c00, 0x7f80},
		{"just under the BF16 overflow tie", f32(0x7f7f7fff), 0x7c00, 0x7f7f},
		{"F16 smallest subnormal 2^-24", 0x1p-24, 0x0001, 0x3380},
		{"F16 2^-25 ties to zero", 0x1p-25, 0x0000, 0x3300},
		{"F16 just over 2^-25 rounds up", math.Nextafter32(0x1p-25, 1), 0x0001, 0x3300},
		{"F16 3*2^-25 ties to even 2^-23", 3 * 0x1p-25, 0x0002, 0x33c0},
		{"F16 5*2^-25 ties to even 2^-23", 5 * 0x1p-25, 0x0002, 0x3420},
		{"F16 underflow", 1e-10, 0x0000, 0x2edc},
		{"F16 -underflow keeps the sign", -1e-10, 0x8000, 0xaedc},
		{"F16 largest subnormal", 1023 * 0x1p-24, 0x03ff, 0x3880},
		{"F16 rounds up into the smallest normal", math.Nextafter32(0x1p-14, 0), 0x0400, 0x3880},
		{"F16 smallest normal", 0x1p-14, 0x0400, 0x3880},
		{"F16 tie down to even", 1 + 0x1p-11, 0x3c00, 0x3f80},
		{"F16 tie up to even", 1 + 3*0x1p-11, 0x3c02, 0x3f80},
		{"BF16 tie down to even", 1 + 0x1p-8, 0x3c04, 0x3f80},
		{"BF16 tie up to even", 1 + 3*0x1p-8, 0x3c0c, 0x3f82},
		{"BF16 rounding carries into the exponent", f32(0x3fffffff), 0x4000, 0x4000},
		{"float32 smallest subnormal", f32(1), 0x0000, 0x0000},
		{"BF16 subnormal", f32(0x00400000), 0x0000, 0x0040},
		{"quiet NaN", f32(0x7fc00000), 0x7e00, 0x7fc0},
		{"signaling NaN comes out quiet", f32(0x7f800001), 0x7e00, 0x7fc0},
		{"NaN payload top bits kept", f32(0x7fa00000), 0x7f00, 0x7fe0},
		{"negative NaN keeps its sign", f32(0xff812345), 0xfe09, 0xffc1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.f16, uint16(arena.F16FromFloat32(tt.in)), "F16 got %#04x", uint16(arena.F16FromFloat32(tt.in)))
			assert.Equal(t, tt.bf16, uint16(arena.BF16FromFloat32(tt.in)), "BF16 got %#04x", uint16(arena.BF16FromFloat32(tt.in)))
		})
	}
}

// TestHalfFromFloat32Sample narrows a large sample of float32 bit patterns: uniform over
// all patterns, and uniform over the exponents where each format has finite values.
// With -long it narrows all 2^32 float32 values.
func TestHalfFromFloat32Sample(t *testing.T) {
	for _, c := range codecs {
		t.Run(c.f.name, func(t *testing.T) {
			vals := c.f.positives()
			if longTests() {
				if x, found := firstFloat32(func(x float32) bool { return c.from(x) != narrowWant(c, vals, x) }); found {
					checkNarrow(t, c, vals, x)
				}
				return
			}
			rng := rand.New(rand.NewPCG(1, 2))
			// The float32 exponents (biased) from below the smallest subnormal to past the largest finite value.
			eLo := 127 - c.f.bias() - int(c.f.mantBits) - 2
			eHi := 127 + c.f.bias() + 2
			for range 1 << 19 {
				if !checkNarrow(t, c, vals, math.Float32frombits(rng.Uint32())) {
					t.FailNow()
				}
				e := uint32(max(eLo+rng.IntN(eHi-eLo+1), 0))
				u := rng.Uint32()&0x807fffff | min(e, 255)<<23
				if !checkNarrow(t, c, vals, math.Float32frombits(u)) {
					t.FailNow()
				}
			}
		})
	}
}

// firstFloat32 returns a float32 for which bad is true, trying all 2^32 of them split
// between the CPUs, and whether there is one.
func firstFloat32(bad func(float32) bool) (float32, bool) {
	var wg sync.WaitGroup
	var found atomic.Int64 // the bits + 1 of a bad value
	workers := runtime.GOMAXPROCS(0)
	for w := range workers {
		wg.Go(func() {
			for u := uint64(w); u < 1<<32 && found.Load() == 0; u += uint64(workers) {
				if bad(math.Float32frombits(uint32(u))) {
					found.Store(int64(u) + 1)
				}
			}
		})
	}
	wg.Wait()
	u := found.Load()
	return math.Float32frombits(uint32(u - 1)), u != 0
}

// TestHalfSlices checks that the slice converters agree with the scalar ones and stop
// at the shorter slice.
func TestHalfSlices(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	src := make([]float32, 1000)
	for i := range src {
		src[i] = math.Float32frombits(rng.Uint32())
	}
	src[0], src[1], src[2] = float32(math.NaN()), float32(math.Inf(-1)), 0x1p-25

	h := make([]arena.F16, 1000)
	bh := make([]arena.BF16, 1000)
	require.Equal(t, 1000, arena.F16sFromFloat32s(h, src))
	require.Equal(t, 1000, arena.BF16sFromFloat32s(bh, src))
	back := make([]float32, 1000)
	bback := make([]float32, 1000)
	require.Equal(t, 1000, arena.Float32sFromF16s(back, h))
	require.Equal(t, 1000, arena.Float32sFromBF16s(bback, bh))
	for i, x := range src {
		assert.Equal(t, arena.F16FromFloat32(x), h[i])
		assert.Equal(t, arena.BF16FromFloat32(x), bh[i])
		assert.Equal(t, math.Float32bits(h[i].Float32()), math.Float32bits(back[i]))
		assert.Equal(t, math.Float32bits(bh[i].Float32()), math.Float32bits(bback[i]))
	}

	// Shorter dst or src: min of the two, the rest untouched.
	short := make([]arena.F16, 3)
	assert.Equal(t, 3, arena.F16sFromFloat32s(short, []float32{1, 2, 3, 4}))
	assert.Equal(t, []arena.F16{0x3c00, 0x4000, 0x4200}, short)
	out := []float32{9, 9, 9}
	assert.Equal(t, 2, arena.Float32sFromF16s(out, []arena.F16{0x3c00, 0x4000}))
	assert.Equal(t, []float32{1, 2, 9}, out)
	bout := []float32{9, 9}
	assert.Equal(t, 1, arena.Float32sFromBF16s(bout, []arena.BF16{0x3f80}))
	assert.Equal(t, []float32{1, 9}, bout)
	bshort := make([]arena.BF16, 1)
	assert.Equal(t, 1, arena.BF16sFromFloat32s(bshort, []float32{-2, 5}))
	assert.Equal(t, []arena.BF16{0xc000}, bshort)
	assert.Zero(t, arena.F16sFromFloat32s(nil, src))

	// Every pattern, and the float32 values between them, through the slice paths.
	all := make([]arena.F16, 1<<16)
	ball := make([]arena.BF16, 1<<16)
	for i := range all {
		all[i], ball[i] = arena.F16(i), arena.BF16(i)
	}
	wide := make([]float32, 3<<16)
	bwide := make([]float32, 3<<16)
	arena.Float32sFromF16s(wide, all)
	arena.Float32sFromBF16s(bwide, ball)
	for i := range all {
		assert.Equal(t, math.Float32bits(all[i].Float32()), math.Float32bits(wide[i]))
		assert.Equal(t, math.Float32bits(ball[i].Float32()), math.Float32bits(bwide[i]))
		wide[1<<16+i], wide[2<<16+i] = math.Nextafter32(wide[i], 0), math.Nextafter32(wide[i], float32(math.Inf(1)))
		bwide[1<<16+i], bwide[2<<16+i] = math.Nextafter32(bwide[i], 0), math.Nextafter32(bwide[i], float32(math.Inf(1)))
	}
	narrow := make([]arena.F16, len(wide))
	bnarrow := make([]arena.BF16, len(bwide))
	arena.F16sFromFloat32s(narrow, wide)
	arena.BF16sFromFloat32s(bnarrow, bwide)
	for i := range wide {
		assert.Equal(t, arena.F16FromFloat32(wide[i]), narrow[i])
		assert.Equal(t, arena.BF16FromFloat32(bwide[i]), bnarrow[i])
	}
	assert.Zero(t, arena.Float32sFromBF16s(back, nil))
}

func TestHalfString(t *testing.T) {
	assert.Equal(t, "1", arena.F16(0x3c00).String())
	assert.Equal(t, "65504", arena.F16(0x7bff).String())
	assert.Equal(t, "5.9604645e-08", arena.F16(0x0001).String())
	assert.Equal(t, "-Inf", arena.F16(0xfc00).String())
	assert.Equal(t, "NaN", arena.F16(0x7e00).String())
	assert.Equal(t, "-2", arena.BF16(0xc000).String())
	assert.Equal(t, "3.3895314e+38", arena.BF16(0x7f7f).String())
	assert.Equal(t, "+Inf", arena.BF16(0x7f80).String())
}
