package arena_test

import (
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
)

// refQ8_0 quantizes one block as the format defines it (llama.cpp,
// ggml/src/ggml-quants.c, quantize_row_q8_0_ref), in float64 with one rounding to
// float32 per float32 operation of the definition, and with the reference F16 rounding
// of half_test.go: no code is shared with the package.
func refQ8_0(f16Vals []float64, x []float32) (d uint16, qs [32]int8) {
	var amax float64
	for _, v := range x {
		amax = math.Max(amax, math.Abs(float64(v)))
	}
	d32 := float32(amax / 127) // one rounding: the float32 quotient
	d = f16Format.round(f16Vals, float64(d32))
	var id float32
	if d32 != 0 {
		id = float32(1 / float64(d32))
	}
	if math.IsInf(float64(id), 0) {
		id = 0 // the package's documented choice where the reference is undefined
	}
	for j, v := range x {
		p := float64(float32(float64(v) * float64(id))) // the float32 product
		qs[j] = int8(math.Round(p))                     // roundf: ties away from zero
	}
	return d, qs
}

// refDequantQ8_0 returns value j of a block: the float32 product q × D.
func refDequantQ8_0(b arena.BlockQ8_0, j int) float32 {
	d, _ := f16Format.decode(uint16(b.D))
	return float32(float64(b.Qs[j]) * d)
}

// q8Blocks returns n blocks of random values whose magnitudes span the format: tiny
// (the scale underflows F16), subnormal scales, ordinary activations, outliers, values
// whose products are exact ties, and the largest block the F16 scale allows.
func q8Blocks(rng *rand.Rand, n int) []float32 {
	x := make([]float32, n*32)
	for i := range n {
		b := x[i*32 : (i+1)*32]
		scale := math.Ldexp(1, rng.IntN(60)-40)
		switch i % 7 {
		case 0:
			scale = 1e-39 // 1/d overflows float32
		case 1:
			scale = math.Ldexp(1, -20-rng.IntN(10)) // d is an F16 subnormal or 0
		}
		for j := range b {
			b[j] = float32(rng.NormFloat64() * scale)
			if i%7 == 2 {
				b[j] = float32((2*rng.Float64() - 1) * 127 * 65504) // up to the largest scale
			}
		}
		if i%7 == 3 {
			// amax 127: id is 1 and every half-integer is a tie.
			for j := range b {
				b[j] = float32(rng.IntN(255)-127) + 0.5*float32(rng.IntN(2))
			}
			b[rng.IntN(32)] = -127
		}
		if i%11 == 4 {
			clear(b) // all zeros
		}
	}
	return x
}

func TestQuantizeQ8_0Reference(t *testing.T) {
	f16Vals := f16Format.positives()
	rng := rand.New(rand.NewPCG(11, 12))
	const n = 4000
	x := q8Blocks(rng, n)
	blocks := make([]arena.BlockQ8_0, n)
	got, err := arena.QuantizeQ8_0(blocks, x)
	require.NoError(t, err)
	require.Equal(t, n, got)
	y := make([]float32, len(x))
	got, err = arena.DequantizeQ8_0(y, blocks)
	require.NoError(t, err)
	require.Equal(t, n, got)
	bad := 0
	for i, b := range blocks {
		xb := x[i*32 : (i+1)*32]
		d, qs := refQ8_0(f16Vals, xb)
		if !assert.Equal(t, d, uint16(b.D), "block %d scale", i) || !assert.Equal(t, qs, b.Qs, "block %d quants", i) {
			bad++
		}
		for j := range 32 {
			if want := refDequantQ8_0(b, j); math.Float32bits(want) != math.Float32bits(y[i*32+j]) {
				bad++
				assert.Equal(t, want, y[i*32+j], "block %d value %d", i, j)
			}
		}
		// The error bound of the format where the scale is a normal F16: half a step,
		// plus what rounding the scale to F16 moves the largest quant.
		dd := float64(b.D.Float32())
		if dd >= 0x1p-14 {
			d32 := float64(float32(amaxOf(xb) / 127))
			bound := 0.5*d32*(1+0x1p-20) + 127*math.Abs(d32-dd)
			for j := range 32 {
				if e := math.Abs(float64(xb[j]) - float64(y[i*32+j])); e > bound*(1+0x1p-20) {
					bad++
					assert.LessOrEqual(t, e, bound, "block %d value %d: %v -> %v", i, j, xb[j], y[i*32+j])
				}
			}
			// Quantizing what a block dequantizes to gives the block back.
			var again [1]arena.BlockQ8_0
			_, err := arena.QuantizeQ8_0(again[:], y[i*32:(i+1)*32])
			require.NoError(t, err)
			assert.Equal(t, b, again[0], "block %d requantizes to itself", i)
		}
		if bad > 10 {
			t.FailNow()
		}
	}
}

func amaxOf(x []float32) float64 {
	var m float64
	for _, v := range x {
		m = math.Max(m, math.Abs(float64(v)))
	}
	return m
}

// TestQ8_0Bytes checks one block against bytes written by hand from the format: the
// F16 scale little-endian, then the int8 quants.
func TestQ8_0Bytes(t *testing.T) {
	x := make([]float32, 32)
	copy(x, []float32{127, -63.5, 1, 0.49, -0.5, 2.5, -2.5, 100.4})
	var b [1]arena.BlockQ8_0
	n, err := arena.QuantizeQ8_0(b[:], x)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&b[0])), unsafe.Sizeof(b[0]))
	want := make([]byte, 34)
	// d = 127/127 = 1 = F16 0x3c00; ties go away from zero: -63.5 -> -64, 2.5 -> 3.
	copy(want, []byte{0x00, 0x3c, 127, 0xc0, 1, 0, 0xff, 3, 0xfd, 100})
	assert.Equal(t, want, raw)

	y := make([]float32, 32)
	_, err = arena.DequantizeQ8_0(y, b[:])
	require.NoError(t, err)
	assert.Equal(t, []float32{127, -64, 1, 0, -1, 3, -3, 100}, y[:8])
}

