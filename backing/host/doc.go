// Package host implements the host-memory backings of [backing.Backing]: private
// anonymous memory, and physical granules shared between reservations.
//
// [Private] reserves address space with mmap(PROT_NONE, MAP_NORESERVE) (VirtualAlloc
// MEM_RESERVE on Windows), commits a granule by making it readable and writable
// (mprotect; MEM_COMMIT), and decommits it with MADV_DONTNEED then PROT_NONE (a fresh
// inaccessible mapping on Darwin; MEM_DECOMMIT on Windows), so that the pages go back to
// the OS and a touch faults. Its pages belong to one mapping, so it can not share; it
// is accounted ByBuffer: the caller charges what it commits. Committing costs a
// syscall; the pages cost their first-touch faults, which PrivateOptions.Populate
// moves into Commit (MADV_POPULATE_WRITE where the kernel has it). On Linux its
// mappings can be named, so that /proc/self/maps says whose they are. Systems other
// than Linux, Darwin and Windows get errors.ErrUnsupported from NewPrivate.
//
// [Shared] keeps physical granules in a pool that it owns and charges (ByBacking), on
// Linux a memfd: Commit maps pool granules into a reservation with
// mmap(MAP_SHARED|MAP_FIXED), Share maps the granules behind one range into another
// reservation (the shared-prefix mechanism), and a granule returns to the pool with its
// last mapping. Its pool can be prefilled off the hot path and trimmed, and gives
// idle granules back to the OS by decay once they stay unused. Idle granules wait
// mapped in a park of its own, from which a commit moves them with their page
// tables (mremap), so that their first touch takes no page fault.
//
// # Huge pages
//
// A 2 MiB granule in one transparent huge page costs about a quarter of 512 small
// pages to populate and a tenth to free. Both backings ask for huge pages where the
// granule is a multiple of the huge page and the system allows them
// (/sys/kernel/mm/transparent_hugepage/), unless their options turn them off, and
// report which they use and why not (PrivateStats, SharedStats) and what the kernel
// really gave (HugePages, from smaps). Where memfd memory can have no huge pages
// (shmem_enabled never, the common default) Shared makes new granules private:
// anonymous huge pages of the one reservation, moved into the memfd only when they
// become shared. On a virtual machine that reports its free memory to the host in
// huge-page blocks (virtio_balloon free page reporting) a fresh huge page takes
// host faults and costs more than small pages: there both backings use small pages
// unless their options say AlwaysHugePages, and their stats say why.
//
// On Windows (10 1803 and later) [Shared] keeps one pagefile-backed section per
// granule (CreateFileMapping): a reservation is a placeholder (VirtualAlloc2), a
// commit splits each granule's place off it and maps a view of the granule's
// section there (MapViewOfFile3 MEM_REPLACE_PLACEHOLDER), and a decommit unmaps the
// view leaving a placeholder (UnmapViewOfFile2) and merges it with the free ones
// around it; each reservation keeps the record of its placeholders. Granules are
// 64 KiB (the allocation granularity) or larger. There is no park (Windows has no
// mremap): idle granules wait unmapped, and a commit maps them afresh. Giving a
// granule back closes its section. The same capabilities, errors and accounting
// hold as on Linux; where the system refuses placeholders (Wine 8.0, say) NewShared
// returns errors.ErrUnsupported.
//
// # States
//
// Both follow the states of package backing: Unreserved, Reserved (mapped, no access,
// no memory), Committed (read-write, or read-only for a read-only share or after
// Shared.Protect). A touch of a Reserved address, or a store to a read-only one, faults
// (SIGSEGV), which debug.SetPanicOnFault turns into a panic.
//
// # Errors
//
// Argument and state errors are the backing package's sentinels inside a
// [*backing.OpError]. An OS failure is an *OpError whose Kind classifies it and whose
// Err is the errno, so that errors.Is(err, backing.ErrOutOfMemory) and
// errors.Is(err, unix.ENOMEM) both hold; an ENOMEM that comes from the process's
// mapping limit (vm.max_map_count) is classified [backing.ErrMapLimit] and says so.
// Package-level names are prefixed Private or Shared by backing; [ErrPrivateOptions]
// and the Shared errors are each backing's own.
//
// # Memory management
//
// Every reservation MUST be given back with Unreserve, which unmaps it whole, committed
// granules included; nothing else frees it, not even the GC. A Private backing holds
// nothing but its reservations. A Shared backing also holds its pool, which Close
// gives back, and the park where idle granules wait: address space that maps the
// whole memfd, up to twice its size, in one kernel mapping per chunk (chunks double
// from 1 GiB), so that parked granules cost no vm.max_map_count entries of their
// own.
//
// Memory reached through Base(r)+off is outside the Go heap: it may hold only
// pointer-free data, and it must not be touched after the granule is decommitted or
// the reservation unreserved (it then faults, or worse, aliases a later mapping).
//
// # Concurrency
//
// The backings are safe for concurrent use: distinct reservations, and distinct
// ranges of one reservation, may be committed and decommitted from several goroutines
// at once. Calls on overlapping ranges of one reservation, and copies from a range
// being decommitted, must be serialized by the caller.
package host
