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

func BenchmarkConvert(b *testing.B) {
	src := convInput(convN)
	f16 := make([]arena.F16, convN)
	bf16 := make([]arena.BF16, convN)
	dst := make([]float32, convN)
	arena.F16sFromFloat32s(f16, src)
	arena.BF16sFromFloat32s(bf16, src)

	b.Run("dir=float32-to-F16", func(b *testing.B) {
		b.SetBytes(convN * 4)
		for b.Loop() {
			arena.F16sFromFloat32s(f16, src)
		}
		reportElems(b, convN)
	})
	b.Run("dir=F16-to-float32", func(b *testing.B) {
		b.SetBytes(convN * 2)
		for b.Loop() {
			arena.Float32sFromF16s(dst, f16)
		}
		reportElems(b, convN)
	})
	b.Run("dir=float32-to-BF16", func(b *testing.B) {
		b.SetBytes(convN * 4)
		for b.Loop() {
			arena.BF16sFromFloat32s(bf16, src)
		}
		reportElems(b, convN)
	})
	b.Run("dir=BF16-to-float32", func(b *testing.B) {
		b.SetBytes(convN * 2)
		for b.Loop() {
			arena.Float32sFromBF16s(dst, bf16)
		}
		reportElems(b, convN)
	})
}
