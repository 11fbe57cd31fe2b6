// Package host implements the host-memory backings of [backing.Backing]: private
// anonymous memory, and physical granules shared between reservations.
//
// [Private] commits and decommits granules of private anonymous memory in place
// (mprotect and MADV_DONTNEED; VirtualAlloc on Windows), so that decommitted pages go
// back to the OS and a touch faults. It can not share, and is accounted ByBuffer: the
// caller charges what it commits. PrivateOptions.Populate moves the pages' first-touch
// faults into Commit. It runs on Linux, Darwin and Windows.
//
// [Shared] keeps physical granules in a pool that it owns and charges (ByBacking), on
// Linux a memfd: Commit maps pool granules into a reservation, Share maps the granules
// behind one range into another reservation (the shared-prefix mechanism), and a
// granule returns to the pool with its last mapping. The pool can be prefilled off the
// hot path and trimmed, and gives idle granules back to the OS by decay once they stay
// unused (SharedOptions.Decay, 5 s by default). Idle granules keep their page tables
// in a park, so that a commit of one takes no page fault on its first touch. On
// Windows (10 1803 and later) a granule is a pagefile-backed section and a
// reservation a placeholder that views replace; where the system refuses placeholders
// (Wine 8.0, say) NewShared returns errors.ErrUnsupported.
//
// Both ask for transparent huge pages where the granule is a multiple of the huge page
// and the system allows them, unless their options turn them off, and report which
// they use, why not, and what the kernel gave (PrivateStats, SharedStats, HugePages).
// On a virtual machine that reports its free memory to the host in huge-page blocks
// (virtio_balloon free page reporting) a fresh huge page takes host faults and costs
// more than small pages: there both use small pages unless told AlwaysHugePages.
//
// # Errors
//
// Argument and state errors are the backing package's sentinels inside a
// [*backing.OpError]. An OS failure is an *OpError whose Kind classifies it and whose
// Err is the errno, so that errors.Is(err, backing.ErrOutOfMemory) and
// errors.Is(err, unix.ENOMEM) both hold; an ENOMEM that comes from the process's
// mapping limit (vm.max_map_count) is classified [backing.ErrMapLimit] and names the
// count, the limit and the sysctl that raises it. Package-level names are prefixed
// Private or Shared by backing; [ErrPrivateOptions] and the Shared errors are each
// backing's own.
//
// # Memory management
//
// Both follow the states of package backing: Unreserved, Reserved (mapped, no access,
// no memory), Committed (read-write, or read-only for a read-only share or after
// Shared.Protect). A touch of a Reserved address, or a store to a read-only one, faults
// (SIGSEGV), which debug.SetPanicOnFault turns into a panic. Memory reached through
// Base(r)+off is outside the Go heap: it may hold only pointer-free data, and it must
// not be touched after the granule is decommitted or the reservation unreserved (it
// then faults, or worse, aliases a later mapping).
//
// Every reservation MUST be given back with Unreserve, which unmaps it whole, committed
// granules included; nothing else frees it, not even the GC. A Shared also holds its
// pool, which Close gives back. Its authority (SharedOptions.Authority) owns the bytes
// of every granule in the pool, idle or mapped, and maps those of every mapping (a
// granule mapped 64 times is owned once and mapped 64 times); callers must not charge
// committed bytes again. Pooled granules keep their old contents: CommitZeroes is
// false, and a recommitted or shared range reads whatever was last written there;
// granules new to the pool read as zero.
//
// # Concurrency
//
// The backings are safe for concurrent use: distinct reservations, and distinct ranges
// of one reservation, may be committed and decommitted from several goroutines at
// once. Calls on overlapping ranges (of one reservation, or the source and destination
// of a Share), and copies from a range being decommitted, must be serialized by the
// caller. Close must not run concurrently with any other call. Shared's bookkeeping
// is under one mutex, held across mmap and mremap but not across page population or
// fallocate; the lock order is that mutex, then the governor's (the pool charges, maps
// and puts idle on its authority while it holds its own), and a waiting commit holds
// neither while it waits.
//
// Each file's first comment tells the mechanism it holds: shared_commit.go, the pool's
// slots and how idle ones leave (shared_pool.go, shared_decay.go), the park
// (shared_park.go), private granules (shared_priv.go), shared_share.go, hugepage.go,
// and on Windows shared_windows.go and shared_placeholder.go.
package host
