package arena_test

import (
	"fmt"

	"github.com/vmarena/vmarena/arena"
)

func ExampleF8E4M3FromFloat32() {
	for _, f := range []float32{1, 0.1, 448, 464, 500, 0.001} {
		x, sat := arena.F8E4M3FromFloat32(f), arena.F8E4M3FromFloat32Sat(f)
		fmt.Printf("%-5v -> %#02x = %-9v saturating %#02x = %v\n", f, uint8(x), x, uint8(sat), sat)
	}
	// Output:
	// 1     -> 0x38 = 1         saturating 0x38 = 1
	// 0.1   -> 0x1d = 0.1015625 saturating 0x1d = 0.1015625
	// 448   -> 0x7e = 448       saturating 0x7e = 448
	// 464   -> 0x7e = 448       saturating 0x7e = 448
	// 500   -> 0x7f = NaN       saturating 0x7e = 448
	// 0.001 -> 0x01 = 0.001953125 saturating 0x01 = 0.001953125
}

func ExampleF8E5M2FromFloat32() {
	for _, f := range []float32{1, 0.1, 57344, 61440, 1e-5} {
		x := arena.F8E5M2FromFloat32(f)
		fmt.Printf("%-6v -> %#02x = %v\n", f, uint8(x), x)
	}
	// Output:
	// 1      -> 0x3c = 1
	// 0.1    -> 0x2e = 0.09375
	// 57344  -> 0x7b = 57344
	// 61440  -> 0x7c = +Inf
	// 1e-05  -> 0x01 = 1.5258789e-05
}

// Q8_0 stores blocks of 32 values, each an F16 scale and 32 int8 quants.
func Example_q8_0() {
	x := make([]float32, 64) // two blocks of 32 values
	for i := range x {
		x[i] = float32(i-20) / 4
	}
	blocks := make([]arena.BlockQ8_0, 2)
	n, err := arena.QuantizeQ8_0(blocks, x)
	if err != nil {
		panic(err)
	}
	bytes, _ := arena.Q8_0.Bytes(len(x))
	y := make([]float32, len(x))
	_, _ = arena.DequantizeQ8_0(y, blocks)
	fmt.Println(n, "blocks,", bytes, "bytes; scales", blocks[0].D, blocks[1].D)
	fmt.Println(x[1], "->", blocks[0].Qs[1], "->", y[1])
	// Output:
	// 2 blocks, 68 bytes; scales 0.039367676 0.08465576
	// -4.75 -> -121 -> -4.763489
}
