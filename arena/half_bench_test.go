package arena_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/vmarena/vmarena/arena"
)

// convN is the slice length of the conversion benchmarks: 1 Mi elements, 4 MiB of
// float32, past the L2 cache of most machines, as a layer's activations are.
const convN = 1 << 20

// convInput returns n float32 values spread like activations: normal around zero, with
// a few outliers, NaNs and subnormals.
func convInput(n int) []float32 {
	rng := rand.New(rand.NewPCG(5, 6))
	src := make([]float32, n)
	for i := range src {
		src[i] = float32(rng.NormFloat64() * 4)
	}
	for i := 0; i < n; i += 997 {
		src[i] = float32([]float64{math.NaN(), 1e-7, 7e4, -3e-6}[i%4])
	}
	return src
}

func reportElems(b *testing.B, n int) {
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "elems/s")
}

// BenchmarkConvert measures the slice converters (impl=slice) against a loop over the
// scalar conversions (impl=scalar), which is what a caller would write without them.
func BenchmarkConvert(b *testing.B) {
	src := convInput(convN)
	f16 := make([]arena.F16, convN)
	bf16 := make([]arena.BF16, convN)
	dst := make([]float32, convN)
	arena.F16sFromFloat32s(f16, src)
	arena.BF16sFromFloat32s(bf16, src)

	cases := []struct {
		dir    string
		in     int // bytes read per element
		slice  func()
		scalar func()
	}{
		{"float32-to-F16", 4,
			func() { arena.F16sFromFloat32s(f16, src) },
			func() {
				for i, f := range src {
					f16[i] = arena.F16FromFloat32(f)
				}
			}},
		{"F16-to-float32", 2,
			func() { arena.Float32sFromF16s(dst, f16) },
			func() {
				for i, h := range f16 {
					dst[i] = h.Float32()
				}
			}},
		{"float32-to-BF16", 4,
			func() { arena.BF16sFromFloat32s(bf16, src) },
			func() {
				for i, f := range src {
					bf16[i] = arena.BF16FromFloat32(f)
				}
			}},
		{"BF16-to-float32", 2,
			func() { arena.Float32sFromBF16s(dst, bf16) },
			func() {
				for i, h := range bf16 {
					dst[i] = h.Float32()
				}
			}},
	}
	for _, c := range cases {
		for _, impl := range []struct {
			name string
			do   func()
		}{{"slice", c.slice}, {"scalar", c.scalar}} {
			b.Run("dir="+c.dir+"/impl="+impl.name, func(b *testing.B) {
				b.SetBytes(int64(convN * c.in))
				for b.Loop() {
					impl.do()
				}
				reportElems(b, convN)
			})
		}
	}
}
