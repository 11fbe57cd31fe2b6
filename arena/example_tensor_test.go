package arena_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
)

func ExampleNewTensor() {
	mem, _ := host.NewPrivate(host.PrivateOptions{})
	buf, _ := arena.NewBuffer(mem, 1<<20, accounting.NewGovernor().Authority("x", accounting.HostKey))
	defer buf.Close()
	_ = buf.Resize(8 * 4096 * 2) // 8 tokens of 4,096 F16 values

	x, err := arena.NewTensor[arena.F16](buf, 0, 8, 4096)
	if err != nil {
		panic(err)
	}
	fmt.Println(x, x.NumElems(), x.NumBytes())

	tokens := x.Sub(2, 4) // tokens 2 and 3: same memory
	fmt.Println(tokens)
	s, _ := tokens.Slice()
	s[0] = arena.F16FromFloat32(0.5)
	fmt.Println(x.At(2, 0))

	heads, _ := x.Reshape(8, 32, 128)
	fmt.Println(heads.Shape(), heads.At(2, 0, 0))

	// Views are checked against the buffer's length.
	_, err = arena.NewTensor[arena.F16](buf, 0, 9, 4096)
	fmt.Println(err)
	// Output:
	// Tensor[float16][8 4096] strides [4096 1] offset 0 32768 65536
	// Tensor[float16][2 4096] strides [4096 1] offset 16384
	// 0.5
	// [8 32 128] 0.5
	// arena: view outside the memory's length: 73728 bytes at offset 0 of 65536
}

func ExampleNewTensorStrided() {
	mem, _ := host.NewPrivate(host.PrivateOptions{})
	buf, _ := arena.NewBuffer(mem, 1<<20, accounting.NewGovernor().Authority("x", accounting.HostKey))
	defer buf.Close()
	_ = buf.Resize(4096)

	m, _ := arena.NewTensor[int32](buf, 0, 2, 3)
	s, _ := m.Slice()
	copy(s, []int32{1, 2, 3, 4, 5, 6})

	// The transpose: same bytes, strides swapped.
	tr, _ := arena.NewTensorStrided[int32](buf, 0, []int{3, 2}, []int{1, 3})
	fmt.Println(tr.At(0, 1), tr.At(2, 0), tr.IsContiguous())
	_, err := tr.Slice()
	fmt.Println(err)
	// Output:
	// 4 3 false
	// arena: tensor is not contiguous: shape [3 2], strides [1 3]
}