func TestQ8_0Edges(t *testing.T) {
	one := func(x []float32) (arena.BlockQ8_0, error) {
		var b [1]arena.BlockQ8_0
		_, err := arena.QuantizeQ8_0(b[:], x)
		return b[0], err
	}
	block := func(v ...float32) []float32 {
		x := make([]float32, 32)
		copy(x, v)
		return x
	}
	// All zeros: scale 0, quants 0.
	b, err := one(block())
	require.NoError(t, err)
	assert.Equal(t, arena.BlockQ8_0{}, b)
	// Negative zero and a tiny block whose 1/d overflows: zero quants, zero scale.
	b, err = one(block(float32(math.Copysign(0, -1)), 1e-39, -2e-39))
	require.NoError(t, err)
	assert.Equal(t, arena.BlockQ8_0{}, b)
	// The largest scale F16 holds.
	b, err = one(block(127 * 65504))
	require.NoError(t, err)
	assert.Equal(t, arena.F16(0x7bff), b.D)
	assert.Equal(t, int8(127), b.Qs[0])

	// Refused: a NaN, an infinity, a scale that rounds to F16 Inf.
	for _, x := range [][]float32{
		block(1, float32(math.NaN())),
		block(float32(math.NaN()), 1),
		block(float32(math.Inf(-1))),
		block(127 * 65520),
		block(-math.MaxFloat32),
	} {
		_, err := one(x)
		assert.ErrorIs(t, err, arena.ErrQuantize, "%v", x[:2])
	}
	// The blocks before a refused one are written and counted.
	x := append(block(1), block(float32(math.Inf(1)))...)
	bs := make([]arena.BlockQ8_0, 2)
	n, err := arena.QuantizeQ8_0(bs, x)
	assert.ErrorIs(t, err, arena.ErrQuantize)
	assert.Equal(t, 1, n)
	assert.Equal(t, int8(127), bs[0].Qs[0])
}

func TestQ8_0BadInputs(t *testing.T) {
	x := make([]float32, 64)
	x[0] = 127
	bs := make([]arena.BlockQ8_0, 2)
	n, err := arena.QuantizeQ8_0(bs, x[:33])
	assert.ErrorIs(t, err, arena.ErrPartialBlock)
	assert.Zero(t, n)
	assert.Equal(t, arena.BlockQ8_0{}, bs[0], "nothing written")
	n, err = arena.DequantizeQ8_0(x[:31], bs)
	assert.ErrorIs(t, err, arena.ErrPartialBlock)
	assert.Zero(t, n)

	// As copy: the shorter of the two, in blocks.
	n, err = arena.QuantizeQ8_0(bs[:1], x)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	n, err = arena.QuantizeQ8_0(bs, x[:32])
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	n, err = arena.QuantizeQ8_0(nil, x)
	require.NoError(t, err)
	assert.Zero(t, n)
	y := make([]float32, 96)
	for i := range y {
		y[i] = 9
	}
	n, err = arena.DequantizeQ8_0(y, bs)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	assert.Equal(t, float32(127), y[0])
	assert.Equal(t, float32(9), y[64], "past the blocks: untouched")
	n, err = arena.DequantizeQ8_0(y[:32], bs)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}

// TestQ8_0Tensor: a Q8_0 tensor is indexed by block and aligned to the scale's 2
// bytes, not to the block's 34.
func TestQ8_0Tensor(t *testing.T) {
	m := newHeapMem(2 + 6*34)
	v, err := arena.NewTensor[arena.BlockQ8_0](m, 2, 3, 2) // [heads, blocks per head]
	require.NoError(t, err)
	assert.Equal(t, arena.Q8_0, v.DType())
	assert.Equal(t, 6, v.NumElems())
	assert.Equal(t, 6*34, v.NumBytes())
	_, err = arena.NewTensor[arena.BlockQ8_0](m, 1, 1)
	assert.ErrorIs(t, err, arena.ErrMisaligned)
	_, err = arena.NewTensor[arena.BlockQ8_0](m, 4, 3, 2)
	assert.ErrorIs(t, err, arena.ErrOutOfBounds)

	x := make([]float32, 32)
	x[5] = -3
	var b [1]arena.BlockQ8_0
	_, err = arena.QuantizeQ8_0(b[:], x)
	require.NoError(t, err)
	v.Set(b[0], 2, 1)
	s, err := v.Slice()
	require.NoError(t, err)
	require.Len(t, s, 6)
	assert.Equal(t, b[0], s[5])
	assert.Equal(t, int8(-127), v.At(2, 1).Qs[5])
	raw := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(m.words))), m.n)
	assert.Equal(t, byte(0x81), raw[2+5*34+2+5], "block 5's quant 5 is at byte 2 + 5×34 + 2 + 5")

	// An arena aligns a Q8_0 slice to 2 bytes whatever its option asks below that.
	a, _ := newHostArena(t, 1<<20, arena.ArenaOptions{Align: 1})
	_, err = arena.Make[uint8](a, 1)
	require.NoError(t, err)
	q, err := arena.Make[arena.BlockQ8_0](a, 3)
	require.NoError(t, err)
	require.Len(t, q, 3)
	assert.Equal(t, 2+3*34, a.Used())
	qt, err := arena.MakeTensor[arena.BlockQ8_0](a, 2, 4)
	require.NoError(t, err)
	assert.Equal(t, 2+3*34, qt.Offset())
	assert.Zero(t, qt.DevicePtr()%2)
}
