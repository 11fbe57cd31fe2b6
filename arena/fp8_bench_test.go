package arena_test

import (
	"testing"

	"github.com/vmarena/vmarena/arena"
)

// BenchmarkConvert8 measures the 8-bit conversions and Q8_0 against F16's in the same
// run, each reported in ns/value (and Q8_0 in ns/block too): impl=scalar is a loop over
// the one-value function, impl=slice the slice converter.
func BenchmarkConvert8(b *testing.B) {
	src := convInput(convN)
	f16 := make([]arena.F16, convN)
	e4 := make([]arena.F8E4M3, convN)
	e5 := make([]arena.F8E5M2, convN)
	q8 := make([]arena.BlockQ8_0, convN/arena.Q8_0BlockValues)
	dst := make([]float32, convN)
	arena.F16sFromFloat32s(f16, src)
	arena.F8E4M3sFromFloat32s(e4, src)
	arena.F8E5M2sFromFloat32s(e5, src)
	// Q8_0 refuses NaN and a scale past F16's range: its input has neither.
	q8src := append([]float32(nil), src...)
	for i, f := range q8src {
		if f != f {
			q8src[i] = 0
		}
		q8src[i] = min(max(q8src[i], -1e5), 1e5)
	}
	if _, err := arena.QuantizeQ8_0(q8, q8src); err != nil {
		b.Fatal(err)
	}

	type bench struct {
		name     string
		do       func()
		perBlock bool
	}
	cases := []bench{
		{name: "dir=float32-to-F16/impl=scalar", do: func() {
			for i, f := range src {
				f16[i] = arena.F16FromFloat32(f)
			}
		}},
		{name: "dir=float32-to-F16/impl=slice", do: func() { arena.F16sFromFloat32s(f16, src) }},
		{name: "dir=F16-to-float32/impl=scalar", do: func() {
			for i, h := range f16 {
				dst[i] = h.Float32()
			}
		}},
		{name: "dir=F16-to-float32/impl=slice", do: func() { arena.Float32sFromF16s(dst, f16) }},
		{name: "dir=float32-to-F8E4M3/impl=scalar", do: func() {
			for i, f := range src {
				e4[i] = arena.F8E4M3FromFloat32(f)
			}
		}},
		{name: "dir=float32-to-F8E4M3/impl=scalar-sat", do: func() {
			for i, f := range src {
				e4[i] = arena.F8E4M3FromFloat32Sat(f)
			}
		}},
		{name: "dir=float32-to-F8E4M3/impl=slice", do: func() { arena.F8E4M3sFromFloat32s(e4, src) }},
		{name: "dir=F8E4M3-to-float32/impl=scalar", do: func() {
			for i, x := range e4 {
				dst[i] = x.Float32()
			}
		}},
		{name: "dir=F8E4M3-to-float32/impl=slice", do: func() { arena.Float32sFromF8E4M3s(dst, e4) }},
		{name: "dir=float32-to-F8E5M2/impl=scalar", do: func() {
			for i, f := range src {
				e5[i] = arena.F8E5M2FromFloat32(f)
			}
		}},
		{name: "dir=F8E5M2-to-float32/impl=scalar", do: func() {
			for i, x := range e5 {
				dst[i] = x.Float32()
			}
		}},
		{name: "dir=float32-to-Q8_0/impl=slice", do: func() {
			if _, err := arena.QuantizeQ8_0(q8, q8src); err != nil {
				b.Fatal(err)
			}
		}, perBlock: true},
		{name: "dir=Q8_0-to-float32/impl=slice", do: func() {
			if _, err := arena.DequantizeQ8_0(dst, q8); err != nil {
				b.Fatal(err)
			}
		}, perBlock: true},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				c.do()
			}
			ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(ns/convN, "ns/value")
			if c.perBlock {
				b.ReportMetric(ns/float64(len(q8)), "ns/block")
			}
		})
	}
}
