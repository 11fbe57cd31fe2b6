//go:build linux || darwin || windows

package arena_test

// The seed allocator's own test cases (onnx_runtime_memory_api, src/allocator.rs and
// its capabilities module), ported one by one and named after the case they port.
// The seed's HostAllocator is plain host memory: here that is Eager over
// host.Private, and an Arena where the case holds for it too.

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
)

// hostAllocators returns an Eager and an Arena over host.Private, each released by
// the test's cleanup.
func hostAllocators(t *testing.T) map[string]arena.Allocator {
	t.Helper()
	p, err := host.NewPrivate(host.PrivateOptions{})
	require.NoError(t, err)
	auth := accounting.NewGovernor().Authority("seed", accounting.HostKey)
	e, err := arena.NewEager(p, auth)
	require.NoError(t, err)
	buf, err := arena.NewBuffer(p, 1<<20, auth)
	require.NoError(t, err)
	a, err := arena.NewArena(buf, arena.ArenaOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.Zero(t, e.Live(), "Eager allocations left")
		assert.True(t, a.Close().OK())
		assert.Zero(t, auth.Stats().Owned, "bytes left charged")
	})
	return map[string]arena.Allocator{"Eager": e, "Arena": a}
}

// an_allocator_reports_whether_it_commits_on_demand: an allocator that says nothing
// commits eagerly, and the answer is the allocator's, whatever its backing.
func TestAnAllocatorReportsWhetherItCommitsOnDemand(t *testing.T) {
	assert.False(t, arena.CommitsOnDemand(silent{}), "an allocator that says nothing must be taken to commit eagerly")
	assert.False(t, arena.CommitsOnDemand(silent{virtual: true}), "a virtual backing is not a promise to commit on demand")
	assert.True(t, arena.CommitsOnDemand(stub(true)))
	assert.False(t, arena.CommitsOnDemand(stub(false)))
	all := hostAllocators(t)
	assert.True(t, arena.CommitsOnDemand(all["Arena"]), "an Arena commits as it grows and charges each commit")
	assert.False(t, arena.CommitsOnDemand(all["Eager"]), "Eager commits each allocation whole")
}

// an_eager_allocator_advertises_neither_capability: an eager allocator needs only the
// ordinary contract, and says so.
func TestAnEagerAllocatorAdvertisesNeitherCapability(t *testing.T) {
	e := hostAllocators(t)["Eager"]
	assert.False(t, arena.IsVirtual(e), "no virtual range to grow")
	assert.False(t, arena.CanShare(e), "nothing to share")
	assert.False(t, arena.CommitsOnDemand(e))
	// The ordinary contract is all it takes: allocate, use, release.
	a, err := e.Allocate(4096, 64)
	require.NoError(t, err)
	assert.True(t, e.Release(a).OK())
}

// host_allocations_are_aligned_as_requested: whatever the size.
func TestHostAllocationsAreAlignedAsRequested(t *testing.T) {
	for name, al := range hostAllocators(t) {
		t.Run(name, func(t *testing.T) {
			for _, c := range []struct{ size, align int }{{1, 64}, {100, 64}, {4096, 256}, {7, 8}} {
				a, err := al.Allocate(c.size, c.align)
				require.NoError(t, err, "%d bytes at %d", c.size, c.align)
				assert.Zero(t, a.Ptr%uintptr(c.align), "%d bytes at %d-byte alignment came back at %#x", c.size, c.align, a.Ptr)
				assert.Equal(t, c.size, a.Size)
				assert.True(t, al.Release(a).OK())
			}
		})
	}
}

// a_zero_byte_request_is_not_a_failure: it yields an address, not an error or a nil
// pointer, which a caller could not tell from a failure.
func TestAZeroByteRequestIsNotAFailure(t *testing.T) {
	for name, al := range hostAllocators(t) {
		t.Run(name, func(t *testing.T) {
			a, err := al.Allocate(0, 64)
			require.NoError(t, err, "zero bytes is not an error")
			assert.NotZero(t, a.Ptr, "a zero-byte allocation has an address")
			assert.Zero(t, a.Size)
			assert.True(t, al.Release(a).OK())
		})
	}
}

// a_bad_alignment_is_refused_with_a_reason: the error says what is wrong.
func TestABadAlignmentIsRefusedWithAReason(t *testing.T) {
	for name, al := range hostAllocators(t) {
		t.Run(name, func(t *testing.T) {
			_, err := al.Allocate(64, 3)
			require.ErrorIs(t, err, arena.ErrInvalidAlignment, "3 is not a power of two")
			assert.Contains(t, err.Error(), "power of two", "the error must say what is wrong with the request")
		})
	}
}

// allocations_are_distinct_and_writable: every byte of each live allocation is
// writable, and writing one never reaches the other.
func TestAllocationsAreDistinctAndWritable(t *testing.T) {
	for name, al := range hostAllocators(t) {
		t.Run(name, func(t *testing.T) {
			first, err := al.Allocate(256, 64)
			require.NoError(t, err)
			second, err := al.Allocate(256, 64)
			require.NoError(t, err)
			f, s := hostBytes(first), hostBytes(second)
			for i := range f {
				f[i] = 0x11
			}
			for i := range s {
				s[i] = 0x22
			}
			for i := range 256 {
				if f[i] != 0x11 || s[i] != 0x22 {
					t.Fatalf("byte %d: first %#x, second %#x: one clobbered the other", i, f[i], s[i])
				}
			}
			assert.True(t, al.Release(second).OK())
			assert.True(t, al.Release(first).OK())
		})
	}
}

// the_host_allocator_reports_the_host: callers decide from the device key whether
// the CPU may touch a pointer, so keys tell the host and accelerators apart.
func TestTheHostAllocatorReportsTheHost(t *testing.T) {
	for name, al := range hostAllocators(t) {
		assert.Equal(t, accounting.HostKey, al.Device(), name)
	}
	assert.Equal(t, accounting.Host, accounting.HostKey.Tier)
	assert.Equal(t, accounting.Device, accounting.GPU(1).Tier)
	assert.NotEqual(t, accounting.GPU(0), accounting.GPU(1))
	assert.NotEqual(t, accounting.HostKey, accounting.GPU(0))
}

// hostBytes returns a host allocation's bytes.
func hostBytes(a arena.Allocation) []byte {
	// Safety: a is a live host allocation of a.Size bytes; the bits of a.Ptr are read
	// as a pointer (see touch) because the memory lies outside the Go heap.
	p := *(*unsafe.Pointer)(unsafe.Pointer(&a.Ptr))
	return unsafe.Slice((*byte)(p), a.Size)
}

// silent is an allocator that answers no question about itself but, when virtual,
// whether its memory is a virtual range.
type silent struct{ virtual bool }

func (silent) Allocate(int, int) (arena.Allocation, error) {
	return arena.Allocation{}, arena.ErrInvalidSize
}
func (silent) Release(arena.Allocation) accounting.ReleaseOutcome { return accounting.Released(0) }
func (silent) Device() accounting.DeviceKey                       { return accounting.GPU(0) }
func (s silent) VirtualBacking() bool                             { return s.virtual }

// stub is an allocator that says whether it commits on demand.
type stub bool

func (stub) Allocate(int, int) (arena.Allocation, error) {
	return arena.Allocation{}, arena.ErrInvalidSize
}
func (stub) Release(arena.Allocation) accounting.ReleaseOutcome { return accounting.Released(0) }
func (stub) Device() accounting.DeviceKey                       { return accounting.GPU(0) }
func (s stub) CommitsOnDemand() bool                            { return bool(s) }
