package cuda

// Layouts and enum values of the driver's VMM structs (cuda.h, unchanged from CUDA 11.4
// through 13.0). The structs are only ever passed by pointer; every field is fixed-width
// so that the Go layout equals the C layout on LP64 and LLP64 (see types_test.go).

// MemLocation mirrors CUmemLocation: 8 bytes.
type MemLocation struct {
	Type int32 // CUmemLocationType: LocationDevice
	ID   int32 // the device ordinal
}

// MemAllocationProp mirrors CUmemAllocationProp: 32 bytes, no padding.
type MemAllocationProp struct {
	Type                 int32 // CUmemAllocationType: AllocationPinned
	RequestedHandleTypes int32 // CUmemAllocationHandleType: HandleTypeNone
	Location             MemLocation
	Win32HandleMetaData  uintptr // must be 0 outside Windows IPC
	CompressionType      uint8
	GPUDirectRDMACapable uint8
	Usage                uint16
	Reserved             [4]uint8 // must be 0
}

// MemAccessDesc mirrors CUmemAccessDesc: 12 bytes.
type MemAccessDesc struct {
	Location MemLocation
	Flags    int32 // CUmemAccess_flags: AccessRead or AccessReadWrite
}

// Enum values used here.
const (
	AllocationPinned  = 1 // CU_MEM_ALLOCATION_TYPE_PINNED
	LocationDevice    = 1 // CU_MEM_LOCATION_TYPE_DEVICE
	HandleTypeNone    = 0 // CU_MEM_HANDLE_TYPE_NONE
	HandleTypePosixFD = 1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

	AccessNone      = 0 // CU_MEM_ACCESS_FLAGS_PROT_NONE
	AccessRead      = 1 // CU_MEM_ACCESS_FLAGS_PROT_READ
	AccessReadWrite = 3 // CU_MEM_ACCESS_FLAGS_PROT_READWRITE

	GranularityMinimum     = 0 // CU_MEM_ALLOC_GRANULARITY_MINIMUM
	GranularityRecommended = 1 // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED

	AttrUnifiedAddressing = 41  // CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
	AttrVMMSupported      = 102 // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
	AttrPosixFDSupported  = 103 // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
)

// deviceProp returns the allocation properties of pinned memory on device dev.
func deviceProp(dev int32) MemAllocationProp {
	return MemAllocationProp{Type: AllocationPinned, RequestedHandleTypes: HandleTypeNone, Location: MemLocation{Type: LocationDevice, ID: dev}}
}
