package arena_test

import (
	"fmt"
	"math"

	"github.com/vmarena/vmarena/arena"
)

func ExampleF16FromFloat32() {
	for _, f := range []float32{1, 0.1, 65504, 65520, 1e-8, -3e-8, float32(math.NaN())} {
		h := arena.F16FromFloat32(f)
		fmt.Printf("%-6v -> %#04x = %v\n", f, uint16(h), h)
	}
	// Output:
	// 1      -> 0x3c00 = 1
	// 0.1    -> 0x2e66 = 0.099975586
	// 65504  -> 0x7bff = 65504
	// 65520  -> 0x7c00 = +Inf
	// 1e-08  -> 0x0000 = 0
	// -3e-08 -> 0x8001 = -5.9604645e-08
	// NaN    -> 0x7e00 = NaN
}

func ExampleBF16FromFloat32() {
	for _, f := range []float32{1, 0.1, 3e38, 1e-40} {
		b := arena.BF16FromFloat32(f)
		fmt.Printf("%-6v -> %#04x = %v\n", f, uint16(b), b)
	}
	// Output:
	// 1      -> 0x3f80 = 1
	// 0.1    -> 0x3dcd = 0.100097656
	// 3e+38  -> 0x7f62 = 3.0040553e+38
	// 1e-40  -> 0x0001 = 9.1835e-41
}

func ExampleF16sFromFloat32s() {
	src := []float32{0.5, -2, 1000.25, 7}
	half := make([]arena.F16, 3)
	n := arena.F16sFromFloat32s(half, src) // as copy: the shorter length
	back := make([]float32, n)
	arena.Float32sFromF16s(back, half)
	fmt.Println(n, half, back)
	// Output:
	// 3 [0.5 -2 1000] [0.5 -2 1000]
}
