package cuda_test

import (
	"reflect"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/backing/cuda"
)

// The layouts of cuda.h (CUDA 11.4 through 13.0) on LP64: checked against gcc's
// offsetof on the real header (see the CUDA reference notes).
func TestStructLayout(t *testing.T) {
	var loc cuda.MemLocation
	assert.EqualValues(t, 8, unsafe.Sizeof(loc))
	assert.EqualValues(t, 4, unsafe.Alignof(loc))
	assert.EqualValues(t, 0, unsafe.Offsetof(loc.Type))
	assert.EqualValues(t, 4, unsafe.Offsetof(loc.ID))

	var p cuda.MemAllocationProp
	assert.EqualValues(t, 32, unsafe.Sizeof(p))
	assert.EqualValues(t, 0, unsafe.Offsetof(p.Type))
	assert.EqualValues(t, 4, unsafe.Offsetof(p.RequestedHandleTypes))
	assert.EqualValues(t, 8, unsafe.Offsetof(p.Location))
	assert.EqualValues(t, 8, unsafe.Offsetof(p.Location)+unsafe.Offsetof(p.Location.Type))
	assert.EqualValues(t, 12, unsafe.Offsetof(p.Location)+unsafe.Offsetof(p.Location.ID))
	assert.EqualValues(t, 16, unsafe.Offsetof(p.Win32HandleMetaData))
	assert.EqualValues(t, 24, unsafe.Offsetof(p.CompressionType))
	assert.EqualValues(t, 25, unsafe.Offsetof(p.GPUDirectRDMACapable))
	assert.EqualValues(t, 26, unsafe.Offsetof(p.Usage))
	assert.EqualValues(t, 28, unsafe.Offsetof(p.Reserved))
	assert.EqualValues(t, 4, unsafe.Sizeof(p.Reserved))

	var a cuda.MemAccessDesc
	assert.EqualValues(t, 12, unsafe.Sizeof(a))
	assert.EqualValues(t, 4, unsafe.Alignof(a))
	assert.EqualValues(t, 0, unsafe.Offsetof(a.Location))
	assert.EqualValues(t, 8, unsafe.Offsetof(a.Flags))

	// Every field is fixed-width: no int, no Go pointer (the driver reads them).
	for _, typ := range []reflect.Type{reflect.TypeOf(loc), reflect.TypeOf(p), reflect.TypeOf(a)} {
		for i := range typ.NumField() {
			k := typ.Field(i).Type.Kind()
			assert.NotContains(t, []reflect.Kind{reflect.Int, reflect.Uint, reflect.Pointer, reflect.UnsafePointer}, k,
				"%v.%s", typ, typ.Field(i).Name)
		}
	}
}

func TestEnumValues(t *testing.T) {
	for _, tt := range []struct {
		name      string
		got, want int
	}{
		{"CU_MEM_ALLOCATION_TYPE_PINNED", cuda.AllocationPinned, 1},
		{"CU_MEM_LOCATION_TYPE_DEVICE", cuda.LocationDevice, 1},
		{"CU_MEM_HANDLE_TYPE_NONE", cuda.HandleTypeNone, 0},
		{"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", cuda.HandleTypePosixFD, 1},
		{"CU_MEM_ACCESS_FLAGS_PROT_NONE", cuda.AccessNone, 0},
		{"CU_MEM_ACCESS_FLAGS_PROT_READ", cuda.AccessRead, 1},
		{"CU_MEM_ACCESS_FLAGS_PROT_READWRITE", cuda.AccessReadWrite, 3},
		{"CU_MEM_ALLOC_GRANULARITY_MINIMUM", cuda.GranularityMinimum, 0},
		{"CU_MEM_ALLOC_GRANULARITY_RECOMMENDED", cuda.GranularityRecommended, 1},
		{"CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING", cuda.AttrUnifiedAddressing, 41},
		{"CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", cuda.AttrVMMSupported, 102},
		{"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", cuda.AttrPosixFDSupported, 103},
		{"CUDA_ERROR_OUT_OF_MEMORY", int(cuda.CodeOutOfMemory), 2},
		{"CUDA_ERROR_STUB_LIBRARY", int(cuda.CodeStubLibrary), 34},
		{"CUDA_ERROR_NO_DEVICE", int(cuda.CodeNoDevice), 100},
		{"CUDA_ERROR_INVALID_DEVICE", int(cuda.CodeInvalidDevice), 101},
		{"CUDA_ERROR_NOT_SUPPORTED", int(cuda.CodeNotSupported), 801},
	} {
		assert.Equal(t, tt.want, tt.got, tt.name)
	}
}
