package arena

import "github.com/vmarena/vmarena/accounting"

// Allocator is the plain eager-allocator contract: memory of one device handed out by
// size and alignment and given back whole, as cudaMalloc and cudaFree do. Code written
// against it runs on any implementation; what more one can do is asked by type
// assertion ([VirtualBacking], [Sharing], [OnDemand]), as io.WriterTo is.
type Allocator interface {
	// Allocate returns size bytes whose address is a multiple of align, a positive
	// power of two. The allocation MUST be given back with Release (or, for an
	// [Arena], by a Reset or Rewind past it).
	Allocate(size, align int) (Allocation, error)
	// Release gives back a and reports honestly what was given back to the system:
	// Complete (Unmapped may be 0 when the memory stays with the allocator for reuse),
	// Failed when nothing changed, Quarantined when something did. Releasing an
	// allocation another allocator made panics with PanicForeignAllocation.
	Release(a Allocation) accounting.ReleaseOutcome
	// Device returns the memory the allocations live in.
	Device() accounting.DeviceKey
}

// Allocation is one block handed out by an Allocator. Its zero value is no allocation.
type Allocation struct {
	// Ptr is the first address: a device address on a device, never dereferenced on
	// the CPU.
	Ptr uintptr
	// Size is the size asked for, in bytes.
	Size int

	owner any    // the allocator that made it
	id    uint64 // the owner's serial number of it (0: none)
}

// VirtualBacking is implemented by allocators that can answer whether their memory is
// a reserved virtual range committed in granules, whose base never moves: growth
// never copies and never invalidates an address already handed out.
type VirtualBacking interface {
	VirtualBacking() bool
}

// OnDemand is implemented by allocators that can answer the seed's commits_on_demand
// (onnx_runtime_memory_api, src/allocator.rs: DeviceAllocator::commits_on_demand):
// whether they map physical memory only as it is used AND charge a governor for it as
// they map it. Only then may a consumer hold a worst case it knows (a KV cache at the
// model's full context) as a ceiling to check rather than a claim to take up front.
//
// It is a promise about accounting, not a capability: an allocator on a virtual
// backing may still answer false (Eager commits every allocation whole, when it is
// made), and one that answered true without charging a governor would turn an
// accounting question into an out-of-memory crash. Saying nothing is answering false,
// the safe answer: a consumer that believes false reserves more than it needs, never
// less.
type OnDemand interface {
	CommitsOnDemand() bool
}

// Sharing is implemented by allocators that can answer whether their memory's backing
// can map one physical granule into several ranges (backing.Sharer under ByBacking),
// the mechanism of shared prefixes.
type Sharing interface {
	CanShare() bool
}

// IsVirtual reports whether a says it sits on a virtual-memory backing.
func IsVirtual(a Allocator) bool {
	v, ok := a.(VirtualBacking)
	return ok && v.VirtualBacking()
}

// CanShare reports whether a says its backing can share physical granules.
func CanShare(a Allocator) bool {
	s, ok := a.(Sharing)
	return ok && s.CanShare()
}

// CommitsOnDemand reports whether a promises to commit on demand and charge as it
// commits ([OnDemand]); false when it says nothing.
func CommitsOnDemand(a Allocator) bool {
	o, ok := a.(OnDemand)
	return ok && o.CommitsOnDemand()
}
