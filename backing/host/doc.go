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
// really gave (HugePages, from smaps); where they use small pages and the system
// gives huge pages unasked (enabled is always), they refuse them (MADV_NOHUGEPAGE).
// Unless memfd memory can have huge pages (shmem_enabled never is the common
// default) Shared makes new granules private: anonymous memory of the one
// reservation, huge pages where it may have them and small ones otherwise, moved
// into the memfd only when they become shared. On a virtual machine that reports its free memory to the host in huge-page blocks
// (virtio_balloon free page reporting) a fresh huge page takes host faults and
// costs more than small pages: there both backings use small pages unless their
// options say AlwaysHugePages, and their stats say why.
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
//
// # Shared: slots
//
// A slot of a [Shared] pool is a granule-sized, granule-aligned offset of its memfd
// (a physical granule). It is in one of three states:
//
//  1. Free: not ours. The file has a hole there (or ends before it); it holds no
//     memory and is charged nothing.
//  2. Idle: owned and charged, mapped in no reservation, kept in the pool for the
//     next commit. It is Resident when its pages are known to exist (Prefill,
//     Populate, SharedOptions.Populate).
//  3. Live: owned and charged, mapped in a reservation at least once.
//
// # Shared: new granules and huge pages
//
// A new granule costs its page population: about 0.6 ms per 2 MiB of 4 KiB
// anonymous pages, twice that of 4 KiB shmem pages (fallocate and populate, then
// the punch), 0.06 ms as one anonymous transparent huge page. So:
//
//   - where shmem huge pages are allowed (/sys/kernel/mm/transparent_hugepage/
//     shmem_enabled is always, within_size, advise or force), the granule is a
//     multiple of the huge page and SharedOptions.NoHugePages is not set, the park
//     and every mapping of the memfd ask for them (MADV_HUGEPAGE), and granules
//     are memfd granules as above;
//   - else (on Linux, unless SharedOptions.NoPrivateGranules is set) a commit that
//     must create granules makes them private: anonymous memory of that
//     reservation alone (mprotect read-write), owned and charged like any granule,
//     mapped once. They are anonymous huge pages (MADV_HUGEPAGE) where those are
//     allowed (.../enabled is always or madvise), the granule is a multiple of the
//     huge page and NoHugePages is not set; small pages otherwise, and where the
//     system would give huge pages unasked (enabled is always) they refuse them
//     (MADV_NOHUGEPAGE), so that what SharedStats says is what the kernel does.
//     Idle ones wait in a private park of their own (shared_priv.go). Only a
//     granule that becomes shared moves into the memfd: Share from a private
//     granule first copies it into a memfd granule (an idle one when the pool has
//     one) and moves that over the same address (mremap), so that the source keeps
//     its base and its contents and the granule is owned once, whatever maps it.
//     The move takes no net memory: granules without an idle memfd granule to go
//     to move one at a time, each private granule given back as soon as its copy
//     replaced it, so that a Share is refused for budget only where not even one
//     granule of it is free, and holds at most one granule more while it runs.
//     NB: the copy runs outside the lock, so the source range must not be written
//     while a Share from it runs (a write may be lost); a second Share of a
//     granule being moved waits for the first;
//   - else (NoPrivateGranules, or Windows) granules are memfd granules of small
//     pages. A workload that shares most of what it commits, or that is short of
//     mappings, may prefer these (see SharedOptions.NoPrivateGranules).
//
// A virtual machine that reports its free memory to the host in huge-page blocks
// gets small pages unless SharedOptions.AlwaysHugePages is set: there a fresh huge
// page takes host faults (see BENCHMARKS.md). SharedStats says which of these the
// backing does and, where it falls back, why. The choice is made once, at
// NewShared, from the system's settings then.
//
// A commit takes idle slots first and creates new ones (Free to Live, or private) only
// for the rest, charging the authority for all of them at once before anything is
// touched. It places the granules of one commit, and a granule after its predecessor in
// the reservation, at consecutive file offsets where it can, and maps each consecutive
// run with one call, so that the kernel merges them into one mapping.
//
// # Shared: the park
//
// A fresh mapping of existing pages still takes a minor fault per page on first
// touch, 0.5-0.6 ms per 2 MiB of 4 KiB pages, where rewriting mapped memory costs
// under 10 µs; but a mapping that moves (mremap) takes its page table entries along.
// So the backing keeps the whole memfd mapped in the park, address space of its own,
// one read-write mapping per chunk, where slot i has a fixed place. A commit moves
// each run of slots from the park into the reservation (mremap with MREMAP_FIXED and
// MREMAP_DONTUNMAP: the park keeps its mapping, without the entries), and a
// decommit or Unreserve that removes a granule's last mapping, a read-write one,
// moves it back to the slot's place while the pool keeps the granule. An idle
// granule thus waits with the page tables its last mapping built, all of them after
// Prefill, or after a sequence wrote every page: the commit that takes it costs a
// few µs and its first touch takes no fault. Granules whose last mapping was
// read-only, or that a move could not take (the kernel refuses MREMAP_DONTUNMAP of
// shared mappings before 5.13), go idle without page tables and are mapped afresh.
//
// Nothing is ever unmapped in a reservation or the park but as a whole, so no other
// mmap of the process can land in either.
//
// # Shared: memory management
//
// Accounting is [backing.ByBacking] with SharedOptions.Authority: the authority's
// owned bytes are the bytes of every Idle and Live slot, and its mapped bytes those of
// every mapping (a slot mapped 64 times is owned once and mapped 64 times). Callers
// must not charge committed bytes again. Every reservation MUST be given back with
// Unreserve, and the backing with Close.
//
// The pool gives idle granules back to the OS (fallocate PUNCH_HOLE; a private one
// by mapping reserved memory over its place in the private park) by decay: those
// above Low leave gradually once unused, all of them within SharedOptions.Decay
// (5 s by default) after the load stops, while a busy pool keeps its working set
// (see shared_decay.go). Idle time is measured on the monotonic clock: a step of the
// wall clock changes no granule's age. It also gives them back above the High water mark, on Trim,
// and, while another owner's request waits for host memory, at once as they go idle,
// so that memory kept for this pool's future commits is not held against a caller
// that needs it now; each time such a request starts to wait, the pool's reclaimer
// (see accounting.Authority.SetReclaimer) gives back every granule already idle.
// While only this pool's own requests wait (CommitCtx, or a caller's
// Authority.AcquireFor), granules that go idle are handed to them instead, rather
// than given to the OS to be made again: the pool puts every idle granule's bytes
// idle on its authority (accounting.Authority.PutIdle), and the governor's FIFO queue
// serves them from those as from free budget, in the order they came; the pool takes
// an idle granule out for anything else only through Authority.TakeIdle. A granule
// that can not be given back (the punch fails) stays idle and owned; the next Trim
// tries again.
//
// Pooled granules keep their old contents: CommitZeroes is false, and a recommitted
// or shared range reads whatever was last written there. Granules new to the file
// read as zero.
//
// Bookkeeping costs 12 bytes per reserved granule and a few bytes per slot of the
// file, which only grows (sparse: holes cost nothing). The park costs address space,
// not memory: its chunks double from 1 GiB, so it spans at most twice the file; the
// private park, High granules of address space.
// Reservations and park chunks of granules of 2 MiB or more are aligned to 2 MiB, so
// that the kernel moves whole page-table pages; a reservation may use up to 2 MiB of
// address space more than its size for that.
//
// # Shared: limits
//
// Each run of consecutive slots mapped at consecutive addresses is one kernel
// mapping, and a process has at most vm.max_map_count of them (65530 by default).
// Idle granules cost none: the park stays one mapping per chunk (up to three with
// alignment padding), whatever moves in and out, since what comes back maps the same
// file offsets and merges.
// Private granules do not merge once moved: each run that moved into or out of the
// private park with one call (all of a commit's or decommit's granules where the
// park is not fragmented) is a mapping, one per granule at most.
// When mmap fails with ENOMEM and the process is near that limit, the error wraps
// [backing.ErrMapLimit] and unix.ENOMEM and names the count, the limit and the
// sysctl that raises it. Placing consecutive granules at consecutive offsets keeps
// the count low; granules shared piecemeal or recycled from a fragmented pool do not
// merge.
//
// # Shared: concurrency
//
// A Shared is safe for concurrent use, with the usual rule of [backing.Backing]:
// calls on overlapping ranges (of one reservation, or the source and destination of a
// Share) must be serialized by the caller. Bookkeeping is under one mutex, held
// across mmap and mremap (which the kernel serializes per process anyway) but not
// across page population or fallocate, which run outside it on slots marked busy.
// The lock order is that mutex, then the governor's (the pool charges, maps and puts
// idle on its authority while it holds its own); a waiting commit holds neither while
// it waits. Close must not run concurrently with any other call.
package host
